"""The engine: builds the actors around a loaded model and wires the bus.

Boot-time facts (pool size, model fingerprint, context length) go into each
core's frozen config, and the configs into the event-log header, so a replay
rebuilds exactly the cores that ran. With --data-parallel N there are N
scheduler/kv/executor triples (`imp.core.replicas`), one per runner.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from imp.core.admission import AdmissionConfig, AdmissionCore
from imp.actors.base import Bus, CoreActor
from imp.actors.clock import ClockActor
from imp.actors.detok import DetokActor
from imp.log.eventlog import EventLog, LogHeader
from imp.actors.executor import ExecutorActor
from imp.actors.ingress import IngressActor
from imp.core.kv import KvConfig, KvCore
from imp.actors.metrics import MetricsActor
from imp.core.replicas import Routed, replica_name
from imp.core.scheduler import SchedulerConfig, SchedulerCore
from imp.config import ServerConfig, pipeline_depth
from imp.messages import SCHEMA_VERSION, KvFigures

log = logging.getLogger("imp.engine")


def build_cores(cfg: ServerConfig, num_blocks: int, max_context: int, fingerprint: str, replicas: int = 1):
    """The decision cores, from boot facts: admission, scheduler, kv (lists of
    `replicas` each when > 1, wrapped to talk to their own replica). Replay
    rebuilds them from the header."""
    kv = KvCore(KvConfig(num_blocks=num_blocks, block_size=cfg.block_size, fingerprint=fingerprint))
    adm = AdmissionCore(
        AdmissionConfig(
            num_blocks=num_blocks,
            block_size=cfg.block_size,
            max_context=max_context,
            max_queued_tokens=cfg.max_queued_tokens,
            replicas=replicas,
        )
    )
    if replicas > 1:
        pairs = [build_cores(cfg, num_blocks, max_context, fingerprint)[1:] for _ in range(replicas)]
        return adm, [Routed(s, i) for i, (s, _) in enumerate(pairs)], [Routed(k, i) for i, (_, k) in enumerate(pairs)]
    sch = SchedulerCore(
        SchedulerConfig(
            block_size=cfg.block_size,
            num_blocks=num_blocks,
            max_batch_size=cfg.max_batch_size,
            max_step_tokens=cfg.max_step_tokens,
            request_timeout_ns=int(cfg.request_timeout_s * 1e9),
            max_context=max_context,
            pipeline_depth=pipeline_depth(cfg),
        )
    )
    return adm, sch, kv


class Engine:
    def __init__(self, cfg: ServerConfig, runner, tokenizer, template, model_name: str):
        self.cfg = cfg
        self.runners = list(runner) if isinstance(runner, (list, tuple)) else [runner]
        self.runner = runner = self.runners[0]  # model facts (all replicas load the same file)
        self.tokenizer = tokenizer
        self.template = template
        self.model_name = model_name
        self.max_context = int(runner.config.context_length)
        self.started_at = time.time()
        self.actors = []
        self.draining = False

    async def start(self) -> None:
        cfg = self.cfg
        r, n = self.runner, len(self.runners)
        self.eventlog = EventLog(cfg.event_log)
        adm, sch, kv = build_cores(cfg, r.num_blocks, self.max_context, r.fingerprint, replicas=n)
        schs, kvs = (sch, kv) if n > 1 else ([sch], [kv])
        cores = [adm, *schs, *kvs]
        self.cores = {c.name: c for c in cores}
        self.eventlog.open(
            LogHeader(
                SCHEMA_VERSION,
                r.fingerprint,
                {c.name: msgspec.to_builtins(c.config) for c in cores},
                time.time_ns(),
                note=f"model={self.model_name}",
            )
        )
        self.bus = bus = Bus(self.eventlog)
        self.ingress = IngressActor(bus)
        self.metrics = MetricsActor(bus, self.model_name, KvFigures(r.num_blocks, r.num_blocks, 0, 0, 0, cfg.block_size),
                                    sources=[c.name for c in schs])
        self.actors = [
            self.ingress,
            CoreActor(bus, adm),
            *(CoreActor(bus, c) for c in (*schs, *kvs)),
            *(ExecutorActor(bus, run, name=replica_name("executor", i, n), scheduler=replica_name("scheduler", i, n))
              for i, run in enumerate(self.runners)),
            DetokActor(bus, self.tokenizer),
            self.metrics,
            ClockActor(bus, to=[c.name for c in schs]),
        ]
        for a in self.actors:
            a.start()
        await asyncio.sleep(0)

    async def stop(self) -> None:
        for a in reversed(self.actors):
            await a.stop()
        self.eventlog.close()

    @property
    def kv(self) -> KvFigures:
        return self.metrics.kv

    @property
    def fault(self) -> str | None:
        return self.ingress.fault or (next(iter(self.bus.dead.values())) if self.bus.dead else None)
