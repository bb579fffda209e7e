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

On a GPU (`--device cuda:0`): SmolLM2's shape (random weights, bench/write_synth.py) and two 8B-shaped BF16
files (the GPU forward runs llama only), a budget that holds SmolLM2 and one 8B, so every request that names
the other 8B swaps: the same two tables, the card's used memory (nvidia-smi) after each load and unload
beside what /v1/models says is resident, and llama-server (CUDA, `-ngl 999`) as the peer.

    python3 bench/models_swap.py --device cuda:0 --budget-gb 30 --kv-tokens 32768 --llama .../llama-server
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


T0 = time.perf_counter()


def note(*what) -> None:
    """Progress on stderr as it happens: a run cut short by its time limit still says how far it got."""
    print(f"[{time.perf_counter() - T0:.0f} s]", *what, file=sys.stderr, flush=True)


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


def card_used_gib() -> float | None:
    """The card's used memory as nvidia-smi sees it (every process's), None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return float(out.split()[0]) / 1024
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def llama_start_s(binary: str, model: str, threads: int, log: Path, gpu: bool = False) -> float:
    from tests.serverproc import free_port

    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-c", "4096",
                             "-t", str(threads), *(["-ngl", "999"] if gpu else [])], stdin=subprocess.DEVNULL,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
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


def cpu_files(models: Path) -> dict[str, str]:
    """SmolLM2 (the boot model), Gemma 3 270M and a synthetic Qwen3: copies, their pages this run's to drop."""
    from imp.fetch import resolve_model
    from tests.fixtures.synth import write_synthetic_gguf

    for name, key in (("SmolLM2", "smollm2-135m"), ("gemma3-270m", "gemma-3-270m")):
        shutil.copy(resolve_model(key, progress=False), models / f"{name}.gguf")
    write_synthetic_gguf(str(models / "qwen3-synth.gguf"), arch="qwen3", n_layers=12, d_model=1024,
                         n_heads=16, n_kv_heads=4, d_ff=2816, vocab=512, head_dim=64)
    return {n: str(models / f"{n}.gguf") for n in ("SmolLM2", "gemma3-270m", "qwen3-synth")}


