"""Models on demand, through HTTP: swap latency and requests served while models swap.

Three models in one --models-dir (SmolLM2, Gemma 3 270M and a synthetic Qwen3 written here), a
--models-memory that holds two of them. Two tables:

1. Swap latency per model: POST /admin/models/load of a model that is not resident, its file cold (pages
   dropped from the page cache with posix_fadvise DONTNEED) or warm, first load (its engine built) and
   reload (its released weights loaded again); the first streamed token of a request right after.
   The peer: llama-server started on the same file (what llama-swap does for a swap: a process started,
   the model loaded), timed to its first /health 200, cold and warm alike.
2. Load: C streaming clients (the openai and anthropic SDKs, alternately) for --seconds, each request naming
   one of the three models at random: requests, failures, streams cut, swaps, and per-model request counts
   from /metrics against the clients' own. Then SIGTERM and `python -m imp replay` of every model's log.

    .venv/bin/python bench/models_swap.py --llama /tmp/llama-cpp-native/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serving import _stop, start_imp, wait_ready  # noqa: E402


def drop_cache(path: str) -> None:
    """The file's pages out of the page cache (clean pages: no root needed)."""
    fd = os.open(os.path.realpath(path), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def post(url: str, path: str, body: dict, timeout: float = 600) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def first_token_s(url: str, model: str) -> float:
    body = {"model": model, "prompt": "The sea is", "max_tokens": 4, "temperature": 0, "stream": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def llama_start_s(binary: str, model: str, threads: int, log: Path) -> float:
    from tests.serverproc import free_port

    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "4096",
                             "-t", str(threads)], stdin=subprocess.DEVNULL, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, "llama-server")
        return time.perf_counter() - t0
    finally:
        _stop(proc)


