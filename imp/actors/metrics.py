"""Metrics actor: turns figures and stats messages into Prometheus series.

It owns a private CollectorRegistry (one per engine, so tests can run several
servers in one process) and the latest Figures, which /health reads. Every
series the reference names exists from start, at zero, so dashboards can be
built before traffic; the ones for things imp never does (grow the pool,
switch on StreamingLLM eviction, swap KV to host) stay at zero and say so.
"""

from __future__ import annotations

import collections
import time
from typing import NamedTuple

import msgspec

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from imp.actors.base import Actor, Bus
from imp.actors.request_log import timeline
from imp.messages import Fault, Figures, KvFigures, MemoryState, Msg, QueueFigures, RequestStats, StepStats

# the generation routes (a series per route, at zero before traffic), embeddings / rerank,
# and /v1/score's items (each one engine request)
ENDPOINTS = ("chat_completions", "completions", "messages", "infill", "responses", "embeddings", "rerank", "score")
# imp_lora_requests_info's max_lora: imp keeps no per-batch adapter slots (every loaded adapter serves at
# once), so it tells an endpoint picker there is room; a picker that compares it with the running adapters
# then never counts this server full
MAX_LORA = 64
_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Rates:
    """Token rates measured from StepStats (the executor's step time).

    A step that carries prefill tokens counts all its time as prefill (a mixed
    step's decodes make the prefill rate read low, never high); only pure
    decode steps feed the decode rates. `now` is the latest decode step, if
    it ran within `stale_s`; `recent` the last `window` decode steps; lifetime
    every decode step since start. `boot_prefill_tok_s`, a warm-up prefill's
    rate measured at boot, stands in for the recent prefill rate until a real
    prefill step has run (so /v1/estimate has an est_ttft_s from the start).
    """

    def __init__(self, window: int = 64, prefill_window: int = 16, stale_s: float = 2.0,
                 boot_prefill_tok_s: float | None = None):
        self.decode = collections.deque(maxlen=window)  # (tokens, seconds)
        self.prefill = collections.deque(maxlen=prefill_window)
        self.stale_s = stale_s
        self.boot_prefill_tok_s = boot_prefill_tok_s if boot_prefill_tok_s and boot_prefill_tok_s > 0 else None
        self.decode_tokens = 0
        self.decode_s = 0.0
        self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.last_decode: tuple[int, float, float] | None = None  # (streams, tok/s, when)

    def observe(self, msg: StepStats, now: float) -> None:
        secs = msg.elapsed_ns / 1e9
        if secs <= 0 or msg.num_tokens <= 0:
            return
        n_prefill = msg.num_tokens - msg.num_decode
        if n_prefill > 0:
            self.prefill.append((n_prefill, secs))
            self.prefill_tokens += n_prefill
            self.prefill_s += secs
        elif msg.num_decode > 0:
            self.decode.append((msg.num_decode, secs))
            self.decode_tokens += msg.num_decode
            self.decode_s += secs
            self.last_decode = (msg.num_decode, msg.num_decode / secs, now)

    @staticmethod
    def _mean(rows) -> float | None:
        secs = sum(s for _, s in rows)
        return sum(t for t, _ in rows) / secs if secs > 0 else None

    @property
    def prefill_tok_s_recent(self) -> float | None:
        """Prefill tokens per second over the recent prefill steps; the boot warm-up's rate
        before the first; None without either."""
        measured = self._mean(self.prefill)
        return measured if measured is not None else self.boot_prefill_tok_s

    def snapshot(self, now: float) -> dict:
        last = self.last_decode
        fresh = last is not None and now - last[2] <= self.stale_s

        def rnd(v):
            return None if v is None else round(v, 1)

        return {
            "decode_tok_s": rnd(last[1]) if fresh else 0.0,
            "decode_streams": last[0] if fresh else 0,
            "prefill_tok_s_recent": rnd(self.prefill_tok_s_recent),
            "decode_tok_s_recent": rnd(self._mean(self.decode)),
            "decode_tok_s_lifetime": rnd(self.decode_tokens / self.decode_s) if self.decode_s > 0 else None,
            "prefill_tok_s_lifetime": rnd(self.prefill_tokens / self.prefill_s) if self.prefill_s > 0 else None,
            "decode_tokens_total": self.decode_tokens,
            "prefill_tokens_total": self.prefill_tokens,
        }


