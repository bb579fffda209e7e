"""Serving throughput through HTTP: what a streaming client gets, per process layout.

Starts the real server once per layout (`--api-servers` 0 = one process, N = an engine
process and N API servers) and, optionally, llama.cpp's llama-server (`-np` = streams)
on the same GGUF; sends S concurrent streaming chat requests (`ignore_eos`, --tokens
new tokens each, one 354-token prompt) and prints, per server and concurrency:
aggregate tok/s, TTFT p50/p99, inter-chunk latency p50/p99 and their ratio. Each cell
runs --runs times (two runs agreeing is part of the result).

    .venv/bin/python bench/serving.py --layouts 0,1,2 --streams 1,16,64,256
    .venv/bin/python bench/serving.py --device cuda:0 --llama-server /tmp/llama-cpp/build/bin/llama-server
    .venv/bin/python bench/serving.py --null --layouts 0,2 --streams 256 --client-procs 2   # control plane

--null starts imp with IMP_NULL_RUNNER=1: a runner that answers every step at once (with
--null-step-us T: T µs a step on a make-believe device, pipelined as a GPU is), so
the figure is the server's own cost per token (HTTP, tokenization, actors, event log,
process boundary, detokenization, SSE). The client spreads the streams over
--client-procs processes so that it is not the bottleneck itself.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu_serving import PROMPT  # noqa: E402


PER_STREAM = {False: 640, True: 1536}  # context a stream needs (its prompt + new tokens): --kv-cache-tokens, -c


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _one(session, url: str, tokens: int, seed: int, nonce: str = "") -> dict:
    # nonce: the cold-shared case: one system prompt new to the server (the nonce leads it) that every
    # stream of the burst shares, and a question of each stream's own
    msgs = ([{"role": "system", "content": f"[{nonce}] {PROMPT} {PROMPT} {PROMPT}"},  # ~1,070 tokens: > a step
             {"role": "user", "content": f"Question {seed}."}]
            if nonce else [{"role": "user", "content": PROMPT}])
    body = {"model": "bench", "messages": msgs, "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "seed": seed}
    t0 = time.perf_counter()
    times: list[float] = []
    usage_line = b""
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            if not raw.startswith(b"data: "):
                continue
            if b'"usage":{' in raw or b'"usage": {' in raw:
                usage_line = raw
            elif b'"content":"' in raw and b'"content":""' not in raw:
                times.append(time.perf_counter())
    import json

    n = json.loads(usage_line[6:])["usage"]["completion_tokens"] if usage_line else len(times)
    return {"t0": t0, "times": times, "tokens": n}


async def _client(url: str, seeds: list[int], tokens: int, start_at: float, nonce: str = "") -> list[dict]:
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800), connector=conn) as s:
        delay = start_at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        return await asyncio.gather(*(_one(s, url, tokens, i, nonce) for i in seeds))


def _client_proc(args) -> list[dict]:
    url, seeds, tokens, start_at, nonce = args
    try:
        import uvloop

        return uvloop.run(_client(url, seeds, tokens, start_at, nonce))
    except ImportError:
        return asyncio.run(_client(url, seeds, tokens, start_at, nonce))


def measure(url: str, streams: int, tokens: int, procs: int, cold_shared: bool = False) -> dict:
    _client_proc((url, [0], 4, 0.0, ""))  # warm-up (and the prompt into the prefix cache)
    nonce = f"session {time.time_ns()}" if cold_shared else ""
    procs = max(1, min(procs, streams))
    parts = [list(range(i, streams, procs)) for i in range(procs)]
    start_at = time.time() + 0.5
    if procs == 1:
        results = [_client_proc((url, parts[0], tokens, start_at, nonce))]
    else:
        with mp.get_context("spawn").Pool(procs) as pool:
            results = pool.map(_client_proc, [(url, p, tokens, start_at, nonce) for p in parts])
    rs = [r for part in results for r in part]
    t_start = min(r["t0"] for r in rs)
    t_end = max(r["times"][-1] if r["times"] else r["t0"] for r in rs)
    ttft = [r["times"][0] - r["t0"] for r in rs if r["times"]]
    gaps = [b - a for r in rs for a, b in zip(r["times"], r["times"][1:])]
    toks = sum(r["tokens"] for r in rs)
    p50, p99 = _pct(gaps, 0.5), _pct(gaps, 0.99)
    return {"streams": streams, "agg": toks / (t_end - t_start), "ttft50": 1e3 * _pct(ttft, 0.5),
            "ttft99": 1e3 * _pct(ttft, 0.99), "itl50": 1e3 * p50, "itl99": 1e3 * p99,
            "ratio": p99 / p50 if p50 > 0 else float("nan"),
            "chunks_per_token": sum(len(r["times"]) for r in rs) / max(1, toks)}


def wait_ready(url: str, proc, what: str, timeout: float = 900) -> None:
    """Until url/health answers 200 (or the process exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{what} not ready")


def start_imp(model: str, layout: int, device: str, extra: list[str], null: bool, log: Path):
    from tests.serverproc import free_port

    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({"IMP_NULL_RUNNER": "1"} if null else {}))
    env.pop("IMP_TEST_API_SERVERS", None)
    cmd = [sys.executable, "-m", "imp", "--model", model, "--port", str(port), "--device", device,
           "--api-servers", str(layout), *extra]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parent.parent, env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, f"imp --api-servers {layout} (log {log})")
    return proc, url


