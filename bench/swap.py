"""Swap instead of recompute under pool pressure, through HTTP with streaming clients.

More long answers at once than the KV pool holds: admission lets two in (each reserves its prompt and 256
tokens of answer), their answers outgrow the pool and one is preempted, again and again. Per context length
(--lengths, prompt tokens; the pool is sized to 2.1 x (prompt + 256)) and per --preemption-mode, S streams
(--streams) of --tokens new tokens each (ignore_eos, greedy, prompts of distinct token ids: no sharing), and
the table: aggregate tok/s, TTFT p50 / p99, inter-token p50 / p99, preemptions and swaps, whether every
mode gave the same texts. `recompute` is vLLM v1's policy (it dropped swapping); `auto` is imp's default
(the boot-measured costs decide per preemption).

    .venv/bin/python bench/swap.py --model ~/.cache/imp/smollm2-135m.gguf --lengths 256,1024,2048
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serving import _pct, _stop, start_imp  # noqa: E402


async def _one(session, url: str, prompt: list[int], tokens: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, times, text, n = time.perf_counter(), [], [], 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            if not raw.startswith(b"data: {"):
                continue
            d = json.loads(raw[6:])
            if d.get("usage"):
                n = d["usage"]["completion_tokens"]
            for c in d.get("choices", ()):
                if c.get("text"):
                    times.append(time.perf_counter())
                    text.append(c["text"])
    return {"t0": t0, "times": times, "tokens": n, "text": "".join(text)}


async def _burst(url: str, prompts: list[list[int]], tokens: int) -> list[dict]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        return await asyncio.gather(*(_one(s, url, p, tokens) for p in prompts))


def run(model: str, mode: str, length: int, streams: int, tokens: int, log: Path, extra: list[str],
        device: str = "cpu") -> dict:
    pool = -(-int(2.1 * (length + 256)) // 16) * 16
    rng = random.Random(length)
    prompts = [[rng.randrange(200, 30000) for _ in range(length)] for _ in range(streams)]
    proc, url = start_imp(model, 0, device, ["--kv-cache-tokens", str(pool), "--preemption-mode", mode,
                                           "--max-batch-size", str(streams), *extra], False, log)
    try:
        asyncio.run(_burst(url, [[1, 2, 3]], 2))  # warm
        rs = asyncio.run(_burst(url, prompts, tokens))
        health = json.load(urllib.request.urlopen(url + "/health", timeout=30))
    finally:
        _stop(proc)
    t_start, t_end = min(r["t0"] for r in rs), max(r["times"][-1] for r in rs)
    ttft = [r["times"][0] - r["t0"] for r in rs]
    gaps = [b - a for r in rs for a, b in zip(r["times"], r["times"][1:])]
    return {"mode": mode, "length": length, "pool": pool, "agg": sum(r["tokens"] for r in rs) / (t_end - t_start),
            "ttft50": _pct(ttft, 0.5), "ttft99": _pct(ttft, 0.99), "itl50": 1e3 * _pct(gaps, 0.5),
            "itl99": 1e3 * _pct(gaps, 0.99), "preempt": health["preemptions"], "swaps": health["swaps"],
            "texts": [r["text"] for r in rs], "wall": t_end - t_start}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--modes", default="recompute,swap,auto")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--log-dir", default="/tmp")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("extra", nargs="*", help="more imp flags (after --)")
    a = ap.parse_args()
    flags = subprocess.run("grep -o -w 'avx2\\|avx512f\\|avx512_vnni\\|amx_tile' /proc/cpuinfo | sort -u | tr '\\n' ' '",
                           shell=True, capture_output=True, text=True).stdout
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# bench/swap.py {time.strftime('%Y-%m-%d %H:%M')} commit {commit} device {a.device} flags: {flags}")
    print(f"# {a.streams} streams x {a.tokens} new tokens, pool 2.1 x (prompt + 256) tokens")
    print("| prompt | pool | mode | tok/s | TTFT p50 / p99 s | ITL p50 / p99 ms | preemptions | swaps | wall s | texts |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for length in (int(x) for x in a.lengths.split(",")):
        base = None
        for mode in a.modes.split(","):
            r = run(a.model, mode, length, a.streams, a.tokens, Path(a.log_dir) / f"swap-{mode}-{length}.log", a.extra,
                    a.device)
            base = base or r["texts"]
            same = "same" if r["texts"] == base else "DIFFER"
            print(f"| {length} | {r['pool']} | {mode} | {r['agg']:.1f} | {r['ttft50']:.2f} / {r['ttft99']:.2f} | "
                  f"{r['itl50']:.1f} / {r['itl99']:.1f} | {r['preempt']} | {r['swaps']} | {r['wall']:.1f} | {same} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
