"""Where the CPU server's memory goes: RSS (anonymous / file-backed) after each boot stage, in
one process, in the order `imp.server.load_engine` runs them (issue 15's memory goal).

    PYTHONPATH=. .venv/bin/python bench/memory_stages.py --model gemma-3-270m

Prints a markdown table; run it with nothing else busy on the machine only for the file-backed
figures' sake (page-cache readahead moves them a little), the anonymous ones are stable.
"""

from __future__ import annotations

import argparse
import sys
import time


def rss() -> tuple[int, int, int]:
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile"):
                d[k] = int(v.split()[0]) // 1024
    return d["VmRSS"], d["RssAnon"], d["RssFile"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    rows: list[tuple[str, float, tuple[int, int, int]]] = []
    t0 = time.perf_counter()

    def mark(stage: str) -> None:
        rows.append((stage, time.perf_counter() - t0, rss()))

    mark("python")
    import numba  # noqa: F401
    import numpy  # noqa: F401

    mark("numpy, numba imported")
    import imp.server as S
    from imp.settle import settle_after_boot
    from imp.constrain.compile import GrammarCache
    from imp.constrain.vocab import from_tokenizer
    from imp.fetch import resolve_model
    from imp.model.runner import ModelRunner
    from imp.text.tokenizer import Tokenizer

    mark("the server's modules (aiohttp, llguidance, otel)")
    path = resolve_model(args.model)
    r = ModelRunner.load(path, block_size=16, kv_tokens=None, num_threads=args.threads or None)
    mark("ModelRunner.load (header, Numba kernels, vectors)")
    tok = Tokenizer.from_gguf_metadata(r.metadata)
    mark("tokenizer")
    S.warm_up_prefill(r)
    mark("warm-up prefill (the weights' pages)")
    grammars = GrammarCache(from_tokenizer(tok, int(r.config.vocab_size)))
    mark("llguidance's vocabulary")
    freed = settle_after_boot()
    mark(f"settle_after_boot (collect, freeze, malloc_trim, {freed // 1024} MB of LLVM's pages)")
    print(f"model: {path}\n")
    print("| stage | s | RSS MB | anonymous | file-backed |\n|---|---|---|---|---|")
    for stage, t, (total, anon, file) in rows:
        print(f"| {stage} | {t:.2f} | {total} | {anon} | {file} |")
    del grammars


if __name__ == "__main__":
    sys.exit(main())
