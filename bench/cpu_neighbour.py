"""CPU serving beside a neighbour: does a server keep its throughput when it shares the cores?

Issue 32's three cases, each measured through HTTP with the streaming client of
bench/cpu_serving.py (128 greedy ignore_eos tokens per stream, SmolLM2 unless --model):

  alone   one server, --streams streams (the reference)
  pair    two servers on the same cores, --streams/2 streams each, at the same time
  hog     one server, --streams streams, beside a CPU-bound process pinned to CPU 0
  beside  (--beside CMD) one server, --streams streams, while CMD runs (a test suite, a build)

Goals (issue 32): pair aggregate >= 0.9x alone; hog >= 0.4x alone.

    .venv/bin/python bench/cpu_neighbour.py [--model M] [--streams 8] \
        [--imp-env GOMP_SPINCOUNT=300000] [--variant=--fixed-threads] [--llama-server /tmp/llama-cpp/build/bin/llama-server]

--imp-env K=V (repeatable) sets an environment variable for the imp servers (to compare
wait policies in one run); --llama-server runs the same three cases on llama-server, same
GGUF, same threads, after imp's. Prints one table per server and the ratios, with the CPU's
flags (the box differs from session to session).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu_serving import llama_server, run_level  # noqa: E402

HOG = "import os; os.sched_setaffinity(0, {0})\nwhile True: pass"


def cpu_flags() -> str:
    want = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile", "amx_int8")
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "?"
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "?")
    return f"{model}, {os.cpu_count()} CPUs, flags: {' '.join(f for f in want if f in have)}"


async def _levels(urls: list[str], streams: int, tokens: int) -> list[dict]:
    return await asyncio.gather(*(run_level(u, streams, tokens) for u in urls))


BESIDE: list[str] = []  # --beside: a shell command to run next to one server (e.g. a test run)


def measure(start, streams: int, tokens: int) -> dict[str, float]:
    """start(n) -> list of (url, stop) for n servers. Returns aggregate tok/s per case."""
    out = {}
    servers = start(2)
    try:
        urls = [u for u, _ in servers]
        out["alone"] = asyncio.run(_levels(urls[:1], streams, tokens))[0]["agg_tok_s"]
        if BESIDE:
            nb = subprocess.Popen(BESIDE[0], shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
            try:
                time.sleep(3.0)
                out["beside"] = asyncio.run(_levels(urls[:1], streams, tokens))[0]["agg_tok_s"]
            finally:
                os.killpg(nb.pid, 9)
                nb.wait()
        hog = subprocess.Popen([sys.executable, "-c", HOG])
        try:
            time.sleep(1.0)
            out["hog"] = asyncio.run(_levels(urls[:1], streams, tokens))[0]["agg_tok_s"]
        finally:
            hog.kill()
            hog.wait()
        pair = asyncio.run(_levels(urls, streams // 2, tokens))
        out["pair"] = sum(r["agg_tok_s"] for r in pair)
        out["pair_each"] = " + ".join(f"{r['agg_tok_s']:.1f}" for r in pair)
    finally:
        for _, stop in servers:
            stop()
    return out


_RUNS = [0]


def imp_servers(model: str, threads: int, env: dict, extra: list[str]):
    from tests.serverproc import ServerProcess

    def start(n: int):
        _RUNS[0] += 1
        srvs = [ServerProcess(model, "--threads", str(threads), *extra, env=env,
                              log_path=Path(f"/tmp/imp-neighbour-{_RUNS[0]}-{i}.log")) for i in range(n)]
        for s in srvs:
            s.wait_ready(600)
        return [(s.url, s.stop) for s in srvs]
    return start


def llama_servers(binary: str, model: str, threads: int, slots: int):
    def start(n: int):
        procs = [llama_server(binary, model, threads, slots) for _ in range(n)]

        def stopper(p):
            def stop():
                p.terminate()
                p.wait(30)
            return stop
        return [(url, stopper(p)) for p, url in procs]
    return start


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--imp-env", action="append", default=[], help="K=V for the imp servers (repeat); "
                    "several runs: separate sets with ';' e.g. 'GOMP_SPINCOUNT=300000;'")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--variant", action="append", default=[],
                    help="extra imp flags for one more imp row (repeat), e.g. --variant=--fixed-threads")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--peer-model", default=None, help="the file llama-server serves (default --model; e.g. the "
                    "llama-quantize Q8_0 of a BF16 file beside --server-args '--weights q8_0')")
    ap.add_argument("--beside", default=None, help="a shell command run next to one server, measured too "
                    "(e.g. '.venv/bin/python -m pytest -q tests/test_dialects.py')")
    ns = ap.parse_args()
    if ns.beside:
        BESIDE.append(ns.beside)
    sets = [""] if not ns.imp_env else ns.imp_env
    rows = []
    for spec in sets:
        env = dict(kv.split("=", 1) for kv in spec.split(",") if kv)
        title = "imp" + (f" ({spec})" if spec else "")
        rows.append((title, measure(imp_servers(ns.model, ns.threads, env, ns.server_args.split()),
                                    ns.streams, ns.tokens)))
    for v in ns.variant:
        rows.append((f"imp {v}", measure(imp_servers(ns.model, ns.threads, {}, ns.server_args.split() + v.split()),
                                         ns.streams, ns.tokens)))
    if ns.llama_server:
        rows.append(("llama-server", measure(llama_servers(ns.llama_server, ns.peer_model or ns.model, ns.threads, ns.streams),
                                             ns.streams, ns.tokens)))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}  {cpu_flags()}")
    print(f"model {ns.model}, {ns.threads} threads per server, {ns.tokens} tokens a stream, "
          f"alone/hog {ns.streams} streams, pair {ns.streams // 2} + {ns.streams // 2}")
    extra = f" | beside `{ns.beside}` | beside / alone" if ns.beside else ""
    print("| server | alone tok/s | pair tok/s (each) | pair / alone | beside a 1-core hog | hog / alone" + extra + " |")
    print("|---|---|---|---|---|---|" + ("---|---|" if ns.beside else ""))
    for title, r in rows:
        more = f" | {r['beside']:.1f} | {r['beside'] / r['alone']:.2f}" if ns.beside else ""
        print(f"| {title} | {r['alone']:.1f} | {r['pair']:.1f} ({r['pair_each']}) | {r['pair'] / r['alone']:.2f} "
              f"| {r['hog']:.1f} | {r['hog'] / r['alone']:.2f}{more} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
