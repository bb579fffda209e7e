"""Shutdown and faults through the real server (issue 13 §6).

SIGTERM under load: /ready says draining, new requests get 503 draining, every admitted
stream runs to its end, the process exits 0 and its event log replays. Fault injection
(IMP_FAULT_INJECT, read once at boot): a host-side step failure ends the requests of that
step with engine_step_failed and the engine serves on; a device fault ends every in-flight
request with engine_faulted, /health and /ready turn 503 engine_faulted, later requests are
500 engine_faulted at once, and nothing hangs.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.serverproc import ROOT, ServerProcess, call

pytestmark = pytest.mark.slow


def stream(url: str, body: dict, out: dict, first: threading.Event, timeout: float = 120) -> None:
    """One streaming chat request; out gets its status, events and whether it saw [DONE]."""
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    events, done = [], False
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out["status"] = r.status
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                events.append(json.loads(line[6:]))
                first.set()
    except urllib.error.HTTPError as e:
        out["status"] = e.code
        events.append(json.loads(e.read()))
    except Exception as e:  # noqa: BLE001 - the test reads what happened
        out["exc"] = repr(e)
    first.set()
    out["events"], out["done"] = events, done


def streams_started(url: str, body: dict, n: int, timeout: float = 120) -> tuple[list[dict], list[threading.Thread]]:
    """n streaming requests in threads, returned once each has its first event."""
    outs = [{} for _ in range(n)]
    firsts = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=stream, args=(url, body, o, f, timeout)) for o, f in zip(outs, firsts)]
    for t in threads:
        t.start()
    for f in firsts:
        assert f.wait(timeout)
    return outs, threads


CHAT = {"model": "m", "messages": [{"role": "user", "content": "Count from one to one hundred."}],
        "temperature": 0, "max_tokens": 48, "ignore_eos": True}


def test_sigterm_under_load_finishes_every_admitted_stream_and_exits_0(smollm2_path, tmp_path):
    log = tmp_path / "events.log"
    srv = ServerProcess(smollm2_path, "--kv-cache-tokens", "4096", "--event-log", str(log), "--shutdown-timeout",
                        "60", log_path=tmp_path / "server.out")
    with srv:
        outs, threads = streams_started(srv.url, CHAT, 4)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        st, ready = call(srv.url, "/ready")
        assert st == 503 and ready["code"] == "draining", ready
        st, health = call(srv.url, "/health")
        assert st == 200, health  # liveness: an orchestrator must not restart a draining server
        st, err = call(srv.url, "/v1/chat/completions", {**CHAT, "max_tokens": 2})
        assert st == 503 and err["error"]["code"] == "draining", err
        for t in threads:
            t.join(120)
        assert srv.proc.wait(60) == 0, srv.tail()
    for o in outs:
        assert o.get("status") == 200 and o["done"], o
        assert o["events"][-1]["choices"][0]["finish_reason"] == "length" or o["events"][-1].get("usage")
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in o["events"] if e.get("choices"))
        assert text, o
    assert "draining" in srv.tail()
    # the log was closed cleanly: it replays to the same decisions
    rep = subprocess.run([sys.executable, "-m", "imp", "replay", str(log)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert rep.returncode == 0, rep.stdout[-2000:] + rep.stderr[-2000:]


def test_a_host_step_failure_ends_its_requests_and_the_engine_serves_on(smollm2_path, tmp_path):
    with ServerProcess(smollm2_path, "--kv-cache-tokens", "2048", log_path=tmp_path / "server.out",
                       env={"IMP_FAULT_INJECT": "step@3"}) as srv:
        st, err = call(srv.url, "/v1/chat/completions", {**CHAT, "max_tokens": 8})
        assert st == 500 and err["error"]["code"] == "engine_step_failed", err
        assert "injected step failure" in err["error"]["message"]
        st, ok = call(srv.url, "/v1/chat/completions", {**CHAT, "max_tokens": 4})
        assert st == 200 and ok["usage"]["completion_tokens"] == 4, ok
        assert call(srv.url, "/health")[0] == 200 and call(srv.url, "/ready")[0] == 200
        st, metrics = 0, urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode()
        kv = [ln for ln in metrics.splitlines() if ln.startswith("imp_kv_blocks_used ")]
        assert kv and float(kv[0].split()[1]) == 0, kv  # the failed request's blocks came back
        assert "fault injection armed: step fault at step 3" in srv.tail()


def test_a_device_fault_ends_every_request_and_later_ones_fail_fast(smollm2_path, tmp_path):
    with ServerProcess(smollm2_path, "--kv-cache-tokens", "4096", log_path=tmp_path / "server.out",
                       env={"IMP_FAULT_INJECT": "device@6"}) as srv:
        outs = [{} for _ in range(3)]
        firsts = [threading.Event() for _ in outs]
        threads = [threading.Thread(target=stream, args=(srv.url, CHAT, o, f, 60)) for o, f in zip(outs, firsts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
            assert not t.is_alive(), "a stream hung after the device fault"
        for o in outs:
            assert not o["done"], o  # no [DONE]: the stream ends in an error event
            last = o["events"][-1]
            assert last.get("error", {}).get("code") == "engine_faulted", o
        t0 = time.monotonic()
        st, err = call(srv.url, "/v1/chat/completions", {**CHAT, "max_tokens": 2}, timeout=10)
        assert st == 500 and err["error"]["code"] == "engine_faulted" and time.monotonic() - t0 < 2, err
        st, err = call(srv.url, "/v1/messages", {"model": "m", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
        assert st == 500 and err["type"] == "error" and err["error"]["type"] == "api_error", err
        st, h = call(srv.url, "/health")
        assert st == 503 and h["code"] == "engine_faulted", h
        st, r = call(srv.url, "/ready")
        assert st == 503 and r["code"] == "engine_faulted", r
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0, srv.tail()


async def _balancer(url: str, proc: subprocess.Popen, workers: int = 8, check_s: float = 0.5) -> dict[str, int]:
    """What a load balancer does around a SIGTERM: requests on fresh connections (HAProxy's http-server-close)
    from `workers` clients until its check has seen /ready fail twice, then none. The outcome of each:
    an answer (its status), a refused connection (never sent: safe to resend) or a reset (sent, then the
    connection closed unanswered: what a balancer cannot resend). check_s 0.5 (HAProxy's default inter is 2 s):
    at 0.2 a slower 2-core box's in-flight chats outlasted the two failed checks, so no request met the drain."""
    import aiohttp

    seen: dict[str, int] = {}
    routing = True
    chat = {**CHAT, "max_tokens": 2}

    async def worker(i: int) -> None:
        n = 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                         timeout=aiohttp.ClientTimeout(total=60)) as s:
            while routing:
                n += 1
                try:
                    if n % 3 == 0:
                        r = await s.get(url + "/v1/models")
                    else:
                        r = await s.post(url + "/v1/chat/completions", json=chat)
                    await r.read()
                    key = str(r.status)
                except aiohttp.ClientConnectorError:
                    key = "refused"
                    await asyncio.sleep(0.01)
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    key = f"reset ({type(e).__name__})"
                seen[key] = seen.get(key, 0) + 1

    async def check() -> None:
        nonlocal routing
        fails = 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            while fails < 2:
                await asyncio.sleep(check_s)
                try:
                    async with s.get(url + "/ready") as r:
                        fails = 0 if r.status == 200 else fails + 1
                except aiohttp.ClientError:
                    fails += 1
        routing = False

    tasks = [asyncio.ensure_future(worker(i)) for i in range(workers)]
    while sum(seen.values()) < 24:
        await asyncio.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    await check()
    await asyncio.gather(*tasks)
    return seen


@pytest.mark.parametrize("layout", [(), ("--api-servers", "1")], ids=["one-process", "api-servers"])
def test_a_balancer_still_sending_at_sigterm_gets_answers_never_a_closed_connection(smollm2_path, tmp_path, layout):
    """After the drain the listener stays open, answering 503 draining, until requests stop coming
    (--shutdown-quiet): a request a balancer sent before its checks took the server out is answered,
    never dropped on a closed connection (HAProxy would close its client's connection without a word)."""
    with ServerProcess(smollm2_path, "--kv-cache-tokens", "4096", "--shutdown-timeout", "20", *layout,
                       log_path=tmp_path / "server.out") as srv:
        seen = asyncio.run(_balancer(srv.url, srv.proc))
        assert srv.proc.wait(30) == 0, srv.tail()
    print(f"\n{layout or 'one process'}: {seen}")
    assert seen.get("200", 0) >= 24 and seen.get("503", 0) > 0, seen
    assert not [k for k in seen if k.startswith("reset")], seen
