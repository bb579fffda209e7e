"""The process layout (--api-servers N, issue 14): an engine process, API-server processes.

Through the real server on SmolLM2: greedy output is the in-process server's, streams,
stop strings and n choices are rendered on the API side, a client that leaves frees its
KV, the store and admin calls cross, /metrics counts every API server's requests; the
engine process's event log replays identically. Lifecycle: SIGTERM drains all of them
and exits 0 with no process left; a killed engine fails every waiting request with
engine_faulted and /health turns 503 (no hang); a killed API server is started again;
a killed supervisor takes its children with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.serverproc import ROOT, ServerProcess, call
from tests.test_shutdown_faults import CHAT, stream, streams_started

pytestmark = pytest.mark.slow


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def kv_free(url: str) -> tuple[int, int]:
    st, h = call(url, "/health")
    return h["kv_blocks_free"], h["kv_blocks_total"]


def greedy(url: str, prompt: str, n_tokens: int = 12) -> str:
    st, r = call(url, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": prompt}],
                                               "temperature": 0, "max_tokens": n_tokens})
    assert st == 200, r
    return r["choices"][0]["message"]["content"]


PROMPTS = ["Say hi", "What is the capital of France?", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def split(smollm2_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("split")
    srv = ServerProcess(smollm2_path, "--api-servers", "2", "--kv-cache-tokens", "4096", "--event-log",
                        str(d / "events.log"), "--responses-store", str(d / "store.sqlite3"),
                        log_path=d / "server.out")
    srv.event_log = d / "events.log"
    with srv:
        yield srv


def test_greedy_output_and_streams_match_the_in_process_server(split, imp_server):
    for p in PROMPTS:
        assert greedy(split.url, p) == greedy(imp_server.url, p), p
    # streamed, with a stop string matched on the API side, and n = 2
    body = {"model": "m", "messages": [{"role": "user", "content": "Count from 1 to 9, separated by commas."}],
            "temperature": 0, "max_tokens": 40, "stop": ["5"], "stream": True}
    outs = {}
    for name, url in (("split", split.url), ("local", imp_server.url)):
        o = {}
        stream(url, body, o, threading.Event())
        assert o["status"] == 200 and o["done"], o
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in o["events"] if e.get("choices"))
        outs[name] = (text, o["events"][-1]["choices"][0]["finish_reason"])
    assert outs["split"] == outs["local"] and outs["split"][1] == "stop" and "5" not in outs["split"][0], outs
    st, r = call(split.url, "/v1/chat/completions", {**CHAT, "n": 2, "max_tokens": 6, "temperature": 0.9, "seed": 3})
    assert st == 200 and [c["index"] for c in r["choices"]] == [0, 1] and r["usage"]["completion_tokens"] == 12, r
    st, r = call(split.url, "/v1/messages", {"model": "m", "max_tokens": 8, "stop_sequences": ["!"],
                                             "messages": [{"role": "user", "content": "Say hi"}]})
    assert st == 200 and r["type"] == "message" and r["content"][0]["type"] == "text", r


def test_both_api_servers_serve_and_metrics_count_all_of_them(split):
    pids = set()
    for _ in range(40):  # one connection each: the kernel hands them to either process
        pids.add(call(split.url, "/health")[1]["pid"])
        if len(pids) == 2:
            break
    assert len(pids) == 2, pids
    before = _requests_total(split.url)
    threads = [threading.Thread(target=greedy, args=(split.url, "Say hi", 4)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # one registry, the engine's, whichever server answers; a request's stats reach it over the wire
    # after its reply has gone, so the count may trail the replies by a moment (it must not overshoot)
    deadline = time.monotonic() + 5
    while _requests_total(split.url) - before < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _requests_total(split.url) - before == 6
    assert kv_free(split.url)[0] == kv_free(split.url)[1]


def _requests_total(url: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("imp_endpoint_requests_total{") and "chat" in ln)


def test_a_client_that_leaves_frees_its_kv_and_bad_input_is_a_400(split):
    req = urllib.request.Request(split.url + "/v1/chat/completions",
                                 json.dumps({**CHAT, "max_tokens": 400, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    r = urllib.request.urlopen(req, timeout=60)
    r.readline()
    r.close()  # gone mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and kv_free(split.url)[0] != kv_free(split.url)[1]:
        time.sleep(0.1)
    free, total = kv_free(split.url)
    assert free == total, (free, total)
    st, err = call(split.url, "/v1/chat/completions", {"model": "m", "messages": "nope"})
    assert st == 400 and err["error"]["type"] == "invalid_request_error", err
    st, err = call(split.url, "/v1/messages", {"model": "m", "messages": [], "max_tokens": 0})
    assert st == 400 and err["type"] == "error", err
    assert call(split.url, "/health")[0] == 200


def test_store_admin_and_lora_listing_cross_the_boundary(split):
    st, r = call(split.url, "/v1/responses", {"model": "m", "input": "Say hi", "max_output_tokens": 4,
                                              "temperature": 0})
    assert st == 200 and r["status"] in ("completed", "incomplete"), r
    st, got = call(split.url, f"/v1/responses/{r['id']}")  # whichever API server answers: one store
    assert st == 200 and got["id"] == r["id"], got
    st, r2 = call(split.url, "/v1/responses", {"model": "m", "input": "Again", "max_output_tokens": 4,
                                               "previous_response_id": r["id"]})
    assert st == 200, r2
    st, s = call(split.url, "/admin/suspend", {})
    assert st == 200 and s["suspended"], s
    st, err = call(split.url, "/v1/chat/completions", {**CHAT, "max_tokens": 2})
    assert st == 503 and err["error"]["code"] == "suspended", err
    st, s = call(split.url, "/admin/resume", {})
    assert st == 200 and not s["suspended"], s
    assert greedy(split.url, "Say hi", 3)
    st, loras = call(split.url, "/admin/lora")
    assert st == 200 and loras["data"] == [], loras
    st, m = call(split.url, "/v1/metrics")
    assert st == 200 and m["server"]["status"]["fault"] is None and m["server"]["status"]["model"], m


def test_end_thinking_reaches_the_api_server_that_runs_the_request(split):
    body = {"model": "m", "messages": [{"role": "user", "content": "Explain gravity in detail."},
                                       {"role": "assistant", "content": "<think>"}],
            "max_tokens": 200, "temperature": 0, "ignore_eos": True, "continue_final_message": True}
    req = urllib.request.Request(split.url + "/v1/chat/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json", "X-Request-Id": "think-split-1"})
    r = urllib.request.urlopen(req, timeout=60)
    r.readline()
    answers, pids = [], set()
    for _ in range(6):  # fresh connections: some land on the other API server
        answers.append(call(split.url, "/v1/requests/think-split-1/end_thinking", {}))
        pids.add(call(split.url, "/health")[1]["pid"])
    rest = r.read().decode()
    assert [st for st, _ in answers] == [200] * 6, answers
    assert sum(a["ended"] for _, a in answers) == 1, answers  # once, whichever server was asked
    assert "reasoning_content" in rest and '"content":"' in rest, rest[-500:]
    assert call(split.url, "/v1/requests/think-split-1/end_thinking", {})[0] == 404


def test_sigterm_drains_every_process_exits_0_and_the_log_replays(split):
    sup = split.proc.pid
    kids = children(sup)
    assert len(kids) == 3, kids  # the engine and two API servers
    outs, threads = streams_started(split.url, CHAT, 3)
    split.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    st, ready = call(split.url, "/ready")
    assert st == 503 and ready["code"] == "draining", ready
    st, err = call(split.url, "/v1/chat/completions", {**CHAT, "max_tokens": 2})
    assert st == 503 and err["error"]["code"] == "draining", err
    for t in threads:
        t.join(120)
    assert split.proc.wait(60) == 0, split.tail()
    for o in outs:
        assert o.get("status") == 200 and o["done"], o
    assert wait_gone(kids, 10) == [], "orphan processes"
    rep = subprocess.run([sys.executable, "-m", "imp", "replay", str(split.event_log)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert rep.returncode == 0 and "identical" in rep.stdout, rep.stdout[-2000:] + rep.stderr[-2000:]


def test_a_killed_engine_fails_waiting_requests_and_health_turns_503(smollm2_path, tmp_path):
    with ServerProcess(smollm2_path, "--api-servers", "1", "--kv-cache-tokens", "2048",
                       log_path=tmp_path / "server.out") as srv:
        kids = children(srv.proc.pid)
        o, first = {}, threading.Event()
        t = threading.Thread(target=stream, args=(srv.url, {**CHAT, "max_tokens": 400}, o, first, 60))
        t.start()
        assert first.wait(60)
        assert srv.model_pid != srv.proc.pid
        os.kill(srv.model_pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "a stream hung after the engine died"
        assert not o["done"] and o["events"][-1].get("error", {}).get("code") == "engine_faulted", o
        st, h = call(srv.url, "/health")
        assert st == 503 and h["code"] == "engine_faulted", h
        t0 = time.monotonic()
        st, err = call(srv.url, "/v1/chat/completions", {**CHAT, "max_tokens": 2}, timeout=10)
        assert st == 500 and err["error"]["code"] == "engine_faulted" and time.monotonic() - t0 < 2, err
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.tail()
    assert wait_gone(kids, 10) == [], "orphan processes"


def test_a_killed_api_server_is_started_again(smollm2_path, tmp_path):
    with ServerProcess(smollm2_path, "--api-servers", "1", "--kv-cache-tokens", "2048",
                       log_path=tmp_path / "server.out") as srv:
        old = call(srv.url, "/health")[1]["pid"]
        o, first = {}, threading.Event()
        t = threading.Thread(target=stream, args=(srv.url, {**CHAT, "max_tokens": 400}, o, first, 60))
        t.start()
        assert first.wait(60)
        os.kill(old, signal.SIGKILL)  # mid-stream: the engine cancels what it had open
        t.join(30)
        deadline = time.monotonic() + 60
        new = None
        while time.monotonic() < deadline:
            try:
                st, h = call(srv.url, "/health", timeout=2)
                if st == 200 and h["pid"] != old:
                    new = h["pid"]
                    break
            except OSError:
                pass
            time.sleep(0.2)
        assert new, srv.tail()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and kv_free(srv.url)[0] != kv_free(srv.url)[1]:
            time.sleep(0.1)
        assert kv_free(srv.url)[0] == kv_free(srv.url)[1]  # the dead server's stream freed its KV
        assert greedy(srv.url, "Say hi", 3)
        assert "starting it again" in srv.tail()


def test_the_rate_limit_is_one_across_api_servers_and_a_killed_supervisor_leaves_no_orphans(smollm2_path,
                                                                                              tmp_path):
    srv = ServerProcess(smollm2_path, "--api-servers", "2", "--kv-cache-tokens", "2048", "--rate-limit", "3",
                        log_path=tmp_path / "server.out")
    with srv:
        kids = children(srv.proc.pid)
        assert len(kids) == 3, kids
        pids, codes = set(), []
        for _ in range(4):  # a new connection each: either API server may answer
            codes.append(call(srv.url, "/v1/models")[0])
            pids.add(call(srv.url, "/health")[1]["pid"])
        assert codes == [200, 200, 200, 429], (codes, pids)  # the buckets live in the engine
        srv.proc.kill()
        srv.proc.wait(10)
        assert wait_gone(kids, 40) == [], "orphan processes after the supervisor was killed"
