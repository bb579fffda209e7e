"""Server memory as a user sees it: RSS after one request, imp against llama-server, one run.

    PYTHONPATH=. .venv/bin/python bench/server_memory.py --model gemma-3-270m \
        --llama-server /tmp/llama-cpp/build/bin/llama-server [--rounds 2] [--api-servers 0,2]

Each server is started on the GGUF, sent one greedy 64-token chat request, and read from
/proc (VmRSS, RssAnon, RssFile of every process of its tree: imp's supervisor, engine and
API servers under --api-servers N). llama-server runs with the same threads and one slot
(`-np 1`). Prints a markdown table and issue 15's bound: 2x the file plus the KV the
request used (prompt + completion tokens, rounded up to imp's 16-token blocks, at the
model's fp16 KV bytes per token).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT = "Write a short poem about the sea, then explain its metaphors."


def status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) // 1024
    return out


def tree(pid: int) -> list[int]:
    kids = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(x) for x in f.read().split()]
    except OSError:
        pass
    return [pid] + [p for k in kids for p in tree(k)]


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        parts = f.read().split(b"\0")
    role = next((p.decode() for p in parts if p.startswith(b"role=")), "")
    return role or Path(parts[0].decode()).name


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready")


def request(url: str) -> dict:
    body = {"model": "bench", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 64,
            "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["usage"]


def measure(cmd: list[str], url: str, env: dict | None = None) -> tuple[list[tuple[str, dict]], dict]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    try:
        wait_ready(url, proc)
        usage = request(url)
        time.sleep(1.0)  # the request's bookkeeping settles (detokenizer, store write)
        return [(cmdline(p), status(p)) for p in tree(proc.pid)], usage
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def kv_bytes_per_token(path: str) -> int:
    from imp.formats.gguf_loader import open_gguf

    c = open_gguf(path).config
    head_dim = c.head_dim or c.d_model // c.n_heads
    return c.n_layers * 2 * c.n_kv_heads * head_dim * 2  # K and V, fp16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--api-servers", default="0", help="imp layouts to measure, e.g. 0,2")
    ap.add_argument("--port", type=int, default=18731)
    args = ap.parse_args()
    from imp.fetch import resolve_model

    path = str(resolve_model(args.model))
    size_mb = os.path.getsize(path) / 2**20
    url = f"http://127.0.0.1:{args.port}"
    root = Path(__file__).resolve().parent.parent
    rows = []
    for rnd in range(1, args.rounds + 1):
        for n in [int(x) for x in args.api_servers.split(",")]:
            cmd = [sys.executable, "-m", "imp", "--model", path, "--port", str(args.port), "--threads",
                   str(args.threads), "--responses-store", "off", "--api-servers", str(n)]
            procs, usage = measure(cmd, url, env=dict(os.environ, PYTHONPATH=str(root)))
            rows += [(rnd, f"imp --api-servers {n}", name, st, usage) for name, st in procs]
        if args.llama_server:
            cmd = [args.llama_server, "-m", path, "--port", str(args.port), "-t", str(args.threads), "-np", "1"]
            procs, usage = measure(cmd, url)
            rows += [(rnd, "llama-server", name, st, usage) for name, st in procs]
    per_token = kv_bytes_per_token(path)
    usage = rows[0][4]
    used = -(-(usage["prompt_tokens"] + usage["completion_tokens"]) // 16) * 16
    bound = 2 * size_mb + used * per_token / 2**20
    print(f"model: {Path(path).name} ({size_mb:.0f} MiB); request: {usage['prompt_tokens']} prompt + "
          f"{usage['completion_tokens']} completion tokens; bound 2 x file + KV used "
          f"({used} tokens x {per_token} B) = {bound:.0f} MiB\n")
    print("| round | server | process | RSS MiB | anonymous | file-backed |\n|---|---|---|---|---|---|")
    for rnd, server, name, st, _ in rows:
        print(f"| {rnd} | {server} | {name} | {st['VmRSS']} | {st['RssAnon']} | {st['RssFile']} |")


if __name__ == "__main__":
    main()
