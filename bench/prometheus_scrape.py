"""Prometheus itself scraping a real imp server's /metrics.

    .venv/bin/python bench/prometheus_scrape.py [--model smollm2-135m] [--keep]

Installs Debian's `prometheus` when it is missing (apt-get, as root), starts
`python -m imp` on the default model and a Prometheus scraping it every
second, sends one chat request, then asks Prometheus's HTTP API whether the
target is up and which imp_* series it holds, and prints what it got. Exit 0
when the target is up, every name in EXPECTED is stored and
imp_requests_total has counted the request; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# every series the reference names (counters as Prometheus stores them: with _total)
EXPECTED = [
    "imp_model_loaded", "imp_requests_total", "imp_requests_timed_out_total", "imp_requests_cancelled_total",
    "imp_kv_pressure_rejections_total", "imp_kv_pool_growths_total", "imp_streaming_kv_auto_enables_total",
    "imp_prefix_cache_evictions_total", "imp_kv_swaps_total", "imp_endpoint_requests_total",
    "imp_request_duration_seconds_count", "imp_ttft_seconds_count", "imp_queue_time_seconds_count",
    "imp_inter_token_seconds_count", "imp_endpoint_request_duration_seconds_count",
    "imp_endpoint_ttft_seconds_count", "imp_endpoint_queue_time_seconds_count",
    "imp_endpoint_inter_token_seconds_count", "imp_queue_waiting", "imp_queue_running", "imp_queue_depth",
    "imp_queued_prompt_tokens", "imp_kv_blocks_reserved", "imp_decode_batch_last_rows",
    "imp_decode_batch_rows_total", "imp_decode_batch_steps_total", "imp_decode_batch_max",
    "imp_otlp_spans_exported_total", "imp_otlp_export_failures_total", "imp_otlp_unsampled_requests_total",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, body: dict | None = None, timeout: float = 10.0):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_for(what: str, check, timeout: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what}: process exited with {proc.returncode}")
        try:
            got = check()
            if got:
                return got
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what}: not ready within {timeout:.0f}s")


def ensure_prometheus() -> str:
    exe = shutil.which("prometheus")
    if exe:
        return exe
    if os.geteuid() != 0:
        raise SystemExit("prometheus is not installed and this is not root: apt-get install -y prometheus")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "prometheus"], check=True, env=env)
    return shutil.which("prometheus") or "/usr/bin/prometheus"


def query(prom: str, q: str) -> list:
    return get_json(f"{prom}/api/v1/query?{urllib.parse.urlencode({'query': q})}")["data"]["result"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model for the server (default: the server's default)")
    ap.add_argument("--keep", action="store_true", help="leave the temporary directory in place")
    args = ap.parse_args()
    exe = ensure_prometheus()
    port, prom_port = free_port(), free_port()
    work = Path(tempfile.mkdtemp(prefix="imp-prom-"))
    (work / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
        "scrape_configs:\n  - job_name: imp\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
    )
    server_cmd = [sys.executable, "-m", "imp", "--port", str(port)] + (["--model", args.model] if args.model else [])
    procs = []
    try:
        with open(work / "server.log", "wb") as slog, open(work / "prometheus.log", "wb") as plog:
            server = subprocess.Popen(server_cmd, cwd=ROOT, stdout=slog, stderr=subprocess.STDOUT)
            procs.append(server)
            prom = subprocess.Popen([exe, f"--config.file={work / 'prometheus.yml'}",
                                     f"--storage.tsdb.path={work / 'data'}",
                                     f"--web.listen-address=127.0.0.1:{prom_port}"],
                                    stdout=plog, stderr=subprocess.STDOUT)
            procs.append(prom)
            url, purl = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{prom_port}"
            t0 = time.monotonic()
            wait_for("imp server", lambda: get_json(url + "/health", timeout=2), 300, server)
            print(f"server up on :{port} after {time.monotonic() - t0:.1f}s ({' '.join(server_cmd[1:])})")
            reply = get_json(url + "/v1/chat/completions", {
                "model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hi."}]}, timeout=120)
            print(f"one chat request: {reply['usage']}")

            def target_up():
                ts = get_json(purl + "/api/v1/targets", timeout=2)["data"]["activeTargets"]
                return ts if ts and ts[0]["health"] == "up" else None

            targets = wait_for("prometheus target", target_up, 60, prom)
            t = targets[0]
            print(f"prometheus {exe}: target {t['scrapeUrl']} health={t['health']} "
                  f"lastScrape={t['lastScrape']} lastError={t['lastError']!r}")
            # wait for a scrape that saw the request
            wait_for("imp_requests_total >= 1", lambda: query(purl, "imp_requests_total >= 1"), 30, prom)
            names = {r["metric"]["__name__"] for r in query(purl, '{__name__=~"imp_.*"}')}
            print(f"imp_* series names stored by prometheus: {len(names)}")
            for q in ("up{job='imp'}", "imp_model_loaded", "imp_requests_total",
                      "imp_endpoint_requests_total{endpoint='chat_completions'}", "imp_kv_blocks_total",
                      "imp_ttft_seconds_count", "imp_decode_batch_steps_total", "imp_decode_batch_last_rows",
                      "imp_kv_swaps_total", "imp_otlp_spans_exported_total"):
                for r in query(purl, q):
                    labels = {k: v for k, v in r["metric"].items() if k not in ("job", "instance")}
                    print(f"  {q:60s} {labels} = {r['value'][1]}")
            missing = [n for n in EXPECTED if n not in names]
            ok = t["health"] == "up" and not missing
            print(f"expected names: {len(EXPECTED)}, missing: {missing or 'none'}")
            print("PASS" if ok else "FAIL")
            return 0 if ok else 1
    finally:
        for p in reversed(procs):  # only the processes started here, by their handles
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


if __name__ == "__main__":
    sys.exit(main())
