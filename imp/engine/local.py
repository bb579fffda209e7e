"""The engine in this process: the actors around loaded runners, behind the engine port.

Builds the decision cores from boot facts, wires every actor onto one bus
(its deliveries go to the event log), and implements `imp.engine.port.EnginePort`
for HTTP: submit / end_thinking / close_session / suspend / resume become
messages to admission through the ingress actor; a request's output is its
handle's queue, read as an async stream; figures come from the metrics and
ingress actors. With --data-parallel N there are N scheduler/kv/executor
triples (`imp.core.replicas`), one per runner.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec
import numpy as np

from imp.actors.base import Bus, CoreActor
from imp.actors.clock import ClockActor
from imp.actors.detok import DetokActor
from imp.actors.executor import ExecutorActor
from imp.actors.ingress import IngressActor
from imp.actors.metrics import MetricsActor
from imp.config import ServerConfig, itl_policy_on
from imp.constrain.book import ConstraintBook
from imp.core.replicas import replica_name
from imp.engine.cores import build_cores
from imp.engine.port import (LiveRow, LoraInfo, Warm, LoraRefused, ModelCard, Rates, ResumeResult, Snapshot, Submission,
                              SuspendResult)
from imp.engine.render import RenderedStream
from imp.engine.swap import swap_facts
from imp.log.eventlog import EventLog, LogHeader
from imp.store.actor import StoreActor
from imp.messages import (SCHEMA_VERSION, Cancel, KvStored, TokenTexts, FinishReason, KvFigures, KvForget, LoraLoad, LoraUnload,
                          Reload, RequestStats, Unload)

log = logging.getLogger("imp.engine")


def kv_bytes_per_token(runner) -> int | None:
    """2 (K and V) * layers * KV heads * head dim * the cache's element size."""
    cfg = runner.config
    cache = getattr(runner, "cache", None)
    t = getattr(cache, "k", None) if cache is not None else getattr(runner, "k_cache", None)
    if t is None:
        return None
    size = t.itemsize if hasattr(t, "itemsize") else t.element_size()  # numpy (the CPU pool) or torch
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * size


