"""Control-plane overhead per engine step, with a zero-cost fake executor.

Runs the real actor system (bus, event log, admission, scheduler, KV
allocator) on uvloop with an executor that answers every StepPlan at once
and sinks for detok/metrics, so the time per step is pure scheduling,
messaging and logging. B requests decode together; the table gives the wall
time per step at each batch size (median and minimum over the repeats: this
machine is a VM whose neighbours add ±40 % at random; the minimum is the cost
of the code undisturbed), with the event log off, in the memory ring only,
and written to a file.

    .venv/bin/python bench/control_plane.py [--steps 200] [--batches 1,64,256]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402

from imp.actors.base import Actor, Bus, CoreActor  # noqa: E402
from imp.log.eventlog import EventLog, LogHeader  # noqa: E402
from imp.config import ServerConfig  # noqa: E402
from imp.engine.cores import build_cores  # noqa: E402
from imp.messages import step_result  # noqa: E402
from imp.messages import (  # noqa: E402
    SCHEMA_VERSION, FinishReason, SampledToken, SamplingParams, StepPlan, StepResult, Submit, TokenBatch, TokenOut,
)


PENALTY = 1.0
HISTORY_ONCE = True  # --history every: the scheduler before history_once (each penalized share carries it all)
LOG_BYTES: list[int] = []  # size of each "file" run's event log


class FakeExecutor(Actor):
    name = "executor"

    async def on_message(self, sender, msg):
        if isinstance(msg, StepPlan):
            toks = [SampledToken(s.seq_id, 7) for s in msg.shares() if s.sample]
            self.send("scheduler", step_result(msg, toks, time.monotonic_ns(), 0))


class Sink(Actor):
    def __init__(self, bus, name, done: asyncio.Event | None = None, expect: int = 0):
        self.name = name
        super().__init__(bus)
        self.done, self.expect, self.finished = done, expect, 0

    async def on_message(self, sender, msg):
        for t in msg.each() if isinstance(msg, TokenBatch) else [msg]:
            if isinstance(t, TokenOut) and t.finish != FinishReason.NONE:
                self.finished += 1
                if self.finished >= self.expect and self.done:
                    self.done.set()


async def run(batch: int, steps: int, mode: str) -> tuple[float, int]:
    prompt_len = 16
    cfg = ServerConfig(max_batch_size=max(batch, 1), max_step_tokens=max(512, batch * prompt_len))
    num_blocks = batch * ((prompt_len + steps) // 16 + 2)
    adm, sch, kv = build_cores(cfg, num_blocks, 8192, "bench")
    if not HISTORY_ONCE:
        sch = type(sch)(msgspec.structs.replace(sch.config, history_once=False))
    path = None
    if mode == "file":
        path = Path(tempfile.mkdtemp()) / "bench.log"
    log = EventLog(path)
    log.enabled = mode != "off"
    log.open(LogHeader(SCHEMA_VERSION, "bench", {c.name: msgspec.to_builtins(c.config) for c in (adm, sch, kv)}))
    bus = Bus(log)
    done = asyncio.Event()
    actors = [CoreActor(bus, adm), CoreActor(bus, sch), CoreActor(bus, kv), FakeExecutor(bus),
              Sink(bus, "detok", done, batch), Sink(bus, "metrics"), Sink(bus, "ingress")]
    for a in actors:
        a.start()
    params = SamplingParams(max_tokens=steps, temperature=0.0, stop_token_ids=(2,), repetition_penalty=PENALTY)
    t0 = time.perf_counter()
    for i in range(batch):
        bus.send("ingress", "admission", Submit(f"r{i}", list(range(100, 100 + prompt_len)), params, time.monotonic_ns()))
    await done.wait()
    wall = time.perf_counter() - t0
    nsteps = sch.step if hasattr(sch, "step") else steps
    for a in actors:
        await a.stop()
    log.close()
    if path is not None:
        LOG_BYTES.append(path.stat().st_size)
    return wall, nsteps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200, help="tokens decoded per request")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--repeats", type=int, default=5, help="runs per cell; the median is reported")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="1.05 = what HTTP requests get by default: penalized shares carry their history")
    ap.add_argument("--history", choices=("once", "every"), default="once",
                    help="once: the scheduler's history_once (the server's); every: each share carries it all")
    ns = ap.parse_args()
    global PENALTY, HISTORY_ONCE
    PENALTY = ns.repetition_penalty
    HISTORY_ONCE = ns.history == "once"
    import uvloop

    rows = []
    for b in [int(x) for x in ns.batches.split(",")]:
        row = [b]
        for mode in ("off", "ring", "file"):
            per_step = []
            for _ in range(ns.repeats):  # interleaving modes would be fairer still; a median is enough
                wall, nsteps = uvloop.run(run(b, ns.steps, mode))
                per_step.append(1000 * wall / max(nsteps, 1))
            row.append((statistics.median(per_step), min(per_step)))
        rows.append((row, nsteps))
    print(f"\ncontrol-plane time per step (ms: median / min of {ns.repeats} runs), fake zero-cost executor, "
          f"{ns.steps} decode steps per request, repetition_penalty {PENALTY}, history {ns.history}; "
          f"event log file {statistics.median(LOG_BYTES) / 1e6:.1f} MB (median)")
    print("| batch | steps | log off | log ring | log file |")
    print("|---|---|---|---|---|")
    for row, nsteps in rows:
        cells = " | ".join(f"{med:.3f} / {low:.3f}" for med, low in row[1:])
        print(f"| {row[0]} | {nsteps} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