def start_llama(binary: str, model: str, streams: int, device: str, threads: int, log: Path, per_slot: int = 640):
    from tests.serverproc import free_port

    port = free_port()
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(streams),
           "-c", str(per_slot * streams), "-t", str(threads)]
    if device.startswith("cuda"):
        cmd += ["-ngl", "999"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, f"llama-server (log {log})")
    return proc, url


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def row(server: str, run: int, r: dict) -> str:
    return (f"| {server} | {r['streams']} | {run} | {r['agg']:,.0f} | {r['ttft50']:.0f} / {r['ttft99']:.0f} | "
            f"{r['itl50']:.2f} / {r['itl99']:.2f} | {r['ratio']:.1f} | {r['chunks_per_token']:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layouts", default="0,2", help="--api-servers values to measure (0 = one process)")
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--null", action="store_true", help="IMP_NULL_RUNNER=1: the server's own cost")
    ap.add_argument("--null-step-us", type=int, default=0,
                    help="with --null: each step takes this long on a make-believe device, launched and "
                         "collected as a GPU's (IMP_NULL_STEP_US; add --server-args '--pipeline-depth 2')")
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--cold-shared", action="store_true",
                    help="each run's streams share a ~1,070-token system prompt the server has not seen (a "
                         "burst of one agent's requests; longer than a step's budget), each with its own "
                         "question; default: one cached prompt")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server -t")
    ap.add_argument("--server-args", default="", help="more imp flags, e.g. '--max-batch-size 256'")
    ap.add_argument("--logs", default="/tmp")
    a = ap.parse_args()
    if a.null_step_us:
        os.environ["IMP_NULL_STEP_US"] = str(a.null_step_us)
    from imp.fetch import resolve_model

    model = str(resolve_model(a.model))
    levels = [int(x) for x in a.streams.split(",")]
    extra = a.server_args.split()
    if not any(x == "--max-batch-size" for x in extra):
        extra += ["--max-batch-size", str(max(levels))]
    if not any(x == "--kv-cache-tokens" for x in extra):
        extra += ["--kv-cache-tokens", str(max(levels) * PER_STREAM[a.cold_shared])]
    print(f"model {Path(model).name}, device {a.device}, {a.tokens} tokens a stream, ignore_eos, "
          f"{'NULL runner, ' if a.null else ''}client processes {a.client_procs}, imp flags {' '.join(extra)}")
    print("\n| server | streams | run | agg tok/s | TTFT p50 / p99 ms | inter-chunk p50 / p99 ms | p99/p50 "
          "| chunks/token |")
    print("|---|---|---|---|---|---|---|---|")
    for layout in [int(x) for x in a.layouts.split(",")]:
        name = f"imp --api-servers {layout}"
        proc, url = start_imp(model, layout, a.device, extra, a.null, Path(a.logs) / f"serving-imp-{layout}.log")
        try:
            for s in levels:
                for run in range(1, a.runs + 1):
                    print(row(name, run, measure(url, s, a.tokens, a.client_procs, a.cold_shared)), flush=True)
        finally:
            _stop(proc)
    if a.llama_server:
        for s in levels:
            proc, url = start_llama(a.llama_server, model, s, a.device, a.threads, Path(a.logs) / "serving-llama.log",
                                    PER_STREAM[a.cold_shared])
            try:
                for run in range(1, a.runs + 1):
                    print(row(f"llama-server -np {s}", run, measure(url, s, a.tokens, a.client_procs, a.cold_shared)),
                          flush=True)
            finally:
                _stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