def _sum_figures(figs: list[Figures]) -> Figures:
    if len(figs) == 1:
        return figs[0]
    add = lambda structs: type(structs[0])(*(sum(vals) for vals in zip(*(msgspec.structs.astuple(x) for x in structs))))  # noqa: E731
    kv = add([f.kv for f in figs])
    return Figures(msgspec.structs.replace(kv, block_size=figs[0].kv.block_size), add([f.queue for f in figs]))


def refused(m: RequestStats) -> bool:
    """Refused before generation (4xx, 429, 503): not timed, not traced."""
    return 400 <= m.status < 500 or m.status == 503


def kv_refusal(m: RequestStats, pool_tokens: int) -> bool:
    """Refused because the prompt cannot get blocks from one KV pool: admission's capacity
    check comes before its context check, so a context_length_exceeded refusal of a prompt
    larger than the pool is this one."""
    return m.reject_code == "context_length_exceeded" and m.prompt_tokens + 1 > pool_tokens


class OtlpCounters(NamedTuple):
    """The OTLP exporter's counters: here so they exist (at zero) without an exporter;
    the exporter's thread increments them (prometheus-client counters are thread-safe)."""

    spans_exported: Counter
    export_failures: Counter
    unsampled: Counter


class MetricsActor(Actor):
    name = "metrics"

    def __init__(self, bus: Bus, model_name: str, kv: KvFigures, sources: list[str] | None = None, *,
                 boot_prefill_tok_s: float | None = None, kv_block_bytes: int = 0):
        """kv: one scheduler's pool at boot; sources: the scheduler replicas
        (data parallel), whose figures are summed; boot_prefill_tok_s: the boot
        warm-up's prefill rate (see Rates); kv_block_bytes: one KV block's bytes (the tiers' and
        the swap area's byte counters)."""
        super().__init__(bus)
        self.registry = r = CollectorRegistry()
        self._figs = {name: Figures(kv, QueueFigures(0, 0, 0)) for name in (sources or ["scheduler"])}
        kv = _sum_figures(list(self._figs.values())).kv
        self.kv = kv
        self.queue = QueueFigures(0, 0, 0)
        self.faults: list[str] = []
        g = lambda n, d, *l: Gauge(n, d, l, registry=r)  # noqa: E731
        c = lambda n, d, *l: Counter(n, d, l, registry=r)  # noqa: E731 (exposed as n + "_total")
        h = lambda n, d, *l: Histogram(n, d, l, buckets=_LAT, registry=r)  # noqa: E731
        self.g_model = g("imp_model_loaded", "1 while the model is loaded", "model")
        self.model_name = model_name
        self.g_model.labels(model_name).set(1)
        self.g_kv = {k: g(f"imp_kv_blocks_{k}", f"KV blocks {k}") for k in ("total", "free", "used", "cached", "pinned")}
        self.g_kv["reserved"] = g("imp_kv_blocks_reserved", "KV blocks admission promised to running requests for "
                                  "their expected generation and not yet written; free minus this is what the "
                                  "next request is admitted against")
        # the KV pool's use as a fraction, for balancers that read one gauge (the Gateway API Inference
        # Extension's endpoint picker: --kv-cache-usage-percentage-metric): the memory band's pressure,
        # max(used, reserved) / total (imp.http.endpoints.capacity.kv_pressure: reserved already counts
        # the used blocks of running requests, and is what admission measures the next request against)
        self.g_kv_usage = g("imp_kv_cache_usage_perc", "KV pool in use, 0..1: max(used, reserved) / total blocks")
        # the endpoint picker's LoRA affinity reads vLLM's lora_requests_info shape (--lora-info-metric): the
        # adapters this server holds, its value the time they last changed. Every loaded adapter is resident
        # and serves at once (no per-batch adapter slots), so all are "running" and none "waiting"
        self.g_lora = g("imp_lora_requests_info", "loaded LoRA adapters (vLLM's lora_requests_info labels); value: "
                        "unix time of the last change", "max_lora", "running_lora_adapters", "waiting_lora_adapters")
        self.set_loras((), time.time())
        self.g_waiting = g("imp_queue_waiting", "requests waiting for their first batch")
        self.g_running = g("imp_queue_running", "requests in the running batch")
        self.g_depth = g("imp_queue_depth", "waiting + running")
        self.g_qtokens = g("imp_queued_prompt_tokens", "prompt tokens not yet past prefill (--max-queued-tokens)")
        self.g_batch_last = g("imp_decode_batch_last_rows", "sequences in the most recent step; 0 while idle")
        self.g_max_batch = g("imp_decode_batch_max", "largest step so far (never resets)")
        self.c_evict = c("imp_prefix_cache_evictions", "cached prefix blocks reclaimed for a new allocation")
        self.c_inflight = c("imp_prefix_cache_inflight_waits", "allocations that waited a round for prompt blocks "
                            "another request was computing (then found them cached instead of computing them again)")
        self.g_tier = g("imp_kv_tier_blocks", "KV blocks the prefix cache's disk tier holds (--prompt-cache-dir)")
        self.c_tier = {k: c(f"imp_kv_tier_{k}", why) for k, why in (
            ("saves", "cached KV blocks written to the disk tier"),
            ("loads", "KV blocks asked for from the disk tier (a prompt's chain went on there)"),
            ("hits", "KV blocks read back from the disk tier into the pool (promotions)"),
            ("misses", "disk tier reads that found the file missing, corrupt or foreign (computed instead)"),
            ("drops", "disk tier blocks deleted for its size (--prompt-cache-gb), least recently used first"))}
        self._tier = dict.fromkeys(self.c_tier, 0)
        self.c_preempt = c("imp_preemptions", "running requests preempted for KV (recomputed later)")
        self.c_cancel = c("imp_requests_cancelled", "requests cancelled by client disconnect")
        self.c_timeout = c("imp_requests_timed_out", "requests ended at --request-timeout (the client sees "
                           "finish_reason length)")
        self.c_kv_reject = c("imp_kv_pressure_rejections", "requests refused because the KV pool cannot give "
                             "them blocks (admission); mid-decode imp preempts and recomputes instead "
                             "(imp_preemptions_total), it never cancels")
        self.c_growths = c("imp_kv_pool_growths", "KV pool growths: always 0, the pool is sized once at boot "
                           "and does not grow")
        self.c_streaming = c("imp_streaming_kv_auto_enables", "StreamingLLM eviction switched on: always 0, "
                             "imp has no StreamingLLM eviction (a full pool preempts)")
        self.g_swap = g("imp_kv_swap_blocks_used", "blocks of the host swap area that preempted requests hold")
        bb = kv_block_bytes
        # counters that follow a running total of the allocator's figures
        self._kv_totals = [(c(name, why), total) for name, why, total in (
            ("imp_kv_swaps", "running requests preempted for want of blocks whose KV moved to the host swap area "
             "instead of being recomputed (--swap-space, --preemption-mode)", lambda k: k.swaps_out),
            ("imp_kv_swap_ins", "preempted requests whose KV came back from the swap area", lambda k: k.swaps_in),
            ("imp_kv_swap_bytes", "KV bytes copied to the swap area and back", lambda k: k.swap_copies * bb),
            ("imp_kv_tier_host_hits", "of imp_kv_tier_hits, blocks read back from the host tier (--host-cache-gb), "
             "not from disk", lambda k: k.tier_host_hits),
            ("imp_kv_tier_written_bytes", "KV bytes written to the prefix cache's tiers (demotions)",
             lambda k: k.tier_saves * bb),
            ("imp_kv_tier_read_bytes", "KV bytes read back from the prefix cache's tiers into the pool (promotions)",
             lambda k: k.tier_hits * bb))]
        self._kv_last = [0] * len(self._kv_totals)
        self.c_steps = c("imp_decode_batch_steps", "engine steps")
        # speculation (imp/core/spec.py): in aggregate, and per draft source (the n-gram matcher; no file
        # this server loads has an MTP head, so imp_spec_mtp_* stay 0). A verify step = one sequence's
        # verify share; it emits its accepted drafts + 1
        self.c_spec = {k: c(f"imp_spec_{k}", d) for k, d in (
            ("drafted", "draft tokens fed to verify steps"), ("accepted", "draft tokens the model kept"),
            ("verify_steps", "verify steps (one sequence's draft checked in one engine step)"),
            ("miss_steps", "verify steps that kept none of their draft"))}
        self.c_spec_src = {(src, k): c(f"imp_spec_{src}_{k}", f"{d} ({what})") for src, what in (
            ("ngram", "the n-gram / suffix matcher over the request's prompt and output"),
            ("mtp", "a trained MTP head: none is loaded, always 0")) for k, d in (
            ("drafted", "draft tokens"), ("accepted", "draft tokens kept"), ("emitted", "tokens its verify steps emitted"),
            ("verify_steps", "verify steps"), ("verify_wall_ms", "wall ms of the engine steps that verified its drafts"))}
        self.c_rows = c("imp_decode_batch_rows", "sequences summed over steps")
        self.c_gen = c("imp_tokens_generated", "completion tokens")
        self.c_prompt = c("imp_tokens_prompt", "prompt tokens")
        self.c_cached = c("imp_tokens_cached", "prompt tokens served from the prefix cache")
        self.c_faults = c("imp_actor_faults", "actors that failed")
        self.c_req = c("imp_requests", "generation requests finished (refusals included)")
        self.c_ep = c("imp_endpoint_requests", "generation requests by endpoint", "endpoint")
        self.c_ignored = c("imp_ignored_fields", "request body fields no one defines, reported and ignored "
                           "(the imp-ignored-fields header; --strict-fields refuses them)", "endpoint", "field")
        self._ignored_labels: set[str] = set()  # field labels seen: bounded, the names are the client's
        self.otlp = OtlpCounters(
            c("imp_otlp_spans_exported", "spans the OTLP collector accepted (SERVER spans and their children)"),
            c("imp_otlp_export_failures", "OTLP export batches that failed (their spans are dropped)"),
            c("imp_otlp_unsampled_requests", "requests not exported: their traceparent's sampled flag was clear"),
        )
        lat = ("request_duration", "ttft", "queue_time", "inter_token")
        self.h = {k: h(f"imp_{k}_seconds", f"{k} latency") for k in lat}
        self.h_ep = {k: h(f"imp_endpoint_{k}_seconds", f"{k} latency by endpoint", "endpoint") for k in lat}
        for ep in ENDPOINTS:
            self.c_ep.labels(ep)
            for hh in self.h_ep.values():
                hh.labels(ep)
        self._max_batch = 0
        self._last: QueueFigures = self.queue
        self._evictions = self._inflight = 0
        self.rates = Rates(boot_prefill_tok_s=boot_prefill_tok_s)
        self._apply_kv(kv)

    def set_loras(self, names: tuple[str, ...], now: float) -> None:
        """The loaded adapters changed (LocalEngine after a load or unload)."""
        self.g_lora.clear()
        self.g_lora.labels(str(MAX_LORA), ",".join(names), "").set(now)

    def _apply_kv(self, kv: KvFigures) -> None:
        for k, gauge in self.g_kv.items():
            gauge.set(getattr(kv, k))
        self.g_kv_usage.set(max(kv.used, kv.reserved) / kv.total if kv.total else 1.0)
        if kv.evictions > self._evictions:
            self.c_evict.inc(kv.evictions - self._evictions)
            self._evictions = kv.evictions
        if kv.inflight_waits > self._inflight:
            self.c_inflight.inc(kv.inflight_waits - self._inflight)
            self._inflight = kv.inflight_waits
        self.g_tier.set(kv.tier_blocks)
        self.g_swap.set(kv.swap_used)
        for i, (ctr, total) in enumerate(self._kv_totals):
            v = total(kv)
            if v > self._kv_last[i]:
                ctr.inc(v - self._kv_last[i])
                self._kv_last[i] = v
        for k, ctr in self.c_tier.items():
            v = getattr(kv, f"tier_{k}")
            if v > self._tier[k]:
                ctr.inc(v - self._tier[k])
                self._tier[k] = v
        self.kv = kv

    def _figures(self, sender: str, msg: Figures) -> None:
        if len(self._figs) > 1:  # data parallel: the sum over replicas
            self._figs[sender] = msg
            msg = _sum_figures(list(self._figs.values()))
        self._apply_kv(msg.kv)
        q, last = msg.queue, self._last
        self.g_waiting.set(q.waiting)
        self.g_running.set(q.running)
        self.g_depth.set(q.waiting + q.running)
        self.g_qtokens.set(q.queued_prompt_tokens)
        if q.running == 0:  # nothing runs: the live batch is empty, whatever the last step was
            self.g_batch_last.set(0)
        for ctr, a, b in (
            (self.c_preempt, q.preemptions, last.preemptions),
            (self.c_cancel, q.cancellations, last.cancellations),
            (self.c_timeout, q.timeouts, last.timeouts),
        ):
            if a > b:
                ctr.inc(a - b)
        self.queue = self._last = q

    def _step(self, msg: StepStats) -> None:
        self.rates.observe(msg, time.monotonic())
        if msg.verify_rows:
            for k, v in (("drafted", msg.drafted), ("accepted", msg.accepted), ("verify_steps", msg.verify_rows),
                         ("miss_steps", msg.verify_misses)):
                self.c_spec[k].inc(v)
            for k, v in (("drafted", msg.drafted), ("accepted", msg.accepted),
                         ("emitted", msg.accepted + msg.verify_rows), ("verify_steps", msg.verify_rows),
                         ("verify_wall_ms", msg.elapsed_ns / 1e6)):
                self.c_spec_src["ngram", k].inc(v)
        self.c_steps.inc()
        self.c_rows.inc(msg.num_seqs)
        self.g_batch_last.set(msg.num_seqs)
        if msg.num_seqs > self._max_batch:
            self._max_batch = msg.num_seqs
            self.g_max_batch.set(msg.num_seqs)

    def _request(self, msg: RequestStats) -> None:
        self.c_req.inc()
        ep = msg.endpoint if msg.endpoint in ENDPOINTS else None
        if ep:
            self.c_ep.labels(ep).inc()
        self.c_gen.inc(msg.completion_tokens)
        self.c_prompt.inc(msg.prompt_tokens)
        self.c_cached.inc(msg.cached_tokens)
        for name in msg.ignored_fields:
            if name not in self._ignored_labels and len(self._ignored_labels) >= 64:
                name = "other"
            self._ignored_labels.add(name)
            self.c_ignored.labels(ep or "other", name).inc()
        if refused(msg):  # never reached generation: nothing to time
            if kv_refusal(msg, min(k.total * k.block_size for k in self.replica_kv())):
                self.c_kv_reject.inc()
            return
        t = timeline(msg)
        # a request that ended before its first batch (cancelled, timed out) still waited;
        # one without a first token has no ttft to observe
        obs = [("request_duration", t.duration_s), ("queue_time", t.queue_s)]
        if t.ttft_s is not None:
            obs.append(("ttft", t.ttft_s))
        obs += [("inter_token", gap) for gap in msg.itl_s]
        for k, v in obs:
            self.h[k].observe(v)
            if ep:
                self.h_ep[k].labels(ep).observe(v)

    async def on_message(self, sender: str, msg: Msg) -> None:
        if isinstance(msg, Figures):
            self._figures(sender, msg)
        elif isinstance(msg, StepStats):
            self._step(msg)
        elif isinstance(msg, RequestStats):
            self._request(msg)
        elif isinstance(msg, Fault):
            self.faults.append(msg.error)
            self.c_faults.inc()
        elif isinstance(msg, MemoryState) and not msg.error:  # suspend released / reloaded the model
            self.g_model.labels(self.model_name).set(1 if msg.loaded else 0)

    def replica_kv(self) -> list[KvFigures]:
        """Each scheduler replica's latest KV figures (one entry without data parallel)."""
        return [f.kv for f in self._figs.values()] if len(self._figs) > 1 else [self.kv]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
