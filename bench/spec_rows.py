"""What a drafted row costs on this machine: one engine step of B decode rows, each with k drafted
tokens behind it (a verify share), timed through ModelRunner.step at a context of --context tokens.

    .venv/bin/python bench/spec_rows.py --model gemma-3-270m [--context 2300] [--batches 1,16] [--drafts 0,1,3,7]

Speculation pays where a step of B x (1 + k) rows costs little more than one of B rows: a step that
reads the weights for one row (one stream, memory-bound) has room for more rows; a compute-bound one
(many streams on a CPU) does not. imp.core.spec.StepCost learns the same line from the server's own steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from imp.fetch import resolve_model  # noqa: E402
from imp.messages import SamplingParams, SeqWork  # noqa: E402
from imp.model.runner import ModelRunner  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=2300)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--drafts", default="0,1,3,7")
    ns = ap.parse_args()
    batches, drafts = [int(x) for x in ns.batches.split(",")], [int(x) for x in ns.drafts.split(",")]
    r = ModelRunner.load(str(resolve_model(ns.model, progress=False)),
                         kv_tokens=max(batches) * (ns.context + max(drafts) + 64) + 1024)
    bs, greedy = r.block_size, SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    per = (ns.context + max(drafts) + 1) // bs + 2

    def shares(B: int, k: int) -> list[SeqWork]:
        return [SeqWork(f"s{b}", tuple(int(t) for t in rng.integers(300, 4000, 1 + k)), ns.context,
                        tuple(range(b * per, b * per + (ns.context + k) // bs + 1)), True, greedy, gen_index=5,
                        draft=k) for b in range(B)]

    print(f"{ns.model}, context {ns.context}, {r.num_threads} threads")
    print("| decode rows | drafted each | rows | step ms | ms a row past the first B |")
    print("|---|---|---|---|---|")
    for B in batches:
        base = None
        for k in drafts:
            s = shares(B, k)
            r.step(s)
            n = max(2, 16 // B)
            t0 = time.perf_counter()
            for _ in range(n):
                r.step(s)
            ms = (time.perf_counter() - t0) / n * 1e3
            base = ms if k == 0 else base
            extra = f"{(ms - base) / (B * k):.2f}" if k else "-"
            print(f"| {B} | {k} | {B * (1 + k)} | {ms:.1f} | {extra} |", flush=True)


if __name__ == "__main__":
    main()
