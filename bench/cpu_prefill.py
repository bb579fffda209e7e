"""Prefill throughput of the CPU runner against llama-bench's ppN on the same GGUF, one table.

    .venv/bin/python bench/cpu_prefill.py --model ~/.cache/imp/SmolLM2-135M-Instruct.Q4_1.gguf \
        --llama-bench /tmp/llama-cpp/build/bin/llama-bench --tokens 512 --threads 2

imp: `ModelRunner.step` over one fresh sequence of N prompt tokens (the fused Numba forward,
the head row sampled), a warm-up first (JIT, caches), then the median of --reps. llama.cpp:
`llama-bench -p N -n 0 -t THREADS -r REPS`, its mean t/s.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def imp_prefill(model: str, n: int, threads: int, reps: int) -> float:
    import torch

    from imp.messages import SamplingParams, SeqWork
    from imp.model.runner import ModelRunner

    r = ModelRunner.load(model, kv_tokens=max(4096, 2 * n), num_threads=threads)
    bs = r.block_size
    nb = (n + bs - 1) // bs
    toks = tuple(int(t) for t in torch.randint(100, int(r.config.vocab_size) - 100, (n,), generator=torch.Generator().manual_seed(0)))
    rates = []
    for i in range(reps + 1):
        w = SeqWork(f"p{i}", toks, 0, tuple(range(nb)), True, SamplingParams(max_tokens=1))
        t0 = time.perf_counter()
        with torch.inference_mode():
            r.step([w])
        dt = time.perf_counter() - t0
        r.forget((w.seq_id,)) if hasattr(r, "forget") else None
        if i:  # the first is the warm-up
            rates.append(n / dt)
    return statistics.median(rates)


def llama_bench(binary: str, model: str, n: int, threads: int, reps: int, test: str = "pp") -> float | None:
    """llama-bench's mean tok/s for ppN (prefill, the default) or tgN (decode, test="tg")."""
    p, g = (n, 0) if test == "pp" else (0, n)
    out = subprocess.run([binary, "-m", model, "-p", str(p), "-n", str(g), "-t", str(threads), "-r", str(reps)],
                         capture_output=True, text=True, timeout=900).stdout
    m = re.search(rf"{test}{n}\s*\|\s*([\d.]+)", out)
    return float(m.group(1)) if m else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    from imp.fetch import resolve_model

    a.model = str(resolve_model(a.model))  # a name (smollm2-135m) or a path
    ours = imp_prefill(a.model, a.tokens, a.threads, a.reps)
    peer = llama_bench(a.llama_bench, a.model, a.tokens, a.threads, a.reps) if a.llama_bench else None
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}  {Path(a.model).name}  threads {a.threads}\n")
    print(f"| prefill | imp tok/s | llama-bench pp{a.tokens} tok/s | ratio |")
    print("|---|---|---|---|")
    print(f"| {a.tokens} tokens | {ours:,.0f} | {f'{peer:,.0f}' if peer else '-'} | "
          f"{f'{ours / peer:.2f}' if peer else '-'} |")


if __name__ == "__main__":
    main()
