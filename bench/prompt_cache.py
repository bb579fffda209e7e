"""The prefix cache's disk tier (--prompt-cache-dir) where agents feel it: Claude Code's captured first request
(tests/data/claude_code_request.json, its ~20k-token system prompt and tool list) sent to a fresh server
(cold), again to the same server (the pool holds it), then to a *restarted* server on the same directory
(the disk tier holds it). TTFT through HTTP with a streaming client; the answers compared token for token.
Then the tier's own write and read rates on this disk against dd's.

    .venv/bin/python bench/prompt_cache.py --model gemma-3-270m
    python3 bench/prompt_cache.py --model /tmp/8b.gguf --device cuda:0 --prompt-tokens 20000 --drop-caches

--prompt-tokens N: a completions request whose prompt is N token ids (a model with a toy tokenizer, as the
GPU's random-weight 8B shape, makes ~4x more tokens of Claude Code's text than its context holds). Served
with streaming either way; --drop-caches empties the OS page cache before the restart (root: the files
come from the disk, not from memory). --null-kv-bytes N: the null runner (no model math) with tier blocks of
N bytes: the restart's host side alone, on a machine without the GPU (2097152 is the 8B shape's block).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.serving import wait_ready  # noqa: E402


def ttft(url: str, body: dict) -> tuple[float, str, dict]:
    """(seconds to the first content delta, the whole text, usage) of a streamed Messages request."""
    req = urllib.request.Request(url + "/v1/messages", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01"})
    t0, first, text, usage = time.perf_counter(), None, [], {}
    with urllib.request.urlopen(req, timeout=1200) as r:
        for line in r:
            if not line.startswith(b"data: "):
                continue
            ev = json.loads(line[6:])
            if ev.get("type") == "content_block_delta":
                first = first or time.perf_counter()
                d = ev["delta"]
                text.append(d.get("text") or d.get("partial_json") or "")
            elif ev.get("type") == "message_start":
                usage.update(ev["message"].get("usage", {}))
            elif ev.get("type") == "message_delta":
                usage.update(ev.get("usage", {}))
    return (first or time.perf_counter()) - t0, "".join(text), usage


def ttft_ids(url: str, ids: list[int], max_tokens: int) -> tuple[float, str, dict]:
    """The same for a streamed completions request of token ids (usage in the Messages names)."""
    body = {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0, first, text, usage = time.perf_counter(), None, [], {}
    with urllib.request.urlopen(req, timeout=1200) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            ev = json.loads(line[6:])
            for c in ev.get("choices", ()):
                if c.get("text"):
                    first = first or time.perf_counter()
                    text.append(c["text"])
            u = ev.get("usage")
            if u:
                usage = {"input_tokens": u["prompt_tokens"],
                         "cache_read_input_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}
    return (first or time.perf_counter()) - t0, "".join(text), usage


def server(model: str, port: int, cache: str, ctx: int, log: Path, device: str = "cpu", extra=(), env=None):
    cmd = [sys.executable, "-m", "imp", "--model", model, "--port", str(port), "--prompt-cache-dir", cache,
           "--kv-cache-tokens", str(ctx), "--device", device, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=None if env is None else {**os.environ, **env})


def dd_rates(d: Path) -> tuple[float, float]:
    f = d / "dd.bin"
    w = subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=1M", "count=512", "conv=fdatasync"],
                       capture_output=True, text=True).stderr
    r = subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=1M"], capture_output=True, text=True).stderr
    f.unlink()

    def rate(s: str) -> float:
        last = s.strip().splitlines()[-1]  # "... copied, 0.5 s, 1.1 GB/s"
        n, unit = last.split(",")[-1].split()
        return float(n) * {"GB/s": 1.0, "MB/s": 1e-3, "kB/s": 1e-6, "GiB/s": 1.074, "MiB/s": 1.049e-3}[unit]

    return rate(w), rate(r)


def tier_rates(d: Path, block_bytes: int, n: int = 2000) -> tuple[float, float]:
    from imp.actors.kvtier import KvTier

    t = KvTier(d, "f" * 64, "bench")
    payload = os.urandom(block_bytes)
    keys = [os.urandom(32) for _ in range(n)]
    t0 = time.perf_counter()
    for k in keys:
        t.save(k, payload)
    os.sync()
    w = n * block_bytes / (time.perf_counter() - t0) / 1e9
    buf = bytearray(block_bytes)  # into one buffer, as the executor reads into its staging (a fresh 2 MB each
    t0 = time.perf_counter()      # read was 512 page faults: 0.8 GB/s where the page cache gives 6)
    for k in keys:
        assert t.load(k, block_bytes, into=buf) is not None
    r = n * block_bytes / (time.perf_counter() - t0) / 1e9
    return w, r


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--keep", action="store_true", help="keep the cache directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--server-args", default="", help="more imp flags, one string")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="a prompt of N token ids instead of Claude Code's")
    ap.add_argument("--drop-caches", action="store_true", help="empty the OS page cache before the restart")
    ap.add_argument("--null-kv-bytes", type=int, default=0,
                    help="no model math (IMP_NULL_RUNNER): tiers with blocks of N bytes, the restart's host side alone")
    a = ap.parse_args()
    env = {"IMP_NULL_RUNNER": "1", "IMP_NULL_KV_BYTES": str(a.null_kv_bytes)} if a.null_kv_bytes else None
    cap = json.loads((ROOT / "tests/data/claude_code_request.json").read_text())
    body = dict(cap["body"], model="m", max_tokens=a.max_tokens, temperature=0)
    body.pop("stream", None)
    flags = subprocess.run("lscpu | grep -o 'avx512[a-z_]*\\|avx2\\|amx[a-z_]*' | sort -u | tr '\\n' ' '",
                           shell=True, capture_output=True, text=True).stdout.strip()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="imp-pc-"))
    cache, url = str(work / "cache"), "http://127.0.0.1:8197"
    print(f"model {a.model}, commit {commit}, {os.cpu_count()} CPUs, flags {flags}; cache {cache}")
    rows = []
    import random

    ids = [random.Random(0).randrange(300, 30000) for _ in range(a.prompt_tokens)]
    for run in ((1, 2, 3) if a.drop_caches else (1, 2)):  # 3: restarted again, the files in the page cache
        if run == 2 and a.drop_caches:
            os.sync()
            try:
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
                print("page cache dropped before the restart")
            except OSError as exc:
                print(f"page cache not dropped ({exc}): the restart may read the files from memory")
        p = server(a.model, 8197, cache, a.ctx, work / f"server{run}.log", a.device, a.server_args.split(), env)
        try:
            wait_ready(url, p, "imp")
            first = {1: "cold (empty pool, empty tier)", 2: "after a restart: from the disk tier" + (
                " (page cache dropped)" if a.drop_caches else ""), 3: "after a restart: the files in the page cache"}
            for what in (first[run], "again on the same server (the pool)"):
                s, text, usage = ttft_ids(url, ids, a.max_tokens) if ids else ttft(url, body)
                rows.append((what, s, usage.get("input_tokens", 0), usage.get("cache_read_input_tokens", 0), text))
        finally:
            p.terminate()
            p.wait(60)
        for line in (work / f"server{run}.log").read_text(errors="replace").splitlines():
            if "[tier] " in line:  # the executor's line per burst of loads: where a restart's read time went
                print(f"server {run}: {line.split(': ', 1)[-1]}")
    cold = rows[0][1]
    print("\n| request | TTFT s | vs cold | prompt tokens | cache_read_input_tokens | same text as cold |")
    print("|---|---|---|---|---|---|")
    for what, s, n, hit, text in rows:
        print(f"| {what} | {s:.2f} | {s / cold:.3f} | {n} | {hit} | {text == rows[0][4]} |")
    files = list((work / "cache").rglob("*.kv"))
    size = sum(f.stat().st_size for f in files)
    block = files[0].stat().st_size if files else 0
    print(f"\ntier: {len(files)} files, {size / 1e6:.1f} MB ({block} bytes a block)")
    dw, dr = dd_rates(work)
    tw, tr = tier_rates(work / "rates", block or 300_000)
    print("\n| disk | write GB/s | read GB/s |")
    print("|---|---|---|")
    print(f"| dd, 1 MiB blocks (write fdatasync; read from the page cache) | {dw:.2f} | {dr:.2f} |")
    print(f"| the tier's files (KvTier.save / load: header, digest) | {tw:.2f} | {tr:.2f} |")
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
