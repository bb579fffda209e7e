"""Soak: many mixed requests, random client disconnects, then check nothing leaked.

Sends --requests chat requests at --concurrency (mixed: streaming or not,
short and long prompts, various max_tokens, some with stop strings, n up to
2), and drops --disconnect of them mid-flight (closing the connection after
a random delay). Afterwards /health must show every KV block back at the
idle baseline and an empty queue, and no response may be a 5xx.

    .venv/bin/python bench/soak.py [--requests 2000] [--concurrency 16] [--url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORDS = "alpha beta gamma delta river stone cloud paper engine orbit lantern violet".split()


def make_body(rng: random.Random, i: int) -> dict:
    n_words = rng.choice([3, 10, 40, 150])
    body = {
        "model": "soak",
        "messages": [{"role": "user", "content": f"#{i} " + " ".join(rng.choice(WORDS) for _ in range(n_words))}],
        "max_tokens": rng.choice([1, 4, 16, 32]),
        "temperature": rng.choice([0, 0.7, 1.0]),
        "seed": i,
        "stream": rng.random() < 0.5,
    }
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(WORDS), "\n"]
    if rng.random() < 0.1:
        body["n"] = 2
    return body


async def one(session, url: str, body: dict, drop_after: float | None, stats: collections.Counter) -> None:
    import aiohttp

    async def go():
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            stats[f"http_{resp.status}"] += 1
            await resp.read()

    try:
        if drop_after is None:
            await go()
        else:
            await asyncio.wait_for(go(), drop_after)  # timeout closes the connection mid-flight
    except asyncio.TimeoutError:
        stats["disconnected"] += 1
    except aiohttp.ClientError as exc:
        stats[f"client_error_{type(exc).__name__}"] += 1


async def soak(url: str, requests: int, concurrency: int, disconnect: float, seed: int) -> dict:
    import aiohttp

    rng = random.Random(seed)
    stats: collections.Counter = collections.Counter()
    sem = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def guarded(i):
            body = make_body(rng, i)
            drop = rng.uniform(0.01, 0.5) if rng.random() < disconnect else None
            async with sem:
                await one(session, url, body, drop, stats)

        await asyncio.gather(*(guarded(i) for i in range(requests)))
        # the scheduler frees a cancelled request within a step; give it a moment
        health = {}
        for _ in range(100):
            async with session.get(url + "/health") as r:
                health = await r.json()
            if health["kv_blocks_used"] == health["kv_blocks_pinned"] and health["queue_depth"] == 0:
                break
            await asyncio.sleep(0.1)
    stats["seconds"] = round(time.perf_counter() - t0, 1)
    return {"stats": dict(stats), "health": health}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--disconnect", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", default=None)
    ap.add_argument("--model", default="smollm2-135m")
    ns = ap.parse_args()
    srv = None
    url = ns.url
    if url is None:
        from tests.serverproc import ServerProcess

        srv = ServerProcess(ns.model, "--kv-cache-tokens", "16384", log_path=Path("/tmp/imp-soak-server.log"))
        srv.wait_ready()
        url = srv.url
    try:
        import urllib.request

        baseline = json.loads(urllib.request.urlopen(url + "/health").read())
        res = asyncio.run(soak(url, ns.requests, ns.concurrency, ns.disconnect, ns.seed))
    finally:
        if srv:
            srv.stop()
    h, s = res["health"], res["stats"]
    five = sum(v for k, v in s.items() if k.startswith("http_5"))
    print(json.dumps(s, sort_keys=True))
    print("| requests | concurrency | disconnected | 2xx | 4xx | 5xx | seconds | KV used after | KV free / total (cached) | queue after |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ok2 = sum(v for k, v in s.items() if k.startswith("http_2"))
    ok4 = sum(v for k, v in s.items() if k.startswith("http_4"))
    print(f"| {ns.requests} | {ns.concurrency} | {s.get('disconnected', 0)} | {ok2} | {ok4} | {five} | {s['seconds']} "
          f"| {h['kv_blocks_used']} (baseline {baseline['kv_blocks_used']}) "
          f"| {h['kv_blocks_free']} / {h['kv_blocks_total']} ({h['kv_blocks_cached']}) | {h['queue_depth']} |")
    leaked = h["kv_blocks_used"] != baseline["kv_blocks_used"] or h["queue_depth"] != 0
    return 1 if five or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
