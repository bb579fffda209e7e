"""CPU serving benchmark: TTFT and decode tok/s at 1 and 8 concurrent streams.

Starts the real server (default model unless --model), sends a 354-token chat
prompt with ignore_eos so every stream decodes exactly --tokens tokens, and
prints a table. Usage:

    .venv/bin/python bench/cpu_serving.py [--model PATH] [--tokens 128] [--url URL]
    .venv/bin/python bench/cpu_serving.py --llama-server /tmp/llama-cpp/build/bin/llama-server

With --url it measures an already running server instead. With --llama-server
it runs the same client against imp and then llama-server (built by
bench/llama_cpp.sh) on the same GGUF with the same thread count, back to back,
and prints both tables and the ratios (on a shared box only ratios measured in
one run mean much). --cold puts a unique line in front of every prompt, so no
request can reuse another's cached prefix (TTFT = a full prefill); by default
the warm-up request leaves the prompt in both servers' prefix caches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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


COLD = False  # --cold: a unique first line per request (no prefix-cache hits)
_NONCE = [0]


async def one_stream(session, url: str, max_tokens: int, seed: int) -> dict:
    _NONCE[0] += 1
    text = f"Request {_NONCE[0]} at {time.time_ns()}.\n{PROMPT}" if COLD else PROMPT
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": text}],
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

    # a fresh connection per request: llama-server drops idle keep-alive connections, and a
    # reused dead one reads as "Server disconnected"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(force_close=True)) as s:
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


def llama_server(binary: str, model: str, threads: int, slots: int):
    """Start llama-server on the same GGUF; returns (process, url) once /health answers 200."""
    import subprocess
    import urllib.request

    from imp.fetch import resolve_model
    from tests.serverproc import free_port

    port = free_port()
    log = open("/tmp/llama-bench-server.log", "wb")
    proc = subprocess.Popen([binary, "-m", str(resolve_model(model)), "--host", "127.0.0.1", "--port", str(port),
                             "-t", str(threads), "-np", str(slots), "-c", str(1024 * slots)],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("llama-server exited; see /tmp/llama-bench-server.log")
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama-server did not become ready")


def table(title: str, rows: list[dict], tokens: int) -> None:
    print(f"\nserver: {title}   {tokens} tokens per stream, greedy, ignore_eos{', cold prompts' if COLD else ''}")
    print("| streams | prompt tokens | TTFT median (ms) | per-stream decode tok/s | aggregate tok/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['streams']} | {r['prompt']} | {r['ttft_ms']:.0f} | {r['stream_tok_s']:.1f} | {r['agg_tok_s']:.1f} |")


def main() -> int:
    global COLD
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--url", default=None)
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--server-args", default="", help="extra flags for the imp server")
    ap.add_argument("--llama-server", default=None, help="llama-server binary: measure it too, same run")
    ap.add_argument("--threads", type=int, default=2, help="threads for both servers")
    ap.add_argument("--cold", action="store_true", help="unique prompts: no prefix-cache hits")
    ap.add_argument("--peer-model", default=None, help="the file llama-server serves (default --model; e.g. the "
                    "llama-quantize Q8_0 of a BF16 file beside --server-args '--weights q8_0')")
    ns = ap.parse_args()
    COLD = ns.cold
    levels = [int(k) for k in ns.levels.split(",")]
    results = []
    if ns.url:
        results.append((ns.url, [asyncio.run(run_level(ns.url, k, ns.tokens)) for k in levels]))
    else:
        from tests.serverproc import ServerProcess

        srv = ServerProcess(ns.model, "--threads", str(ns.threads), *ns.server_args.split(),
                            log_path=Path("/tmp/imp-bench-server.log"))
        try:
            srv.wait_ready()
            results.append((f"imp {ns.model} {ns.server_args}".rstrip(), [asyncio.run(run_level(srv.url, k, ns.tokens)) for k in levels]))
        finally:
            srv.stop()
    if ns.llama_server:
        proc, url = llama_server(ns.llama_server, ns.peer_model or ns.model, ns.threads, max(levels))
        try:
            results.append((f"llama-server {ns.peer_model or ns.model}", [asyncio.run(run_level(url, k, ns.tokens)) for k in levels]))
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}  threads {ns.threads}  load average {os.getloadavg()[0]:.1f}")
    for title, rows in results:
        table(title, rows, ns.tokens)
    if len(results) == 2:
        print("\n| streams | tok/s ratio imp / llama.cpp (aggregate) | TTFT ratio imp / llama.cpp |")
        print("|---|---|---|")
        for a, b in zip(results[0][1], results[1][1]):
            print(f"| {a['streams']} | {a['agg_tok_s'] / b['agg_tok_s']:.2f} | {a['ttft_ms'] / b['ttft_ms']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
