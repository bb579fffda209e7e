"""The GPU executor's host work a step, on the CPU: issue 33's deliverable 3 on the executor's side, measured where
no GPU is lent.

    .venv/bin/python bench/executor_host.py [--streams 64,256] [--steps 400] [--reps 5] [--vocab 256]

A steady decode workload (every row one PENDING_TOKEN fed, pipelined; greedy with the contract's default
repetition penalty 1.05, so the penalty counts run; SamplingParams with each sequence's first share only; a
table that grows every block) through what `imp.actors.executor` and `GpuModelRunner` do on the host for a
decode-graph step: `attach_state`, `GpuModelRunner.launch` (`host_only`: the plan checked, pending rows resolved, the graph's
inputs laid out in a host buffer as `StaticInputs.write` does, the sampler's launches on a [B, vocab] logits
tensor, the penalty counts recorded) and the landing (`SampledToken`s, `record_samples`). Torch runs on CPU
tensors of a tiny vocabulary, so the figure is the host's Python and launches' bookkeeping, not the device's
math: µs a step and µs a row, min and median of --reps runs (one process, one thread). On the H100 at 256
streams these parts were ~60 % of the executor's 8.6 ms a decode step (bench/results/2026-12-06-gpu-lane-profile-256-33rd.txt).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from imp.actors.executor import attach_state, record_samples  # noqa: E402
from imp.gpu.runner import GpuModelRunner  # noqa: E402
from imp.messages import PENDING_TOKEN, SamplingParams, SeqWork, StepPlan  # noqa: E402


def level(B: int, steps: int, V: int, prompt: int = 234, bs: int = 16) -> float:
    """Seconds of process time for `steps` decode steps of B rows."""
    r = GpuModelRunner.host_only(vocab=V, block_size=bs, num_blocks=B * 64 + 64, context_length=8192, max_batch=B)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True, repetition_penalty=1.05, seed=1)
    kept, hists = {}, {}
    tables = [tuple(range(i * 64, i * 64 + prompt // bs + 1)) for i in range(B)]
    r.host_logits.copy_(torch.randn(r.host_logits.shape))
    spent = 0.0
    for k in range(steps):
        pos = prompt + k
        seqs = []
        for i in range(B):
            if pos % bs == 0:  # the scheduler's grow: a new tuple
                tables[i] = tables[i] + (i * 64 + pos // bs,)
            first = k == 0
            seqs.append(SeqWork(f"s{i}", (PENDING_TOKEN,) if not first else (5,), pos, tables[i], True,
                                params if first else None, gen_index=k + 1, pending=0 if first else 1,
                                history=(5,) * (k + 1) if first else ()))
        plan = StepPlan(step=k, seqs=tuple(seqs))
        t0 = time.process_time()  # (the plan's making is the scheduler's, bench/host_cores.py)
        works = attach_state(plan, kept, hists)
        toks = r.collect(r.launch(works))
        record_samples(toks, hists)
        spent += time.process_time() - t0
    return spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="64,256")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--vocab", type=int, default=256)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print("| rows | µs a step (min / median) | µs a row (min) |")
    print("|---|---|---|")
    for B in [int(x) for x in a.streams.split(",")]:
        level(B, 20, a.vocab)  # warm
        ts = [level(B, a.steps, a.vocab) / a.steps * 1e6 for _ in range(a.reps)]
        print(f"| {B} | {min(ts):,.0f} / {statistics.median(ts):,.0f} | {min(ts) / B:.2f} |", flush=True)


if __name__ == "__main__":
    main()
