"""Constrained decoding: what a grammar mask costs per decode step.

    .venv/bin/python bench/constrain_mask.py [--model PATH] [--steps 200] [--threads N]

For batch 1 and 32 on SmolLM2's vocabulary (49,152 tokens), B matchers walk
their grammar (a random allowed token each step, restarted when done) and
each step is timed in its two parts, as the engine runs them:

    fill   fill_masks: llguidance computes every row's bitmap (batched rows run
           in parallel on its Rust pool: GrammarCache.executor)
    apply  apply_mask: the bitmaps applied to the [B, V] fp32 logits (-inf);
           CPU here, and on the GPU (kernel + the bitmap's host->device copy)
           when CUDA is available

Also printed: compile time, deep-copy time and resident memory per matcher.
Numbers are medians (and p90) in microseconds per step for the whole batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from imp.constrain import Constraint, GrammarCache, alloc_bitmask, apply_mask, build_tokenizer, fill_masks  # noqa: E402

SPECS = {
    "json_schema": Constraint("json_schema", json.dumps({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40},
                       "city": {"enum": ["Paris", "Oslo", "Lima", "Kyoto"]},
                       "temps": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                                 "maxItems": 8},
                       "ok": {"type": "boolean"}},
        "required": ["name", "city", "temps", "ok"]}), strict=True),
    "json_object": Constraint("json_object"),
    "regex": Constraint("regex", r"[A-Z][a-z]{2,12}( [a-z]{2,12}){3,12}\."),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(cache: GrammarCache, spec: Constraint, B: int, steps: int, eos: frozenset[int], V: int,
        gpu: bool) -> dict[str, list[float]]:
    compiled = cache.compile_sync(spec, timeout_s=10)
    ms = [compiled.matcher() for _ in range(B)]
    bm = alloc_bitmask(B, V, pin=gpu)
    logits = torch.randn(B, V)
    dev_logits = torch.randn(B, V, device="cuda") if gpu else None
    dev_bm = torch.empty_like(bm, device="cuda") if gpu else None
    rows = [(m, i) for i, m in enumerate(ms)]
    rnd = random.Random(0)
    t: dict[str, list[float]] = {"fill": [], "apply": [], "gpu": []}
    shifts = torch.arange(32, dtype=torch.int32)
    for _ in range(steps):
        a = time.perf_counter()
        fill_masks(rows, bm, cache.executor)
        b = time.perf_counter()
        apply_mask(logits, bm)
        c = time.perf_counter()
        t["fill"].append((b - a) * 1e6)
        t["apply"].append((c - b) * 1e6)
        if gpu:
            torch.cuda.synchronize()
            g0 = time.perf_counter()
            dev_bm.copy_(bm, non_blocking=True)
            apply_mask(dev_logits, dev_bm)
            torch.cuda.synchronize()
            t["gpu"].append((time.perf_counter() - g0) * 1e6)
        allowed = ((bm.unsqueeze(-1) >> shifts) & 1).reshape(B, -1)[:, :V].bool()
        for i, m in enumerate(ms):  # untimed: pick a random allowed token, as a sampler would
            if m.done():
                m.reset()
                continue
            ok = allowed[i].clone()
            ok[list(eos)] = False
            idx = torch.nonzero(ok).flatten()
            if len(idx) == 0:
                m.reset()
                continue
            m.advance(int(idx[rnd.randrange(len(idx))]))
        logits.normal_()
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the cached smollm2-135m)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from imp.fetch import resolve_model
    from imp.text.tokenizer import Tokenizer

    path = args.model or str(resolve_model("smollm2-135m", progress=False))
    tk = Tokenizer.from_gguf(path)
    V = tk.vocab_size
    t0 = time.perf_counter()
    lt = build_tokenizer([tk.piece_bytes(i) for i in range(V)], tk.eos_ids,
                         {i for i in range(V) if tk.is_special(i)}, bos_id=tk.bos_id, encode=tk.encode)
    print(f"vocab {V}, tokenizer view built in {(time.perf_counter() - t0) * 1e3:.0f} ms; "
          f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}")
    cache = GrammarCache(lt)
    gpu = torch.cuda.is_available()
    print()
    print("| grammar | batch | fill p50 | fill p90 | apply CPU p50 | apply CPU p90 | fill+apply CPU p50 |"
          + (" apply GPU p50 (incl. H2D) |" if gpu else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if gpu else ""))
    for name, spec in SPECS.items():
        for B in (1, 32):
            t = run(cache, spec, B, args.steps, tk.eos_ids, V, gpu)
            tot = [f + a for f, a in zip(t["fill"], t["apply"])]
            row = (f"| {name} | {B} | {statistics.median(t['fill']):.0f} us | {pct(t['fill'], .9):.0f} us | "
                   f"{statistics.median(t['apply']):.0f} us | {pct(t['apply'], .9):.0f} us | "
                   f"{statistics.median(tot):.0f} us |")
            if gpu:
                row += f" {statistics.median(t['gpu']):.0f} us |"
            print(row, flush=True)
    print()
    # compile and copy
    for name, spec in SPECS.items():
        c = cache.compile_sync(spec, timeout_s=10)
        t0 = time.perf_counter()
        for _ in range(200):
            c.matcher()
        copy_us = (time.perf_counter() - t0) / 200 * 1e6
        print(f"{name}: compile {c.compile_s * 1e3:.1f} ms, matcher copy {copy_us:.0f} us")
    # memory and replay cost grow with the tokens consumed (llguidance keeps per-byte parser
    # rows so it can roll back): measure after a 1,000-token string
    long = Constraint("json_schema", json.dumps({"type": "object", "properties": {
        "t": {"type": "string", "maxLength": 50_000}}, "required": ["t"]}))
    c = cache.compile_sync(long, timeout_s=10)
    path = tk.encode('{"t": "')
    text = tk.encode(("the quick brown fox jumps over the lazy dog " * 200).strip())[:1000]
    path += text
    n = 200
    base = rss_bytes()
    ms = [c.matcher() for _ in range(n)]
    t0 = time.perf_counter()
    for m in ms:
        m.sync(path)
    replay = (time.perf_counter() - t0) / n
    per = (rss_bytes() - base) / n
    print(f"after {len(path)} tokens: ~{per / 1024:.0f} KiB resident per matcher (RSS delta over {n}), "
          f"sync() replay from scratch {replay * 1e3:.2f} ms ({replay / len(path) * 1e6:.1f} us/token)")
    del ms
    cache.close()


if __name__ == "__main__":
    main()
