"""Metrics actor: turns figures and stats messages into Prometheus series.

It owns a private CollectorRegistry (one per engine, so tests can run several
servers in one process) and the latest Figures, which /health reads. Every
series exists from start, at zero, so dashboards can be built before traffic.
"""

from __future__ import annotations

import collections
import time

import msgspec

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from imp.actors.base import Actor, Bus
from imp.messages import Fault, Figures, KvFigures, Msg, QueueFigures, RequestStats, StepStats

ENDPOINTS = ("chat_completions", "completions", "messages", "responses", "embeddings", "rerank")
_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Rates:
    """Token rates measured from StepStats (the executor's step time).

    A step that carries prefill tokens counts all its time as prefill (a mixed
    step's decodes make the prefill rate read low, never high); only pure
    decode steps feed the decode rates. `now` is the latest decode step, if
    it ran within `stale_s`; `recent` the last `window` decode steps; lifetime
    every decode step since start.
    """

    def __init__(self, window: int = 64, prefill_window: int = 16, stale_s: float = 2.0):
        self.decode = collections.deque(maxlen=window)  # (tokens, seconds)
        self.prefill = collections.deque(maxlen=prefill_window)
        self.stale_s = stale_s
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
        """Prefill tokens per second over the recent prefill steps; None before the first."""
        return self._mean(self.prefill)

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


class MetricsActor(Actor):
    name = "metrics"

    def __init__(self, bus: Bus, model_name: str, kv: KvFigures, sources: list[str] | None = None):
        """kv: one scheduler's pool at boot; sources: the scheduler replicas
        (data parallel), whose figures are summed."""
        super().__init__(bus)
        self.registry = r = CollectorRegistry()
        self._figs = {name: Figures(kv, QueueFigures(0, 0, 0)) for name in (sources or ["scheduler"])}
        kv = _sum_figures(list(self._figs.values())).kv
        self.kv = kv
        self.queue = QueueFigures(0, 0, 0)
        self.faults: list[str] = []
        g = lambda n, d, *l: Gauge(n, d, l, registry=r)  # noqa: E731
        c = lambda n, d, *l: Counter(n, d, l, registry=r)  # noqa: E731
        h = lambda n, d, *l: Histogram(n, d, l, buckets=_LAT, registry=r)  # noqa: E731
        self.g_model = g("imp_model_loaded", "1 while the model is loaded", "model")
        self.g_model.labels(model_name).set(1)
        self.g_kv = {k: g(f"imp_kv_blocks_{k}", f"KV blocks {k}") for k in ("total", "free", "used", "reserved", "cached", "pinned")}
        self.g_waiting = g("imp_queue_waiting", "requests waiting for a batch slot")
        self.g_running = g("imp_queue_running", "requests in the running batch")
        self.g_depth = g("imp_queue_depth", "waiting + running")
        self.g_qtokens = g("imp_queued_prompt_tokens", "prompt tokens not yet past prefill")
        self.g_batch_last = g("imp_decode_batch_last_rows", "sequences in the most recent step")
        self.c_evict = c("imp_prefix_cache_evictions", "cached prefix blocks reclaimed")
        self.c_preempt = c("imp_preemptions", "running requests preempted for KV")
        self.c_cancel = c("imp_requests_cancelled", "requests cancelled by client disconnect")
        self.c_timeout = c("imp_requests_timed_out", "requests ended at --request-timeout")
        self.c_steps = c("imp_decode_batch_steps", "engine steps")
        self.c_rows = c("imp_decode_batch_rows", "sequences summed over steps")
        self.c_gen = c("imp_tokens_generated", "completion tokens")
        self.c_prompt = c("imp_tokens_prompt", "prompt tokens")
        self.c_cached = c("imp_tokens_cached", "prompt tokens served from the prefix cache")
        self.c_faults = c("imp_actor_faults", "actors that failed")
        self.c_req = c("imp_requests", "generation requests finished")
        self.c_ep = c("imp_endpoint_requests", "generation requests by endpoint", "endpoint")
        self.h = {k: h(f"imp_{k}_seconds", f"{k} latency") for k in ("request_duration", "ttft", "queue_time", "inter_token")}
        self.h_ep = {
            k: h(f"imp_endpoint_{k}_seconds", f"{k} latency by endpoint", "endpoint")
            for k in ("request_duration", "ttft", "queue_time", "inter_token")
        }
        for ep in ENDPOINTS:
            self.c_ep.labels(ep)
            for hh in self.h_ep.values():
                hh.labels(ep)
        self.g_max_batch = g("imp_decode_batch_max", "largest step so far")
        self._max_batch = 0
        self._last: QueueFigures = self.queue
        self._evictions = 0
        self.rates = Rates()
        self._apply_kv(kv)

    def _apply_kv(self, kv: KvFigures) -> None:
        for k, gauge in self.g_kv.items():
            gauge.set(getattr(kv, k))
        if kv.evictions > self._evictions:
            self.c_evict.inc(kv.evictions - self._evictions)
            self._evictions = kv.evictions
        self.kv = kv

    async def on_message(self, sender: str, msg: Msg) -> None:
        if isinstance(msg, Figures):
            if len(self._figs) > 1:  # data parallel: the sum over replicas
                self._figs[sender] = msg
                msg = _sum_figures(list(self._figs.values()))
            self._apply_kv(msg.kv)
            q, last = msg.queue, self._last
            self.g_waiting.set(q.waiting)
            self.g_running.set(q.running)
            self.g_depth.set(q.waiting + q.running)
            self.g_qtokens.set(q.queued_prompt_tokens)
            for ctr, a, b in (
                (self.c_preempt, q.preemptions, last.preemptions),
                (self.c_cancel, q.cancellations, last.cancellations),
                (self.c_timeout, q.timeouts, last.timeouts),
            ):
                if a > b:
                    ctr.inc(a - b)
            self.queue = self._last = q
        elif isinstance(msg, StepStats):
            self.rates.observe(msg, time.monotonic())
            self.c_steps.inc()
            self.c_rows.inc(msg.num_seqs)
            self.g_batch_last.set(msg.num_seqs)
            if msg.num_seqs > self._max_batch:
                self._max_batch = msg.num_seqs
                self.g_max_batch.set(msg.num_seqs)
        elif isinstance(msg, RequestStats):
            self.c_req.inc()
            ep = msg.endpoint if msg.endpoint in ENDPOINTS else None
            if ep:
                self.c_ep.labels(ep).inc()
            self.c_gen.inc(msg.completion_tokens)
            self.c_prompt.inc(msg.prompt_tokens)
            self.c_cached.inc(msg.cached_tokens)
            for k, v in (("request_duration", msg.duration_s), ("ttft", msg.ttft_s), ("queue_time", msg.queue_s)):
                self.h[k].observe(v)
                if ep:
                    self.h_ep[k].labels(ep).observe(v)
            for gap in msg.itl_s:
                self.h["inter_token"].observe(gap)
                if ep:
                    self.h_ep["inter_token"].labels(ep).observe(gap)
        elif isinstance(msg, Fault):
            self.faults.append(msg.error)
            self.c_faults.inc()

    def replica_kv(self) -> list[KvFigures]:
        """Each scheduler replica's latest KV figures (one entry without data parallel)."""
        return [f.kv for f in self._figs.values()] if len(self._figs) > 1 else [self.kv]

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