def load_phase(url: str, models: dict[str, str], seconds: float, clients: int) -> dict:
    import anthropic
    import openai

    names = list(models)
    sent = {n: 0 for n in names}
    out = {"requests": 0, "failed": 0, "cut": 0, "errors": []}
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(i: int) -> None:
        rng = random.Random(i)
        oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=600)
        k = 0
        while time.monotonic() < stop_at:
            m, k = rng.choice(names), k + 1
            try:
                if (i + k) % 2:
                    n, finish = 0, None
                    for ch in oa.chat.completions.create(model=m, messages=[{"role": "user", "content": "Tell a story."}],
                                                         max_tokens=24, stream=True, temperature=0,
                                                         stream_options={"include_usage": True}):
                        if ch.usage:
                            n = ch.usage.completion_tokens
                        if ch.choices and ch.choices[0].finish_reason:
                            finish = ch.choices[0].finish_reason
                    ok = finish in ("length", "stop") and n > 0
                else:
                    with an.messages.stream(model=m, max_tokens=24, extra_body={"temperature": 0},
                                            messages=[{"role": "user", "content": "Tell a story."}]) as s:
                        final = s.get_final_message()
                    ok = final.stop_reason in ("max_tokens", "end_turn") and final.usage.output_tokens > 0
                with lock:
                    out["requests"] += 1
                    sent[m] += 1
                    out["cut"] += not ok
            except Exception as exc:  # noqa: BLE001 - counted and shown
                with lock:
                    out["failed"] += 1
                    out["errors"].append(f"{type(exc).__name__}: {str(exc)[:160]}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["sent"] = sent
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/imp-models-swap")
    ap.add_argument("--budget-gb", type=float, default=0.75)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--llama", default=None, help="llama-server binary (the peer's start-up time)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--api-servers", type=int, default=0, help="the process layout (the fleet in the engine process)")
    a = ap.parse_args()
    from imp.fetch import resolve_model
    from tests.fixtures.synth import write_synthetic_gguf

    d = Path(a.dir)
    shutil.rmtree(d, ignore_errors=True)
    (d / "models").mkdir(parents=True)
    models = {"SmolLM2": str(resolve_model("smollm2-135m", progress=False)),
              "gemma3-270m": str(resolve_model("gemma-3-270m", progress=False))}
    for name, path in models.items():
        shutil.copy(path, d / "models" / f"{name}.gguf")  # copies: their pages are this run's to drop
    write_synthetic_gguf(str(d / "models" / "qwen3-synth.gguf"), arch="qwen3", n_layers=12, d_model=1024,
                         n_heads=16, n_kv_heads=4, d_ff=2816, vocab=512, head_dim=64)
    files = {n: str(d / "models" / f"{n}.gguf") for n in ("SmolLM2", "gemma3-270m", "qwen3-synth")}
    log = d / "events.log"
    proc, url = start_imp(files["SmolLM2"], a.api_servers, "cpu", ["--models-dir", str(d / "models"), "--kv-cache-tokens", "4096",
                                                       "--models-memory", str(a.budget_gb), "--event-log", str(log),
                                                       "--threads", str(a.threads)], False, d / "server.log")
    rows = []
    try:
        for name in ("gemma3-270m", "qwen3-synth", "SmolLM2"):
            plan = ([("reload", True), ("reload", False)] if name == "SmolLM2" else
                    [("first load", True), ("reload", True), ("reload", False)])
            for kind, cold in plan:
                post(url, "/admin/models/unload", {"model": name})  # 409 when it is not resident: fine
                if cold:
                    drop_cache(files[name])
                t0 = time.perf_counter()
                st, body = post(url, "/admin/models/load", {"model": name})
                load_s = time.perf_counter() - t0
                assert st == 200, body
                rows.append((name, kind, "cold" if cold else "warm", load_s, first_token_s(url, name)))
        peer = {}
        if a.llama:
            for name in ("gemma3-270m", "SmolLM2", "qwen3-synth"):
                for cold in (True, False):
                    if cold:
                        drop_cache(files[name])
                    peer[(name, cold)] = llama_start_s(a.llama, files[name], a.threads, d / f"llama-{name}.log")
        load = load_phase(url, files, a.seconds, a.clients)
        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        listing = json.load(urllib.request.urlopen(url + "/v1/models", timeout=30))["data"]
    finally:
        _stop(proc)
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {os.uname().nodename} cpu flags: "
          f"{' '.join(f for f in flags if f.startswith(('avx', 'amx')))}; budget {a.budget_gb} GB, {a.threads} threads, "
          f"--api-servers {a.api_servers}")
    print("\n| model | load | file | /admin/models/load s | first token after s | llama-server start s |")
    print("|---|---|---|---|---|---|")
    for name, kind, fc, load_s, ttft in rows:
        p = peer.get((name, fc == "cold"))
        print(f"| {name} | {kind} | {fc} | {load_s:.2f} | {ttft:.3f} | {f'{p:.2f}' if p else '-'} |")
    swaps = {}
    for line in metrics.splitlines():
        if line.startswith("imp_model_swaps_total{") or line.startswith("imp_requests_total{"):
            swaps[line.split(" ")[0]] = float(line.split(" ")[1])
    print(f"\n| clients | seconds | requests | failed | cut | per model sent (client) / counted (metrics) | loads |")
    print("|---|---|---|---|---|---|---|")
    def got(key: str) -> float:
        return swaps.get(key, 0.0)

    per = ", ".join(f"{n} {load['sent'][n]} / {got('imp_requests_total{model=' + chr(34) + n + chr(34) + '}'):.0f}"
                    for n in files)
    loads = ", ".join(
        f"{n} {got('imp_model_swaps_total{direction=' + chr(34) + 'in' + chr(34) + ',model=' + chr(34) + n + chr(34) + '}'):.0f}"
        for n in files)
    print(f"| {a.clients} | {a.seconds:.0f} | {load['requests']} | {load['failed']} | {load['cut']} | {per} | {loads} |")
    for e in load["errors"][:5]:
        print("  error:", e)
    print("\nresident at the end:", {m["id"]: m.get("resident_bytes") for m in listing if m.get("loaded")})
    for p in sorted(d.glob("events*.log")):
        r = subprocess.run([sys.executable, "-m", "imp", "replay", str(p)], capture_output=True, text=True)
        print(f"replay {p.name}: rc {r.returncode} {r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ''}"
              f"{r.stderr.strip()[-200:] if r.returncode else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
