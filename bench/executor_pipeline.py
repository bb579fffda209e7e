"""The executor path alone on the GPU: where a streamed token's extra host time goes.

The real ExecutorActor around a GpuModelRunner on the 135M shape, fed by a fake
depth-2 scheduler (plans step s+2 as soon as step s's result lands, as the real one
does), against the runner's own pipelined loop (launch s+1, then collect s) on the
same sequences. `--busy-us` burns that much loop time per result before planning,
standing in for the scheduler, detok, ingress and HTTP work of a real step.
`--params chat` gives every share what a chat request without sampling fields gets
with temperature 0 (greedy, the model's repetition_penalty 1.05, top_k 50, top_p 0.95:
penalized, so the history goes with every share as the real scheduler sends it);
`--profile` prints where the launch thread's host time goes (cProfile, top 25).

    python3 bench/executor_pipeline.py [--batches 1,16] [--steps 200] [--busy-us 0,300,1000]
                                       [--params greedy,chat] [--path SmolLM2.gguf] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from gpu import BS, GREEDY, PROMPT, SHAPES, Seqs  # noqa: E402

from imp.actors.base import Actor, Bus  # noqa: E402
from imp.actors.executor import ExecutorActor  # noqa: E402
from imp.gpu.runner import GpuModelRunner  # noqa: E402
from imp.log.eventlog import EventLog, LogHeader  # noqa: E402
from imp.messages import PENDING_TOKEN, SCHEMA_VERSION, SamplingParams, SeqWork, StepPlan, StepResult  # noqa: E402
from tests.fixtures.synth_raw import write_raw_gguf  # noqa: E402


# what a chat request without sampling fields but temperature 0 resolves to (imp.http.resolve, the defaults)
PARAMS = {"greedy": GREEDY,
          "chat": SamplingParams(max_tokens=1 << 20, temperature=0.0, top_p=0.95, top_k=50, repetition_penalty=1.05,
                                 seed=12345, stop_token_ids=(2,), ignore_eos=True)}


class FakeScheduler(Actor):
    name = "scheduler"

    def __init__(self, bus, s: Seqs, steps: int, busy_us: float, done: asyncio.Event, params=GREEDY):
        super().__init__(bus)
        self.s, self.steps, self.busy_s, self.done = s, steps, busy_us / 1e6, done
        self.params = params
        self.planned = 0
        self.results: list[float] = []
        self.hist: list[list[int]] = [[] for _ in s.out]  # generated so far, as results land
        P, g = len(s.prompts[0]), len(s.out[0])
        self.base = P + g - 1

    def plan(self) -> None:
        j = self.planned
        pen = self.params.needs_history
        seqs = tuple(SeqWork(seq_id=str(i), token_ids=(PENDING_TOKEN,) if j else (o[-1],), start_pos=self.base + j,
                             block_table=tuple(self.s.tables[i]), sample=True, params=self.params if j == 0 else None,
                             gen_index=len(o) + j, pending=int(j > 0),
                             history=tuple(o + self.hist[i]) if pen else ())
                     for i, o in enumerate(self.s.out))
        self.planned += 1
        self.send("executor", StepPlan(j, seqs))

    async def on_message(self, sender, msg):
        if isinstance(msg, StepResult):
            self.results.append(time.perf_counter())
            for t in msg.tokens:
                self.hist[int(t.seq_id)].append(t.token_id)
            t = time.perf_counter() + self.busy_s
            while time.perf_counter() < t:  # the rest of a real step's loop work
                pass
            if self.planned < self.steps:
                self.plan()
            if len(self.results) >= self.steps:
                self.done.set()


class Sink(Actor):
    def __init__(self, bus, name):
        self.name = name
        super().__init__(bus)

    async def on_message(self, sender, msg):
        pass


async def through_executor(runner, s: Seqs, steps: int, busy_us: float, params=GREEDY) -> float:
    log = EventLog(None)
    log.open(LogHeader(SCHEMA_VERSION, "bench", {}))
    bus = Bus(log)
    done = asyncio.Event()
    sch = FakeScheduler(bus, s, steps, busy_us, done, params)
    actors = [sch, ExecutorActor(bus, runner), Sink(bus, "ingress"), Sink(bus, "metrics")]
    for a in actors:
        a.start()
    sch.plan()
    sch.plan()  # depth 2
    await done.wait()
    for a in actors:
        await a.stop()
    gaps = [b - a for a, b in zip(sch.results[10:], sch.results[11:])]
    return statistics.median(gaps)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--busy-us", default="0,300,1000")
    ap.add_argument("--path", default="/tmp/imp_bench/135m-q4_1.gguf")
    ap.add_argument("--params", default="greedy", help="greedy,chat")
    ap.add_argument("--int8", action="store_true", help="--gpu-activations int8")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    path = Path(a.path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_raw_gguf(path, seed=0, **SHAPES["135m-q4_1"])
    steps = a.steps
    runner = GpuModelRunner.load(str(path), block_size=BS, kv_tokens=64 * (PROMPT + steps + 64) + 1024,
                                 max_graph_batch=64, int8_act=a.int8)
    prof = cProfile.Profile() if a.profile else None
    if prof is not None:
        orig = runner.launch

        def launch(*args, **kw):
            prof.enable()
            try:
                return orig(*args, **kw)
            finally:
                prof.disable()

        runner.launch = launch
    print(f"{path.name}, int8 activations {a.int8}")
    print("| params | batch | runner pipelined ms/step | " + " | ".join(f"executor, busy {b} µs" for b in a.busy_us.split(","))
          + " |")
    print("|---|---|---|" + "---|" * len(a.busy_us.split(",")))
    for B, pname in [(int(x), p) for x in a.batches.split(",") for p in a.params.split(",")]:
        params = PARAMS[pname]
        cells = []
        s = Seqs(B, PROMPT, steps + 64, np.random.default_rng(B), runner.config.vocab_size)
        s.prefill(runner)
        s.decode_pipelined(runner, 8)
        torch.cuda.synchronize()
        t = time.perf_counter()
        s.decode_pipelined(runner, 32)
        cells.append((time.perf_counter() - t) / 32 * 1e3)
        for busy in [float(x) for x in a.busy_us.split(",")]:
            s2 = Seqs(B, PROMPT, steps + 64, np.random.default_rng(B), runner.config.vocab_size)
            s2.prefill(runner)
            runner.forget([str(i) for i in range(B)]) if hasattr(runner, "forget") else None
            import uvloop

            cells.append(1e3 * uvloop.run(through_executor(runner, s2, steps, busy, params)))
        print(f"| {pname} | {B} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
