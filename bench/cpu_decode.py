"""One-stream decode in process on the CPU against llama-bench's tgN on the same GGUF, one table.

    .venv/bin/python bench/cpu_decode.py --model ~/.cache/imp/SmolLM2-135M-Instruct.Q4_1.gguf \
        --llama-bench /tmp/llama-cpp/build/bin/llama-bench --threads 2 --rounds 3

imp: `ModelRunner.step` over one sequence (a 32-token prompt, then --tokens greedy decode steps,
the fused Numba forward and the sampler, Python included), the median step after 4 warm-up
steps. llama.cpp: `llama-bench -p 0 -n TOKENS -t THREADS`. The two alternate --rounds times,
so a noisy box shows in the spread rather than in the ratio. --profile: cProfile of one imp run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu_prefill import llama_bench  # noqa: E402


def imp_decode(model: str, tokens: int, threads: int, profile: bool = False, weights: str = "native") -> float:
    """Median decode step of one stream, in ms."""
    import torch

    from imp.messages import SamplingParams, SeqWork
    from imp.model.runner import ModelRunner

    r = ModelRunner.load(model, kv_tokens=4096, num_threads=threads, requant=weights)
    prompt = tuple(range(100, 132))
    table = tuple(range((len(prompt) + tokens + r.block_size) // r.block_size + 1))
    p = SamplingParams(max_tokens=tokens + 1, temperature=0.0, repetition_penalty=1.0)
    times = []
    with torch.inference_mode():
        out = r.step([SeqWork("d", prompt, 0, table, True, p)])
        pos = len(prompt)
        prof = None
        if profile:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        for i in range(tokens):
            t0 = time.perf_counter()
            out = r.step([SeqWork("d", (out[0].token_id,), pos, table, True, p, gen_index=i + 1)])
            times.append(time.perf_counter() - t0)
            pos += 1
        if prof:
            import pstats
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    return statistics.median(times[4:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-bench", default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--weights", default="native", help="imp's --weights (q8_0: a BF16 file's matrices as Q8_0)")
    ap.add_argument("--peer-model", default=None, help="the file llama-bench reads (default --model; e.g. the "
                    "llama-quantize Q8_0 of a BF16 file, beside --weights q8_0)")
    a = ap.parse_args()
    rows = []
    for _ in range(a.rounds):
        ms = imp_decode(a.model, a.tokens, a.threads, a.profile, a.weights)
        peer = (llama_bench(a.llama_bench, a.peer_model or a.model, a.tokens, a.threads, 3, test="tg")
                if a.llama_bench else None)
        rows.append((1e3 / ms, peer))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}  {Path(a.model).name} (--weights {a.weights}; llama-bench on "
          f"{Path(a.peer_model or a.model).name})  threads {a.threads}  tokens {a.tokens}\n")
    print(f"| round | imp tok/s (one stream, in process) | llama-bench tg{a.tokens} tok/s | ratio |")
    print("|---|---|---|---|")
    for i, (ours, peer) in enumerate(rows, 1):
        print(f"| {i} | {ours:,.1f} | {f'{peer:,.1f}' if peer else '-'} | {f'{ours / peer:.2f}' if peer else '-'} |")


if __name__ == "__main__":
    main()
