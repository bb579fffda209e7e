"""CPU serving benchmark: TTFT and decode tok/s at 1 and 8 concurrent streams.

Starts the real server (default model unless --model), sends a ~234-token
prompt with ignore_eos so every stream decodes exactly --tokens tokens, and
prints a table. Usage:

    .venv/bin/python bench/cpu_serving.py [--model PATH] [--tokens 128] [--url URL]

With --url it measures an already running server instead (e.g. llama-server
on the same GGUF, for a same-machine comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = (
    "You are a meticulous assistant. Summarise the following passage in three sentences, "
    "then list five keywords. Passage: "
    + " ".join(
        f"In year {1900 + i}, the city council debated item {i} about bridges, trams, parks and schools."
        for i in range(12)
    )
)


async def one_stream(session, url: str, max_tokens: int, seed: int) -> dict:
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "seed": seed,
    }
    t0 = time.perf_counter()
    first = None
    usage = None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else max_tokens
    return {"ttft": (first or end) - t0, "total": end - t0, "tokens": n,
            "prompt": usage["prompt_tokens"] if usage else 0, "decode_s": end - (first or t0)}


async def run_level(url: str, streams: int, max_tokens: int) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await one_stream(s, url, 4, 0)  # warm-up
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(one_stream(s, url, max_tokens, i) for i in range(streams)))
        wall = time.perf_counter() - t0
    toks = sum(r["tokens"] for r in rs)
    per_stream = [(r["tokens"] - 1) / r["decode_s"] for r in rs if r["decode_s"] > 0]
    return {
        "streams": streams,
        "prompt": rs[0]["prompt"],
        "ttft_ms": 1000 * statistics.median(r["ttft"] for r in rs),
        "stream_tok_s": statistics.median(per_stream),
        "agg_tok_s": toks / wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--url", default=None)
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--server-args", default="", help="extra flags for the imp server")
    ns = ap.parse_args()
    srv = None
    url = ns.url
    if url is None:
        from tests.serverproc import ServerProcess

        srv = ServerProcess(ns.model, *ns.server_args.split(), log_path=Path("/tmp/imp-bench-server.log"))
        srv.wait_ready()
        url = srv.url
    try:
        rows = [asyncio.run(run_level(url, int(k), ns.tokens)) for k in ns.levels.split(",")]
    finally:
        if srv:
            srv.stop()
    print(f"\nserver: {url if ns.url else 'imp ' + ns.model}   {ns.tokens} tokens per stream, greedy, ignore_eos")
    print("| streams | prompt tokens | TTFT median (ms) | per-stream decode tok/s | aggregate tok/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['streams']} | {r['prompt']} | {r['ttft_ms']:.0f} | {r['stream_tok_s']:.1f} | {r['agg_tok_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
