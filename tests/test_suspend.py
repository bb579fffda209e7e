"""Suspend frees memory, through the real server (issue 13 §3).

POST /admin/suspend drains, then releases the weights and the KV pool: the server
process's RSS drops by at least the weights' resident size (the model file is mapped
and read whole by the first step; the pool's untouched pages were never resident, so
the drop is the file plus the KV pages a request wrote); /ready says suspended and requests
get 503 until POST /admin/resume reloads them, after which the same greedy request
gives the same text (the prefix cache was told its blocks are gone, so no stale KV
is reused). --idle-unload-seconds releases the model after N idle seconds and the
next request reloads it inside itself; /health carries idle_unload_seconds and
idle_suspended, /ready stays 200.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.serverproc import ROOT, ServerProcess, call

pytestmark = pytest.mark.slow
PAGE = os.sysconf("SC_PAGE_SIZE")
KV_TOKENS = 16384  # SmolLM2 fp16 KV: 2 * 30 layers * 3 heads * 64 * 2 B = 23 KB/token -> 360 MiB
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
        "temperature": 0, "max_tokens": 16}


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return r.read().decode()


def text(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def test_operator_suspend_releases_memory_and_resume_reloads(smollm2_path, tmp_path):
    log = tmp_path / "events.log"
    with ServerProcess(smollm2_path, "--kv-cache-tokens", str(KV_TOKENS), "--event-log", str(log),
                       log_path=tmp_path / "server.out") as srv:
        st, e = call(srv.url, "/v1/estimate", CHAT)  # before any traffic: the boot warm-up's prefill rate
        assert st == 200 and e["est_ttft_s"] > 0, e
        st, first = call(srv.url, "/v1/chat/completions", CHAT)
        assert st == 200
        before = rss(srv.model_pid)
        assert 'imp_model_loaded{model="SmolLM2-135M-Instruct.Q4_1"} 1.0' in metrics(srv.url)
        st, s = call(srv.url, "/admin/suspend?drain_s=10", {}, "POST")
        assert st == 200 and s["suspended"] and s["drained"] and s["kv_released"], s
        after = rss(srv.model_pid)
        print(f"\nRSS {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB after suspend "
              f"(server measured {s['memory']['rss_before'] / 2**20:.0f} -> {s['memory']['rss_after'] / 2**20:.0f})")
        assert before - after > 0.8 * smollm2_path.stat().st_size, (before, after)  # the weights left
        assert call(srv.url, "/ready")[1]["code"] == "suspended"
        t0 = time.monotonic()
        st, s2 = call(srv.url, "/admin/suspend?drain_s=10", {}, "POST")  # again: already released
        assert st == 200 and s2["kv_released"] and time.monotonic() - t0 < 5, s2
        assert 'imp_model_loaded{model="SmolLM2-135M-Instruct.Q4_1"} 0.0' in metrics(srv.url)
        st, h = call(srv.url, "/health")
        assert st == 200 and h["suspended"] and not h["weights_loaded"], h
        st, err = call(srv.url, "/v1/chat/completions", CHAT)
        assert st == 503 and err["error"]["code"] == "suspended"
        st, r = call(srv.url, "/admin/resume", {}, "POST")
        assert st == 200 and r["reloaded"] and not r["suspended"], r
        assert call(srv.url, "/ready")[0] == 200 and call(srv.url, "/health")[1]["weights_loaded"]
        st, again = call(srv.url, "/v1/chat/completions", CHAT)
        assert st == 200 and text(again) == text(first), (text(first), text(again))
        st, more = call(srv.url, "/v1/chat/completions", CHAT)  # now the prefix cache is warm again
        assert st == 200 and text(more) == text(first) and more["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert "[operator-unload] executor released the model" in srv.tail()
    # the suspend is on the log (KvForget, Unload, MemoryState) and replays to the same decisions
    rep = subprocess.run([sys.executable, "-m", "imp", "replay", str(log)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert rep.returncode == 0, rep.stdout[-2000:] + rep.stderr[-2000:]
    assert b"KvForget" in log.read_bytes()


def test_idle_unload_releases_and_the_next_request_reloads_inside_itself(smollm2_path, tmp_path):
    with ServerProcess(smollm2_path, "--kv-cache-tokens", str(KV_TOKENS), "--idle-unload-seconds", "2",
                       log_path=tmp_path / "server.out") as srv:
        st, first = call(srv.url, "/v1/chat/completions", CHAT)
        assert st == 200
        before = rss(srv.model_pid)
        deadline = time.monotonic() + 30
        while not call(srv.url, "/health")[1]["idle_suspended"]:
            assert time.monotonic() < deadline, "never idle-suspended"
            time.sleep(0.5)
        time.sleep(0.5)
        st, h = call(srv.url, "/health")
        assert h["idle_unload_seconds"] == 2 and h["idle_suspended"] and not h["weights_loaded"], h
        st, r = call(srv.url, "/ready")
        assert st == 200 and r["idle_suspended"] is True, r
        after = rss(srv.model_pid)
        print(f"\nRSS {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB after the idle unload")
        t0 = time.monotonic()
        st, s = call(srv.url, "/admin/suspend?drain_s=5", {}, "POST")  # an operator suspend on top of an idle one
        assert st == 200 and s["kv_released"] and time.monotonic() - t0 < 5, s
        assert call(srv.url, "/ready")[1]["code"] == "suspended"
        assert call(srv.url, "/admin/resume", {}, "POST")[1]["reloaded"]
        assert before - after > 0.8 * smollm2_path.stat().st_size, (before, after)
        t0 = time.monotonic()
        st, again = call(srv.url, "/v1/chat/completions", CHAT)
        woke = time.monotonic() - t0
        assert st == 200 and text(again) == text(first)
        st, h = call(srv.url, "/health")
        assert not h["idle_suspended"] and h["weights_loaded"], h
        print(f"the waking request took {woke:.2f}s (reload included)")
        assert "[idle-unload] executor released the model" in srv.tail()