def _prompt_costs(cfg: ServerConfig, runner) -> tuple[tuple[tuple[int, int, int], ...], int, tuple]:
    """The runner's measured mixed-step bucket costs (a GPU's graphs; `prompt_costs`), what a prompt row's
    attention adds per 1,000 positions of context (`prompt_ctx_ns`) and, where the runner measures it by prompt
    bucket, the same by bucket (`prompt_ctx_by`), for the ITL policy: ((), 0, ()) where no policy is on or the
    runner has no buckets. Measured once here, frozen into the scheduler's config (the
    event log's header), so a replay plans the same chunks."""
    measure = getattr(runner, "prompt_costs", None)
    if measure is None or not itl_policy_on(cfg):
        return (), 0, ()
    t0 = time.perf_counter()
    table = tuple(measure())
    if not table:
        return (), 0, ()
    ctx_ns = int(runner.prompt_ctx_ns()) if hasattr(runner, "prompt_ctx_ns") else 0
    ctx_by = tuple(runner.prompt_ctx_by()) if hasattr(runner, "prompt_ctx_by") else ()
    dbs = sorted({db for _, db, _ in table})
    mid = dbs[len(dbs) // 2]
    log.info("mixed-step costs measured in %.1f s; beside %d decode rows a prompt bucket adds: %s; a prompt row's "
             "attention %.1f us per 1,000 positions", time.perf_counter() - t0, mid,
             ", ".join(f"{pb} rows {ns / 1e6:.2f} ms" for pb, db, ns in table if db == mid), ctx_ns / 1e3)
    if ctx_by:
        log.info("a prompt row's attention by bucket: %s us per 1,000 positions",
                 ", ".join(f"{pb} rows {ns / 1e3:.1f}" for pb, ns in ctx_by))
    return table, ctx_ns, ctx_by


def _with_swap(load, n_slots: int):
    def loaded():
        runner = load()
        runner.make_swap(n_slots)
        return runner

    return loaded


class LocalEngine:
    """EnginePort over actors on this event loop. `runners`: one per replica (same file)."""

    def __init__(self, cfg: ServerConfig, runners: list, detok_tokenizer, name: str, path: str = "",
                 grammars=None, store=None, otlp=None, faults=None, loaders=None,
                 boot_prefill_tok_s: float | None = None, lora_files=None, lora_tables=None):
        """grammars: the imp.constrain GrammarCache shared with HTTP (which compiles a request's
        grammar at admission, under its deadline); each executor keeps its sequences' matchers."""
        self.cfg = cfg
        self.grammars = grammars
        self.store_db = store  # an opened imp.store StoreDB, or None (no Responses store)
        self.otlp_cfg = otlp  # imp.actors.otlp_config.OtlpConfig (resolved at boot), or None
        self.faults = faults  # imp.actors.faults.FaultPlan from IMP_FAULT_INJECT (tests), or None
        # () -> runner per replica: how suspend loads a released model again (None: cannot release)
        self.loaders = list(loaders) if loaders is not None else [None] * len(runners)
        self.boot_prefill_tok_s = boot_prefill_tok_s  # the boot warm-up's rate (est_ttft_s before traffic)
        self.idle_suspended = False  # --idle-unload-seconds released the model; the next request reloads
        self.last_activity = time.monotonic()
        self._idle_task: asyncio.Task | None = None
        # LoRA (injected at boot, this layer reads no files): path confinement + reader, and
        # one adapter table per replica, which outlives a runner dropped by suspend
        self.lora_files = lora_files
        self.lora_tables = list(lora_tables) if lora_tables is not None else [None] * len(runners)
        self._loras: dict[int, LoraInfo] = {}  # loaded adapters by id (ids never reused)
        self._lora_next = 1
        self._lora_users: dict[int, int] = {}  # adapter id -> requests running with it
        self.runners = list(runners)
        self.tokenizer = detok_tokenizer  # submit's stream renders text with it (imp.engine.render)
        self._texts_sent = False  # the schedulers have the token texts (banned phrases)
        r = self.runners[0]
        self.max_context = int(r.config.context_length)
        self.started_at = time.time()
        self.draining = False
        self.actors: list = []
        verifies = all(getattr(x, "verifies_drafts", False) for x in self.runners)
        # the longest draft every executor verifies with a decode row's numerics (the GPU's int8 GEMV rows)
        draft_max = min([cfg.spec_draft_max] + [getattr(x, "max_draft", cfg.spec_draft_max) for x in self.runners])
        self.tiers = self._tiers(cfg, self.runners)  # the prefix cache's host / disk tiers, per replica (None: none)
        tier_blocks = 0
        if self.tiers[0] is not None:  # the allocator's index: the disk's keys (host holds some of them), or host's
            t = self.tiers[0]
            tier_blocks = t.host_blocks if t.dir is None else max(
                t.host_blocks, max(1, int(cfg.prompt_cache_gb * 2**30) // r.kv_block_bytes()))
        # swap instead of recompute: every replica's runner gets its area, runner 0's copies are timed
        self.swap = swap_facts(cfg.preemption_mode, cfg.swap_space_gb, r, cfg.device, boot_prefill_tok_s)
        for x in self.runners[1:] if self.swap.blocks else ():
            x.make_swap(self.swap.blocks)
        if self.swap.blocks:  # a runner loaded again (suspend, idle unload) needs its area again
            self.loaders = [None if f is None else _with_swap(f, self.swap.blocks) for f in self.loaders]
        prompt_costs, prompt_ctx_ns, prompt_ctx_by = _prompt_costs(cfg, r)
        self.adm, schs, kvs = build_cores(cfg, r.num_blocks, self.max_context, r.fingerprint,
                                          replicas=len(self.runners), verifies_drafts=verifies, draft_max=draft_max,
                                          tier_blocks=tier_blocks, swap=self.swap,
                                          # a host tier alone outlives nothing the pool does not: it takes what
                                          # the pool evicts (a copy only under pressure) instead of every block
                                          tier_demote=self.tiers[0] is not None and self.tiers[0].dir is None,
                                          prompt_costs=prompt_costs, prompt_ctx_ns=prompt_ctx_ns,
                                          prompt_ctx_by=prompt_ctx_by,
                                          verify_rows=min(getattr(x, "verify_rows", 0) for x in self.runners))
        self.schs, self.kvs = (schs, kvs) if len(self.runners) > 1 else ([schs], [kvs])
        self.card = ModelCard(
            name=name, path=path, fingerprint=r.fingerprint, context_length=self.max_context,
            vocab_size=int(r.config.vocab_size), block_size=cfg.block_size, kv_blocks=r.num_blocks,
            kv_bytes_per_token=kv_bytes_per_token(r), replicas=len(self.runners),
            max_batch_size=cfg.max_batch_size, max_queued_tokens=cfg.max_queued_tokens,
            retry_after_s=self.adm.config.retry_after_s,
            device="cuda" if cfg.device.startswith("cuda") else "cpu", created=int(self.started_at),
            speculative=verifies and draft_max > 0 and (cfg.speculative == "on" or cfg.speculative == "auto" and all(
                getattr(x, "speculates_by_default", True) for x in self.runners)),
            spec_draft_max=draft_max if verifies else 0,
            logit_lens=all(getattr(x, "supports_logit_lens", False) for x in self.runners),
        )

    @staticmethod
    def _tiers(cfg: ServerConfig, runners: list) -> list:
        """--prompt-cache-dir / --host-cache-gb: one KvTier per replica (the same files: a key names the same KV
        everywhere; host memory its own), or None each where there is none: not asked, an executor that cannot
        copy its blocks, or a directory that cannot be written and no host tier (one warning: the server runs
        without it)."""
        if not cfg.prompt_cache_dir and not cfg.host_cache_gb:
            return [None] * len(runners)
        if not all(getattr(x, "supports_kv_tier", False) for x in runners):
            log.warning("--prompt-cache-dir / --host-cache-gb: this executor cannot copy its KV blocks (the fused "
                        "GGUF forward and the GPU executor can): no prompt cache tier")
            return [None] * len(runners)
        from imp.actors.kvtier import KvTier, TierUnavailable

        host = int(cfg.host_cache_gb * 2**30) // runners[0].kv_block_bytes()
        root = cfg.prompt_cache_dir
        try:
            return [KvTier(root, x.fingerprint, x.kv_layout(), host) for x in runners]
        except TierUnavailable as exc:
            log.warning("--prompt-cache-dir: %s: no disk tier", exc)
            if not host:
                return [None] * len(runners)
            return [KvTier(None, x.fingerprint, x.kv_layout(), host) for x in runners]

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        cfg, r, n = self.cfg, self.runners[0], len(self.runners)
        cores = [self.adm, *self.schs, *self.kvs]
        self.eventlog = EventLog(cfg.event_log)
        self.eventlog.open(LogHeader(
            SCHEMA_VERSION, r.fingerprint, {c.name: msgspec.to_builtins(c.config) for c in cores}, time.time_ns(),
            note=f"model={self.card.name}",
        ))
        self.bus = bus = Bus(self.eventlog)
        # the store first: stopped last, after ingress, so every put already sent is committed
        self.store_actor = StoreActor(bus, self.store_db) if self.store_db is not None else None
        self.ingress = IngressActor(bus, store=self.store_actor is not None)
        self.metrics = MetricsActor(bus, self.card.name,
                                    KvFigures(r.num_blocks, r.num_blocks, 0, 0, 0, cfg.block_size),
                                    sources=[c.name for c in self.schs], boot_prefill_tok_s=self.boot_prefill_tok_s,
                                    kv_block_bytes=(kv_bytes_per_token(r) or 0) * cfg.block_size)
        self.actors = [
            *([self.store_actor] if self.store_actor is not None else []),
            self.ingress,
            *(CoreActor(bus, c) for c in cores),
            *(ExecutorActor(bus, run, name=replica_name("executor", i, n), scheduler=replica_name("scheduler", i, n),
                            constraints=ConstraintBook(self.grammars) if self.grammars is not None else None,
                            faults=self.faults, loader=self.loaders[i], loras=self.lora_tables[i],
                            lora_reader=self.lora_files.read if self.lora_files is not None else None,
                            tier=self.tiers[i], kv=replica_name("kv", i, n))
              for i, run in enumerate(self.runners)),
            DetokActor(bus),
            self.metrics,
            ClockActor(bus, to=[c.name for c in self.schs]),
        ]
        self.otlp = None
        if self.otlp_cfg is not None and self.otlp_cfg.enabled:
            from imp.actors.otlp import OtlpActor  # the OpenTelemetry SDK only when something is exported

            self.otlp = OtlpActor(bus, self.otlp_cfg, self.metrics.otlp)
            self.actors.append(self.otlp)
        self.executors = [a.name for a in self.actors if isinstance(a, ExecutorActor)]
        self.runners = []  # the executors own them now: an Unload must leave no other reference
        for a in self.actors:
            a.start()
        for i, t in enumerate(self.tiers):  # the tier's keys, before any request: the allocator's index
            if t is not None:
                keys = t.scan()
                if t.dir is not None:
                    log.info("[kvtier] %s: %d blocks of this model's KV on disk", t.dir, len(keys))
                bus.send("engine", replica_name("kv", i, n), KvStored(keys))
        if cfg.idle_unload_s > 0:
            self._idle_task = asyncio.create_task(self._idle_loop(), name="idle-unload")
        await asyncio.sleep(0)

    async def stop(self) -> None:
        if self._idle_task is not None:
            self._idle_task.cancel()
        for a in reversed(self.actors):
            await a.stop()
        self.eventlog.close()

    # ------------------------------------------------------------------ the port

    @property
    def fault(self) -> str | None:
        return self.ingress.fault or (next(iter(self.bus.dead.values())) if self.bus.dead else None)

    def submit(self, sub: Submission) -> RenderedStream:
        """The request's output, rendered on this side of the port as an API-server process
        renders it (imp.engine.render): stop strings and text in one place whatever the layout."""
        handle = self.open(sub)
        return RenderedStream(self.tokenizer, sub, handle.queue, lambda i: self.stop_choice(sub.req_id, i),
                              lambda: self.close(handle, sub.params.lora))

    def open(self, sub: Submission):
        """Queue a request now (not at the first iteration) and return its ingress handle;
        whoever reads the handle calls `close` when done with it."""
        self.last_activity = time.monotonic()
        lid = sub.params.lora
        if lid and lid not in self._loras:  # unloaded since HTTP resolved the name
            raise LoraRefused(400, "lora_not_loaded", f"LoRA adapter {lid} is not loaded")
        if self.idle_suspended:  # the executor reloads at this request's first step
            self.idle_suspended = False
            log.info("[idle-unload] request %s wakes the model", sub.req_id)
        if sub.params.banned:
            self._send_texts()
        w = self.warm_now(sub.prompt, sub.salt)
        handle = self.ingress.submit(
            sub.req_id, sub.prompt, sub.params, n=sub.n, priority=sub.priority, stop=sub.stop,
            salt=sub.salt, prompt_tail=sub.prompt[-4:], cache_prompt=sub.cache_prompt,
            session_id=sub.session_id, cfg_prompt=sub.cfg_prompt, pin_tokens=sub.pin_tokens, cache=(w.tier, w.tokens),
        )
        if lid:
            self._lora_users[lid] = self._lora_users.get(lid, 0) + 1
        return handle

    def _send_texts(self) -> None:
        """Before the first request with banned phrases: every scheduler gets the token texts (on the log,
        so a replay needs no model); the same inbox then brings the request, after them."""
        if self._texts_sent:
            return
        blob, offsets = self.tokenizer.shown_pieces()
        msg = TokenTexts(blob, np.ascontiguousarray(offsets, dtype="<i8").tobytes())
        for sch in self.schs:
            self.bus.send("ingress", sch.name, msg)
        self._texts_sent = True

    def close(self, handle, lora_id: int = 0) -> None:
        """The reader is done with a request: released if it ran to its end, else cancelled
        (client gone or handler failed: its KV is freed within a step)."""
        if lora_id:
            self._lora_users[lora_id] -= 1
        if handle.done:
            self.ingress.release(handle.req_id)
        else:
            self.ingress.cancel(handle.req_id)

    def end_thinking(self, req_id: str, token_ids: tuple[int, ...]) -> bool:
        return self.ingress.end_thinking(req_id, list(token_ids))

    def serve_peers(self, handler) -> None:
        """One process, no peers: nothing to serve."""

    async def ask_peers(self, action: str, some_id: str):
        return None  # every request of this engine is in this process's HTTP app

    def stop_choice(self, req_id: str, index: int) -> None:
        """A stop string ended one choice where the text is made (imp.engine.render): free its KV."""
        self.ingress.send("admission", Cancel(req_id, FinishReason.STOP, index))

    def close_session(self, session_id: str) -> None:
        self.ingress.close_session(session_id)

    def _in_flight(self) -> int:
        q = self.metrics.queue
        return max(sum(not h.done for h in self.ingress.handles.values()), q.waiting + q.running)

    async def suspend(self, drain_s: float) -> SuspendResult:
        """Stop admitting, wait up to drain_s for the admitted requests (never cancelled), then
        release the weights and the KV pool of every replica."""
        self.ingress.suspend()  # FIFO: every Submit sent after this is refused by admission
        deadline = time.monotonic() + drain_s
        while self._in_flight() and time.monotonic() < deadline and not self.fault:
            await asyncio.sleep(0.05)
        left = self._in_flight()
        if left or self.fault:
            return SuspendResult(suspended=True, drained=left == 0, in_flight=left, kv_released=False,
                                 error=self.fault or f"{left} requests still running after {drain_s:g}s; "
                                                     "the model stays loaded")
        states = await self._unload("operator")
        return self._suspend_result(states)

    def _suspend_result(self, states: list) -> SuspendResult:
        errors = [m.error for m in states if m.error] or ([] if len(states) == len(self.executors) else
                                                          ["no answer from the executor"])
        return SuspendResult(
            suspended=True, drained=True, in_flight=0, kv_released=not errors and all(not m.loaded for m in states),
            rss_before=max((m.rss_before for m in states), default=0),  # one process: the last is the total
            rss_after=min((m.rss_after for m in states), default=0) if states else 0,
            device_free_before=sum(m.device_free_before for m in states),
            device_free_after=sum(m.device_free_after for m in states), error="; ".join(errors),
        )

    async def _ask(self, msg, names: list[str], replies: dict, key=lambda n: n, timeout_s: float = 300.0,
                   keep: bool = True) -> list:
        """Send msg to each executor in names and wait (up to timeout_s, or a fault) for their
        replies, which ingress files in `replies` under key(name); keep=False takes them out."""
        ing = self.ingress
        for n in names:
            replies.pop(key(n), None)
            ing.send(n, msg)
        deadline = time.monotonic() + timeout_s
        while any(key(n) not in replies for n in names) and not self.fault and time.monotonic() < deadline:
            ing.memory_changed.clear()
            try:
                await asyncio.wait_for(ing.memory_changed.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        got = [replies[key(n)] for n in names if key(n) in replies]
        if not keep:
            for n in names:
                replies.pop(key(n), None)
        return got

    async def _unload(self, reason: str) -> list:
        # the pool's KV goes with it: the prefix cache must not promise blocks it no longer has
        for kv in self.kvs:
            self.ingress.send(kv.name, KvForget())
        states = await self._ask(Unload(reason), self.executors, self.ingress.memory)
        for m in states:
            if m.error:
                log.warning("[%s-unload] %s: %s", reason, m.actor, m.error)
            else:
                log.info("[%s-unload] %s released the model in %.2fs: RSS %.0f -> %.0f MiB%s", reason, m.actor,
                         m.seconds, m.rss_before / 2**20, m.rss_after / 2**20,
                         f", device free {m.device_free_before / 2**30:.2f} -> {m.device_free_after / 2**30:.2f} GiB"
                         if m.device_free_before else "")
        return states

    async def resume(self, reload: bool = True) -> ResumeResult:
        """Admit again; released weights and KV pool are loaded first. reload=False: admit only, the weights
        stay released (models on demand: a boot model a swap had released before the suspend stays so, and
        loads on demand as before)."""
        if self.draining:  # a shutdown is not undone by an admin call
            return ResumeResult(suspended=False, reloaded=False)
        released = [n for n in self.executors if n in self.ingress.memory and not self.ingress.memory[n].loaded]
        states = await self._ask(Reload(), released, self.ingress.memory) if released and reload else []
        self.idle_suspended = bool(released) and not reload
        self.ingress.resume()
        return ResumeResult(suspended=False, reloaded=bool(states),
                            seconds=max((m.seconds for m in states), default=0.0))

    async def release(self, reason: str) -> list:
        """A model swap or the fleet's idle unload (imp.engine.fleet): the weights and KV pool freed, the
        engine (its actors, event log and figures) kept; `reload` brings them back. The executors' MemoryStates."""
        self.idle_suspended = True
        return await self._unload(reason)

    async def reload(self) -> list:
        """The released weights and KV pool loaded again, before a request is let in; the MemoryStates."""
        released = [n for n in self.executors if n in self.ingress.memory and not self.ingress.memory[n].loaded]
        states = await self._ask(Reload(), released, self.ingress.memory) if released else []
        self.idle_suspended = False
        return states

    # ------------------------------------------------------------------ LoRA

    def loras(self) -> tuple[LoraInfo, ...]:
        return tuple(self._loras[i] for i in sorted(self._loras))

    def lora_named(self, name: str) -> int | None:
        return next((i for i, a in self._loras.items() if a.name == name), None)

    async def _lora_ask(self, msg, lora_id: int) -> list:
        return await self._ask(msg, self.executors, self.ingress.lora_states, key=lambda n: (n, lora_id),
                               timeout_s=120.0, keep=False)

    async def lora_load(self, path: str, name: str | None) -> LoraInfo:
        if self.fault:
            raise LoraRefused(409, "engine_faulted", f"the engine faulted: {self.fault}")
        if self.ingress.suspended or self.draining:
            raise LoraRefused(409, "suspended", "the server is suspended or shutting down; POST /admin/resume first")
        if self.lora_files is None:
            raise LoraRefused(400, "lora_load_failed", "this engine runs without LoRA")
        try:
            real = Path(self.lora_files.confine(path))
        except ValueError as exc:  # outside --lora-dir, '..', a symlink out, missing
            raise LoraRefused(400, "lora_load_failed", str(exc)) from None
        name = name or (real.stem if real.suffix == ".safetensors" else real.name)
        if self.lora_named(name) is not None:
            raise LoraRefused(409, "lora_already_loaded", f"a LoRA adapter named {name!r} is loaded already")
        lid, self._lora_next = self._lora_next, self._lora_next + 1
        self.last_activity = time.monotonic()
        self.idle_suspended = False  # the executor loads the model to check the adapter against it
        states = await self._lora_ask(LoraLoad(lid, name, str(real)), lid)
        errors = [m.error for m in states if m.error] or ([] if len(states) == len(self.executors) else
                                                          ["no answer from the executor"])
        if errors:
            for n in self.executors:  # a replica that did load it drops it again
                self.ingress.send(n, LoraUnload(lid))
            if self._lora_next == lid + 1:  # never shown to anyone: the next load may take it
                self._lora_next = lid
            raise LoraRefused(400, "lora_load_failed", errors[0])
        info = LoraInfo(id=lid, name=name, path=str(real), nbytes=max(m.nbytes for m in states))
        self._loras[lid] = info
        self.metrics.set_loras(tuple(a.name for a in self.loras()), time.time())
        log.info("[lora] loaded %r (id=%d, %d bytes) from %s", name, lid, info.nbytes, real)
        return info

    async def lora_unload(self, lora_id: int | None, name: str | None, drain_s: float = 30.0) -> LoraInfo:
        lid = lora_id if lora_id is not None else self.lora_named(name or "")
        info = self._loras.get(lid) if lid is not None else None
        if info is None:
            what = f"id {lora_id}" if lora_id is not None else f"name {name!r}"
            raise LoraRefused(404, "lora_not_found", f"no LoRA adapter with {what}")
        deadline = time.monotonic() + drain_s  # its running requests finish first, never cancelled
        while self._lora_users.get(lid, 0) and time.monotonic() < deadline and not self.fault:
            await asyncio.sleep(0.05)
        if self._lora_users.get(lid, 0):
            raise LoraRefused(503, "lora_busy", f"{self._lora_users[lid]} requests still run with {info.name!r} "
                                                f"after {drain_s:g}s; try again")
        del self._loras[lid]
        self.metrics.set_loras(tuple(a.name for a in self.loras()), time.time())
        await self._lora_ask(LoraUnload(lid), lid)
        self._lora_users.pop(lid, None)
        log.info("[lora] unloaded %r (id=%d)", info.name, lid)
        return info

    async def _idle_loop(self) -> None:
        """--idle-unload-seconds: once a second, release the model after N idle seconds."""
        n = self.cfg.idle_unload_s
        while True:
            await asyncio.sleep(1.0)
            if (self.idle_suspended or self.ingress.suspended or self.draining or self.fault or self._in_flight()
                    or time.monotonic() - self.last_activity < n):
                continue
            self.idle_suspended = True
            states = await self._unload("idle")
            if any(m.error for m in states):
                log.warning("[idle-unload] disabled: %s", "; ".join(m.error for m in states if m.error))
                self.idle_suspended = False
                return

    async def drain(self, timeout_s: float) -> int:
        """Shutdown (SIGTERM): admission closes with 503 `draining`, /ready says so, and the
        admitted requests run to their end for up to timeout_s. Returns how many were left."""
        self.draining = True
        self.ingress.suspend("draining")
        deadline = time.monotonic() + timeout_s
        while self._in_flight() and time.monotonic() < deadline and not self.fault:
            await asyncio.sleep(0.05)
        return self._in_flight()

    def report(self, stats: RequestStats) -> None:
        self.ingress.stats(stats)
        if self.otlp is not None:  # the gaps are the metrics' only: the log carries them once
            self.ingress.send("otlp", msgspec.structs.replace(stats, itl_s=()))

    store_home = None  # models on demand: the boot model's engine, whose store this one uses (imp.server)

    @property
    def store(self):
        """The Responses store's client (put / get / chain / delete / input_items -> StoreReply),
        or None when the server runs without one. A fleet model's engine has no store of its own: one
        SQLite file for every model, so a previous_response_id made on one model is found on another."""
        own = self.ingress.store
        return own if own is not None or self.store_home is None else self.store_home.store

    async def metrics_text(self) -> bytes:
        return self.metrics.exposition()

    def warm_now(self, prompt, salt: str = "") -> Warm:
        """How much of the prompt the prefix cache holds (the readiest replica's): each kv core answers a
        read-only question on this loop, between its messages."""
        best = (0, 0, 0)
        for kv in self.kvs:
            got = kv.warm(prompt, salt)
            if got[0] + got[1] > best[0] + best[1]:
                best = got
        pool, disk, n = best
        bs = self.cfg.block_size
        tier = "miss" if pool + disk == 0 else "exact" if pool + disk == n else "block"
        return Warm((pool + disk) * bs, tier, disk * bs)

    async def warm(self, prompt, salt: str = "") -> Warm:
        return self.warm_now(prompt, salt)

    async def snapshot(self, with_live: bool = False) -> Snapshot:
        return self.figures(with_live)

    def figures(self, with_live: bool = False) -> Snapshot:
        m, ing = self.metrics, self.ingress
        now = time.monotonic()
        live = ()
        if with_live:
            live = tuple(msgspec.convert(row, LiveRow) for row in ing.live_rows(now, m.queue.waiting))
        return Snapshot(
            kv=m.kv, replica_kv=tuple(m.replica_kv()), queue=m.queue, rates=Rates(**m.rates.snapshot(now)),
            suspended=ing.suspended, draining=self.draining, fault=self.fault, rejections=ing.rejections,
            last_reject_reason=ing.last_reject_reason, in_flight=self._in_flight(),
            uptime_s=time.time() - self.started_at, live=live, idle_suspended=self.idle_suspended,
            weights_loaded=not any(not m.loaded for m in ing.memory.values()),
        )
