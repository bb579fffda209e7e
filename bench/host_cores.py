"""The decision cores' host cost a token, without asyncio, HTTP or a model: issue 33's deliverable 3 measured where
a shared 2-vCPU box's noise does not drown it.

    .venv/bin/python bench/host_cores.py [--streams 64,256] [--prompt 234] [--answer 128] [--rounds 2] [--reps 5]

The admission, scheduler and KV allocator cores as `imp.engine.cores.build_cores` makes them for a server with
`--max-batch-size 256 --max-step-tokens 1024 --pipeline-depth 1`, driven in one thread by a loop that hands each
message to its core (as the actors' mailboxes do, without the queues), and an executor that does what
`imp.actors.executor` does to a plan and a result (`attach_state`, the decode rows as columns, one sampled token
a sampled row, `landed_result`) with no model: every microsecond here is Python the host spends on a step's rows. Each level
keeps C streams (a finished request is replaced at once) until C x rounds finished, prompts of --prompt random ids
(no prefix-cache hit), answers of --answer tokens (ignore_eos; a repetition penalty, so histories are kept, as
bench/engine.py's workload). Reported: CPU µs a token (process time / answer tokens), min and median of --reps
runs, and the steps a level took. What it leaves out (the actors' queues, the event log, detokenizing, the
streams' delivery) bench/engine.py --null-step-us 1 adds back.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from imp.actors.executor import attach_state, landed_result  # noqa: E402
from imp.sampling.works import RowBatch, Works  # noqa: E402
from imp.config import ServerConfig  # noqa: E402
from imp.engine.cores import build_cores  # noqa: E402
from imp.messages import (FinishReason, SampledToken, SamplingParams, StepPlan, StepResult, Submit, TokenBatch,  # noqa: E402
                          TokenOut)


def level(C: int, rounds: int, P: int, A: int, seed: int = 0, runner: bool = False) -> tuple[float, int, int]:
    """(CPU seconds, answer tokens, steps) of one level. runner: the GPU runner's host part samples the rows
    (`GpuModelRunner.host_only`, CPU tensors of a 32-id vocabulary) instead of a token made up a row."""
    cfg = ServerConfig(model="x", max_batch_size=256, max_step_tokens=1024, pipeline_depth=1)
    blocks = C * (-(-(P + A + 1) // cfg.block_size) + 1)
    adm, sch, kv = build_cores(cfg, blocks, P + A + 16, "bench")
    cores = {"admission": adm, "scheduler": sch, "kv": kv}
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=A, ignore_eos=True, repetition_penalty=1.05, seed=1)
    kept, hists, plans = {}, {}, collections.deque()
    gpu = None
    if runner:
        from imp.gpu.runner import GpuModelRunner

        gpu = GpuModelRunner.host_only(vocab=32, block_size=cfg.block_size, num_blocks=blocks,
                                       context_length=P + A + 16, max_batch=256)
        gpu.host_logits.copy_(torch.randn(gpu.host_logits.shape))
    issued = finished = tokens = steps = 0
    now = 0

    def deliver(q: collections.deque) -> None:
        nonlocal finished, tokens
        while q:
            sender, receiver, msg = q.popleft()
            core = cores.get(receiver)
            if core is not None:
                q.extend((receiver, r, m) for r, m in core.handle(sender, msg))
            elif receiver == "executor" and isinstance(msg, StepPlan):
                plans.append(msg)
            elif receiver == "detok":
                for t in (msg.each() if isinstance(msg, TokenBatch) else (msg,) if isinstance(msg, TokenOut) else ()):
                    tokens += len(t.token_ids)
                    finished += t.finish != FinishReason.NONE

    def submit() -> None:
        nonlocal issued
        prompt = tuple(rng.integers(300, 30000, size=P).tolist())
        deliver(collections.deque([("ingress", "admission", Submit(f"r{issued}", prompt, params, now))]))
        issued += 1

    total = C * rounds
    t0 = time.process_time()
    for _ in range(C):
        submit()
    while finished < total:
        if not plans:
            raise RuntimeError(f"no plan with {finished} of {total} finished")
        plan = plans.popleft()
        seqs = attach_state(plan, kept, hists)
        rows = RowBatch(plan.rows, kept, hists) if plan.rows is not None and len(plan.rows) else None
        landed = None
        if gpu is not None:
            gpu.forget(plan.freed)
            if rows is None:
                out = gpu.collect(gpu.launch(seqs))
            else:  # as the executor does: the rows as columns, the step landed as ids
                sids, ids, out = gpu.collect_ids(gpu.launch(Works(rows, seqs)))
                landed = (sids, ids) if out is None else None
        else:
            out = [SampledToken(w.seq_id, 1000 + (w.gen_index % 7000)) for w in seqs if w.sample]
            if rows is not None:
                landed = (Works(rows, []).seq_ids + [t.seq_id for t in out],
                          np.concatenate([1000 + rows.gen % 7000, np.array([t.token_id for t in out], np.int64)]))
        now += 1_000_000
        steps += 1
        before = finished
        res = landed_result(plan.step, out or [], rows, hists, now, 1_000_000, 0, landed)
        deliver(collections.deque([("executor", "scheduler", res)]))
        for _ in range(min(finished - before, total - issued)):
            submit()
    return time.process_time() - t0, tokens, steps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", default="64,256")
    ap.add_argument("--prompt", type=int, default=234)
    ap.add_argument("--answer", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--runner", action="store_true", help="the GPU runner's host part samples (GpuModelRunner.host_only)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    print("| streams | CPU µs a token, min | median | steps | tokens |")
    print("|---|---|---|---|---|")
    for C in (int(x) for x in a.streams.split(",")):
        runs = [level(C, a.rounds, a.prompt, a.answer, runner=a.runner) for _ in range(a.reps)]
        us = [1e6 * cpu / tok for cpu, tok, _ in runs]
        print(f"| {C} | {min(us):.2f} | {statistics.median(us):.2f} | {runs[0][2]} | {runs[0][1]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
