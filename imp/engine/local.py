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
from typing import AsyncIterator

import msgspec

from imp.actors.base import Bus, CoreActor
from imp.actors.clock import ClockActor
from imp.actors.detok import DetokActor
from imp.actors.executor import ExecutorActor
from imp.actors.ingress import IngressActor
from imp.actors.metrics import MetricsActor
from imp.actors.otlp import OtlpActor
from imp.config import ServerConfig
from imp.constrain.book import ConstraintBook
from imp.core.replicas import replica_name
from imp.engine.cores import build_cores
from imp.engine.port import LiveRow, ModelCard, Rates, Snapshot, StreamItem, Submission, SuspendResult
from imp.log.eventlog import EventLog, LogHeader
from imp.store.actor import StoreActor
from imp.messages import SCHEMA_VERSION, KvFigures, RequestStats

log = logging.getLogger("imp.engine")


def kv_bytes_per_token(runner) -> int | None:
    """2 (K and V) * layers * KV heads * head dim * the cache's element size."""
    cfg = runner.config
    cache = getattr(runner, "cache", None)
    t = getattr(cache, "k", None) if cache is not None else getattr(runner, "k_cache", None)
    if t is None:
        return None
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * t.element_size()


class LocalEngine:
    """EnginePort over actors on this event loop. `runners`: one per replica (same file)."""

    def __init__(self, cfg: ServerConfig, runners: list, detok_tokenizer, name: str, path: str = "",
                 grammars=None, store=None, otlp=None, faults=None):
        """grammars: the imp.constrain GrammarCache shared with HTTP (which compiles a request's
        grammar at admission, under its deadline); each executor keeps its sequences' matchers."""
        self.cfg = cfg
        self.grammars = grammars
        self.store_db = store  # an opened imp.store StoreDB, or None (no Responses store)
        self.otlp_cfg = otlp  # imp.actors.otlp.OtlpConfig (resolved at boot), or None
        self.faults = faults  # imp.actors.faults.FaultPlan from IMP_FAULT_INJECT (tests), or None
        self.runners = list(runners)
        self.tokenizer = detok_tokenizer  # the detok actor renders text with it
        r = self.runners[0]
        self.max_context = int(r.config.context_length)
        self.started_at = time.time()
        self.draining = False
        self.actors: list = []
        self.adm, schs, kvs = build_cores(cfg, r.num_blocks, self.max_context, r.fingerprint,
                                          replicas=len(self.runners))
        self.schs, self.kvs = (schs, kvs) if len(self.runners) > 1 else ([schs], [kvs])
        self.card = ModelCard(
            name=name, path=path, fingerprint=r.fingerprint, context_length=self.max_context,
            vocab_size=int(r.config.vocab_size), block_size=cfg.block_size, kv_blocks=r.num_blocks,
            kv_bytes_per_token=kv_bytes_per_token(r), replicas=len(self.runners),
            max_batch_size=cfg.max_batch_size, max_queued_tokens=cfg.max_queued_tokens,
            retry_after_s=self.adm.config.retry_after_s,
            device="cuda" if cfg.device.startswith("cuda") else "cpu", created=int(self.started_at),
        )

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
                                    sources=[c.name for c in self.schs])
        self.actors = [
            *([self.store_actor] if self.store_actor is not None else []),
            self.ingress,
            *(CoreActor(bus, c) for c in cores),
            *(ExecutorActor(bus, run, name=replica_name("executor", i, n), scheduler=replica_name("scheduler", i, n),
                            constraints=ConstraintBook(self.grammars) if self.grammars is not None else None,
                            faults=self.faults)
              for i, run in enumerate(self.runners)),
            DetokActor(bus, self.tokenizer),
            self.metrics,
            ClockActor(bus, to=[c.name for c in self.schs]),
        ]
        self.otlp = None
        if self.otlp_cfg is not None and self.otlp_cfg.enabled:
            self.otlp = OtlpActor(bus, self.otlp_cfg, self.metrics.otlp)
            self.actors.append(self.otlp)
        for a in self.actors:
            a.start()
        await asyncio.sleep(0)

    async def stop(self) -> None:
        for a in reversed(self.actors):
            await a.stop()
        self.eventlog.close()

    # ------------------------------------------------------------------ the port

    @property
    def fault(self) -> str | None:
        return self.ingress.fault or (next(iter(self.bus.dead.values())) if self.bus.dead else None)

    def submit(self, sub: Submission) -> AsyncIterator[StreamItem]:
        # sent now, not at the first iteration: the request is queued as soon as it is submitted
        handle = self.ingress.submit(
            sub.req_id, sub.prompt, sub.params, n=sub.n, priority=sub.priority, stop=sub.stop,
            salt=sub.salt, prompt_tail=sub.prompt[-4:], cache_prompt=sub.cache_prompt,
            session_id=sub.session_id,
        )
        return self._items(handle)

    async def _items(self, handle) -> AsyncIterator[StreamItem]:
        try:
            while not (handle.done and handle.queue.empty()):
                yield await handle.queue.get()
        finally:
            if handle.done:
                self.ingress.release(handle.req_id)
            else:
                self.ingress.cancel(handle.req_id)  # client gone or handler failed: free the KV now

    def end_thinking(self, req_id: str, token_ids: tuple[int, ...]) -> bool:
        return self.ingress.end_thinking(req_id, list(token_ids))

    def close_session(self, session_id: str) -> None:
        self.ingress.close_session(session_id)

    def _in_flight(self) -> int:
        q = self.metrics.queue
        return max(sum(not h.done for h in self.ingress.handles.values()), q.waiting + q.running)

    async def suspend(self, drain_s: float) -> SuspendResult:
        """Stop admitting, then wait up to drain_s for the admitted requests (never cancelled).
        The weights and KV pool stay mapped (kv_released: false)."""
        self.ingress.suspend()  # FIFO: every Submit sent after this is refused by admission
        deadline = time.monotonic() + drain_s
        while self._in_flight() and time.monotonic() < deadline and not self.fault:
            await asyncio.sleep(0.05)
        left = self._in_flight()
        return SuspendResult(suspended=True, drained=left == 0, in_flight=left, kv_released=False)

    def resume(self) -> None:
        if not self.draining:  # a shutdown is not undone by an admin call
            self.ingress.resume()

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

    @property
    def store(self):
        """The Responses store's client (put / get / chain / delete / input_items -> StoreReply),
        or None when the server runs without one."""
        return self.ingress.store

    def metrics_text(self) -> bytes:
        return self.metrics.exposition()

    def snapshot(self, with_live: bool = False) -> Snapshot:
        m, ing = self.metrics, self.ingress
        now = time.monotonic()
        live = ()
        if with_live:
            live = tuple(LiveRow(**row) for row in ing.live_rows(now, m.queue.waiting))
        return Snapshot(
            kv=m.kv, replica_kv=tuple(m.replica_kv()), queue=m.queue, rates=Rates(**m.rates.snapshot(now)),
            suspended=ing.suspended, draining=self.draining, fault=self.fault, rejections=ing.rejections,
            last_reject_reason=ing.last_reject_reason, in_flight=self._in_flight(),
            uptime_s=time.time() - self.started_at, live=live,
        )
