"""Prefix cache: time to first token for a long prompt, cold and on a cache hit.

    .venv/bin/python bench/prefix_cache.py [--model PATH] [--words 900] [--repeats 3]

Each repeat uses a fresh prompt (a new opening word, so no earlier block matches),
sends it once (cold: the whole prompt is prefilled) and then again with a different
question at the end (warm: every full block of the shared prefix comes from the cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def ttft(url: str, messages: list[dict]) -> tuple[float, int, int]:
    body = json.dumps({"model": "bench", "messages": messages, "max_tokens": 1, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, usage = None, {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])
            if c.get("usage"):
                usage = c["usage"]
            elif first is None and c["choices"] and "content" in c["choices"][0]["delta"] and c["choices"][0]["delta"]["content"]:
                first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - t0, usage.get("prompt_tokens", 0), usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--words", type=int, default=900)
    ap.add_argument("--repeats", type=int, default=3)
    ns = ap.parse_args()
    from tests.serverproc import ServerProcess

    srv = ServerProcess(ns.model, "--kv-cache-tokens", "16384", log_path=Path("/tmp/imp-prefix-bench.log"))
    rows = []
    try:
        srv.wait_ready()
        for i in range(ns.repeats):
            doc = f"Document {i}. " + " ".join(f"w{(i * 7919 + k) % 1000}" for k in range(ns.words))
            cold = ttft(srv.url, [{"role": "system", "content": doc}, {"role": "user", "content": "Summarise."}])
            warm = ttft(srv.url, [{"role": "system", "content": doc}, {"role": "user", "content": "List names."}])
            rows.append((cold, warm))
    finally:
        srv.stop()
    print(f"\nTTFT, {ns.model}, prompt of ~{ns.words} words, {ns.repeats} fresh prompts")
    print("| run | prompt tokens | cold TTFT (ms) | cached tokens | warm TTFT (ms) | speed-up |")
    print("|---|---|---|---|---|---|")
    for i, ((tc, pc, _), (tw, pw, cw)) in enumerate(rows):
        print(f"| {i} | {pc} | {1000 * tc:.0f} | {cw} | {1000 * tw:.0f} | {tc / tw:.1f}x |")
    med = statistics.median(tc / tw for (tc, _, _), (tw, _, _) in rows)
    print(f"median speed-up: {med:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