def gpu_files(models: Path, source_8b: str | None) -> dict[str, str]:
    """SmolLM2's shape (the boot model) and two 8B-shaped BF16 files (random weights, bench/write_synth.py,
    or copies of --source-8b: two files, two inodes, each its own pages to drop; a copy is ~10 s, a write ~1 min)."""
    here = Path(__file__).resolve().parent
    todo = [("135m-q4_1", "smol")] + ([] if source_8b else [("8b-bf16", "llama8b-a")])
    for shape, name in todo:
        subprocess.run([sys.executable, str(here / "write_synth.py"), shape, str(models / f"{name}.gguf")], check=True,
                       stdout=subprocess.DEVNULL)
        note("wrote", name)
    for name in ("llama8b-b", "llama8b-a") if source_8b else ("llama8b-b",):
        shutil.copy(source_8b or models / "llama8b-a.gguf", models / f"{name}.gguf")
        note("copied", name)
    return {n: str(models / f"{n}.gguf") for n in ("smol", "llama8b-a", "llama8b-b")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/imp-models-swap")
    ap.add_argument("--budget-gb", type=float, default=0.75)
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--llama", default=None, help="llama-server binary (the peer's start-up time)")
    ap.add_argument("--llama-wait", type=float, default=0,
                    help="seconds to wait for --llama to appear (a build still running beside the bench)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--api-servers", type=int, default=0, help="the process layout (the fleet in the engine process)")
    ap.add_argument("--device", default="cpu", help="cuda:0: SmolLM2's shape and two 8B-shaped files on the card")
    ap.add_argument("--kv-tokens", type=int, default=4096, help="--kv-cache-tokens (each model's pool)")
    ap.add_argument("--source-8b", default=None, help="GPU: an 8B-shaped file written before, copied twice")
    a = ap.parse_args()
    gpu = a.device.startswith("cuda")
    d = Path(a.dir)
    shutil.rmtree(d, ignore_errors=True)
    (d / "models").mkdir(parents=True)
    files = gpu_files(d / "models", a.source_8b) if gpu else cpu_files(d / "models")
    boot, swapped = list(files)[0], list(files)[1:]
    log = d / "events.log"
    proc, url = start_imp(files[boot], a.api_servers, a.device, ["--models-dir", str(d / "models"), "--kv-cache-tokens",
                                                                 str(a.kv_tokens), "--models-memory", str(a.budget_gb),
                                                                 "--event-log", str(log), "--threads", str(a.threads)],
                          False, d / "server.log")
    rows = []
    note("serving", url)

    def resident() -> str:
        listing = json.load(urllib.request.urlopen(url + "/v1/models", timeout=30))["data"]
        return ", ".join(f"{m['id']} {m['resident_bytes'] / 2**30:.2f}" for m in listing if m.get("loaded"))

    try:
        rows.append((boot, "boot", "-", None, None, card_used_gib(), resident()))
        if gpu:  # a load on the card times its matmuls and captures its graphs again (~a minute for an 8B): fewer
            steps = [(swapped[0], "first load", True), (swapped[1], "first load", True), (swapped[0], "reload", True),
                     (swapped[1], "reload", False)]
        else:
            steps = [(name, kind, cold) for name in (*swapped, boot)
                     for kind, cold in ([("reload", True), ("reload", False)] if name == boot else
                                        [("first load", True), ("reload", True), ("reload", False)])]
        for name, kind, cold in steps:
            t0 = time.perf_counter()
            st, _ = post(url, "/admin/models/unload", {"model": name})  # 409 when it is not resident: fine
            if st == 200:
                rows.append((name, "unload", "-", time.perf_counter() - t0, None, card_used_gib(), resident()))
                note(*rows[-1])
            if cold:
                drop_cache(files[name])
            t0 = time.perf_counter()
            st, body = post(url, "/admin/models/load", {"model": name})
            load_s = time.perf_counter() - t0
            assert st == 200, body
            ttft = first_token_s(url, name)
            rows.append((name, kind, "cold" if cold else "warm", load_s, ttft, card_used_gib(), resident()))
            note(*rows[-1])
        peer = {}
        t_wait = time.monotonic() + a.llama_wait
        while a.llama and not os.access(a.llama, os.X_OK) and time.monotonic() < t_wait:
            time.sleep(5)
        if a.llama and not os.access(a.llama, os.X_OK):
            note("no llama-server at", a.llama, "after", a.llama_wait, "s: no peer")
            a.llama = None
        if a.llama:
            for name in (*swapped, boot):
                for cold in (True, False):
                    if cold:
                        drop_cache(files[name])
                    peer[(name, cold)] = llama_start_s(a.llama, files[name], a.threads, d / f"llama-{name}.log", gpu)
                    note("llama-server", name, cold, peer[(name, cold)])
        load = load_phase(url, files, a.seconds, a.clients)
        note("load phase", {k: v for k, v in load.items() if k != "errors"}, load["errors"][:3])
        metrics = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        listing = json.load(urllib.request.urlopen(url + "/v1/models", timeout=30))["data"]
    finally:
        _stop(proc)
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} {os.uname().nodename} cpu flags: "
          f"{' '.join(f for f in flags if f.startswith(('avx', 'amx')))}; budget {a.budget_gb} GB, {a.threads} threads, "
          f"--api-servers {a.api_servers}, device {a.device}, --kv-cache-tokens {a.kv_tokens}")
    print("\n| model | step | file | /admin/models/<step> s | first token after s | llama-server start s "
          "| card used GiB after | resident after (GiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, kind, fc, load_s, ttft, used, res in rows:
        p = peer.get((name, fc == "cold")) if fc != "-" else None
        print(f"| {name} | {kind} | {fc} | {f'{load_s:.2f}' if load_s is not None else '-'} | "
              f"{f'{ttft:.3f}' if ttft is not None else '-'} | {f'{p:.2f}' if p else '-'} | "
              f"{f'{used:.1f}' if used is not None else '-'} | {res} |")
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
