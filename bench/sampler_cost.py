"""The host sampler's cost per row for the sampling table's options (DRY, mirostat against plain sampling), on
random logits of SmolLM2's and Gemma 3's vocabulary sizes. A GPU step samples such rows on the host too
(SamplingParams.host_sampled), so this is their cost there as well (plus the row's copy to the host).

    .venv/bin/python bench/sampler_cost.py
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from imp.messages import Dry, SamplingParams, SeqWork  # noqa: E402
from imp.sampling import cpu  # noqa: E402


def per_row_ms(x: np.ndarray, p: SamplingParams, history=(), reps: int = 20) -> float:
    w = SeqWork("s", (1,), 0, (0,), True, p, history=history)
    cpu.sample_one(x.copy(), w, own=True)
    rows = [x.copy() for _ in range(reps)]
    t = time.perf_counter()
    for r in rows:
        cpu.sample_one(r, w, own=True)
    return (time.perf_counter() - t) / reps * 1e3


def main() -> int:
    flags = subprocess.run("lscpu | grep -o 'avx512[a-z_]*\\|avx2\\|amx[a-z_]*' | sort -u | tr '\\n' ' '",
                           shell=True, capture_output=True, text=True).stdout.strip()
    print(f"CPU flags: {flags}")
    rng = np.random.default_rng(0)
    ctx = tuple(int(t) for t in rng.integers(0, 3000, 2048)) * 2  # a 4096-token context with repeats
    cases = [
        ("greedy", SamplingParams(max_tokens=4), ()),
        ("temperature 0.8, top_k 50, top_p 0.9", SamplingParams(max_tokens=4, temperature=0.8, top_k=50, top_p=0.9,
                                                                 seed=1), ()),
        ("greedy + DRY, window 64", SamplingParams(max_tokens=4, dry=Dry(multiplier=0.8, prefix=ctx[-64:])), ()),
        ("greedy + DRY, window 4096 (last_n -1)", SamplingParams(max_tokens=4, dry=Dry(multiplier=0.8, last_n=-1,
                                                                                       prefix=ctx)), ()),
        ("mirostat 2, temperature 0.8", SamplingParams(max_tokens=4, temperature=0.8, seed=1, mirostat=2), ()),
        ("mirostat 1, temperature 0.8", SamplingParams(max_tokens=4, temperature=0.8, seed=1, mirostat=1), ()),
    ]
    print("| sampling | 49,152 ids (SmolLM2) ms/row | 262,144 ids (Gemma 3) ms/row |")
    print("|---|---|---|")
    for name, p, hist in cases:
        cells = []
        for V in (49152, 262144):
            x = (rng.standard_normal(V) * 2).astype(np.float32)
            cells.append(f"{per_row_ms(x, p, hist):.3f}")
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
