"""Two imp backends behind HAProxy, started from deploy/haproxy.cfg on loopback (issue 38).

The lane: Debian's haproxy (PATH, $IMP_HAPROXY, or fetched user-locally by
deploy/get-haproxy.sh, which this module runs when neither has one; skipped with the
reason when none can be had) in front of two real servers on SmolLM2, each pinned to a
core of its own with one forward thread, so that neither starves the other:

- affinity: a 10-turn conversation with X-Session-Id lands on one backend and finds every
  earlier turn in its prefix cache; the same conversation without the header is balanced
  by leastconn and its turns' cache hits are what that gives (printed);
- throughput through the proxy is at least 0.9x the sum of the two backends measured alone;
- 200 mixed requests (chat, completions, Messages; streamed and not) with a rolling restart
  (SIGTERM, drain, boot, ready; then the other) in the middle: none fails;
- /admin/suspend on one backend drains it through the checks: new requests go to the other;
- SIGKILL of one backend under load fails exactly the requests it was running, each with a
  clean error (a JSON 502, or a stream cut short that the client sees at once), the proxy
  marks it down within a check interval and new requests succeed;
- a backend in the process layout (--api-servers 1) whose engine process is SIGKILLed (what the
  kernel's OOM killer picks: the process with the model): its API server, still alive, ends each
  running stream with the dialect's error event (engine_faulted) and answers the whole ones
  with a JSON 500; /ready says so and the proxy marks it down within two checks, after which
  new requests go to the other backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.serverproc import ROOT, call, end, free_port

pytestmark = [pytest.mark.slow, pytest.mark.haproxy]
aiohttp = pytest.importorskip("aiohttp")

CFG = ROOT / "deploy" / "haproxy.cfg"
MAX_TOKENS = 16


def haproxy_binary() -> str | None:
    """$IMP_HAPROXY, haproxy on PATH, else what deploy/get-haproxy.sh fetches into the cache."""
    env = os.environ.get("IMP_HAPROXY")
    if env:
        return env if os.access(env, os.X_OK) else None
    found = shutil.which("haproxy")
    if found:
        return found
    try:
        out = subprocess.run(["sh", str(ROOT / "deploy" / "get-haproxy.sh")], capture_output=True, text=True,
                             timeout=120).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out or None


class Backend:
    """One imp server on a fixed port (a restart comes back on it), pinned to one core."""

    def __init__(self, model: Path, name: str, core: int | None, log_dir: Path):
        self.model, self.name, self.core = model, name, core
        self.port, self.agent_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.boots = 0
        self.proc: subprocess.Popen | None = None
        self.extra: list[str] = []  # e.g. the process layout: ["--api-servers", "1"]

    def start(self) -> None:
        self.boots += 1
        out = open(self.log_dir / f"{self.name}.{self.boots}.out", "wb")
        core = self.core
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "imp", "--model", str(self.model), "--port", str(self.port),
             "--agent-port", str(self.agent_port), "--threads", "1", "--fixed-threads",
             "--kv-cache-tokens", "8192", "--shutdown-timeout", "20", "--responses-store", "off", *self.extra],
            cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=out, stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.sched_setaffinity(0, {core})) if core is not None else None)
        out.close()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"{self.name} exited: {self.tail()}"
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready in {timeout}s: {self.tail()}")

    def engine_pid(self) -> int:
        """The engine process of the process layout (the supervisor's "engine pid N" line)."""
        import re

        m = re.search(r"engine pid (\d+)", self.tail(100_000))
        assert m, self.tail()
        return int(m.group(1))

    def tail(self, n: int = 2000) -> str:
        p = self.log_dir / f"{self.name}.{self.boots}.out"
        return p.read_bytes()[-n:].decode(errors="replace") if p.exists() else ""

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)


class Proxy:
    """haproxy -f deploy/haproxy.cfg with the two backends, and its admin socket."""

    def __init__(self, binary: str, backends: list[Backend], log_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sock = str(log_dir / "haproxy.sock")
        env = dict(os.environ, IMP_LB_BIND=f"127.0.0.1:{self.port}", IMP_LB_STATS=self.sock)
        for i, b in enumerate(backends, 1):
            env[f"IMP{i}"] = f"127.0.0.1:{b.port}"
            env[f"IMP{i}_AGENT"] = str(b.agent_port)
        self.log = log_dir / "haproxy.out"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([binary, "-f", str(CFG)], env=env, stdout=out, stderr=subprocess.STDOUT)

    def admin(self, cmd: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(self.sock)
            s.sendall(cmd.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def servers(self, backend: str = "imp_load") -> dict[str, dict]:
        """`show servers state`: name -> op state (2 up, 0 down), admin state (drain: bit 0x08), weight."""
        lines = self.admin(f"show servers state {backend}").splitlines()
        head = lines[1].lstrip("# ").split()
        rows = [dict(zip(head, ln.split())) for ln in lines[2:] if ln.strip()]
        return {r["srv_name"]: {"up": r["srv_op_state"] == "2", "admin": int(r["srv_admin_state"]),
                                "weight": int(r["srv_uweight"])} for r in rows}

    def wait_up(self, names: set[str], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                states = [self.servers(b) for b in ("imp_load", "imp_sessions")]
                if all(s[n]["up"] and not s[n]["admin"] for s in states for n in names):
                    return
            except (OSError, IndexError, KeyError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"haproxy never saw {names} up: {self.servers()}\n{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        end(self.proc)


@pytest.fixture(scope="module")
def lb(smollm2_path, tmp_path_factory):
    binary = haproxy_binary()
    if not binary and os.environ.get("IMP_HAPROXY"):
        pytest.skip(f"$IMP_HAPROXY={os.environ['IMP_HAPROXY']} is not an executable haproxy")
    if not binary:
        pytest.skip("haproxy not found: not on PATH, no $IMP_HAPROXY, and deploy/get-haproxy.sh could not fetch "
                    "Debian's package (apt-get download + dpkg -x)")
    d = tmp_path_factory.mktemp("lb")
    cores = sorted(os.sched_getaffinity(0))
    backends = [Backend(smollm2_path, f"imp{i}", cores[(i - 1) % len(cores)] if len(cores) > 1 else None, d)
                for i in (1, 2)]
    with serving(binary, backends, d) as proxy:
        yield proxy, backends


@contextlib.contextmanager
def serving(binary: str, backends: list, d: Path):
    """The backends booted and ready and the proxy up on both (bench/haproxy_threads.py too); all stopped after."""
    for b in backends:
        b.start()
    proxy = None
    try:
        for b in backends:
            b.wait_ready()
        proxy = Proxy(binary, backends, d)
        proxy.wait_up({"imp1", "imp2"})
        yield proxy
    finally:
        if proxy:
            proxy.stop()
        for b in backends:
            b.stop(signal.SIGKILL)


# --------------------------------------------------------------------------- the client


def _body(kind: str, i: int, stream: bool, max_tokens: int = MAX_TOKENS) -> tuple[str, dict]:
    text = f"Write a line about the number {i}."
    if kind == "chat":
        return "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": text}],
                                        "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}
    if kind == "completions":
        return "/v1/completions", {"model": "m", "prompt": text, "max_tokens": max_tokens, "stream": stream,
                                   "ignore_eos": True}
    return "/v1/messages", {"model": "m", "messages": [{"role": "user", "content": text}],
                            "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}


class Outcome:
    def __init__(self):
        self.ok = False
        self.status = 0
        self.error = ""
        self.backend = ""
        self.tokens = 0
        self.ended_at = 0.0


async def request(session, url: str, kind: str, i: int, stream: bool, max_tokens: int = MAX_TOKENS,
                  started: asyncio.Event | None = None) -> Outcome:
    """One request; ok only when it ran to its end (a stream: its closing event)."""
    path, body = _body(kind, i, stream, max_tokens)
    o = Outcome()
    try:
        async with session.post(url + path, json=body) as r:
            o.status, o.backend = r.status, r.headers.get("X-Served-By", "")
            if started is not None:
                started.set()
            if r.status != 200:
                o.error = (await r.text())[:300]
                return o
            if not stream:
                data = await r.json()
                o.tokens = data["usage"].get("completion_tokens", data["usage"].get("output_tokens", 0))
                o.ok = True
                return o
            end = b"event: message_stop" if kind == "messages" else b"data: [DONE]"
            seen = b""
            async for line in r.content:
                seen = line if line.strip() else seen
                if line.startswith(b"data: {") and b'"error"' in line[:40]:
                    o.error = line.decode(errors="replace")[:300]
                if line.startswith(end):
                    o.ok = not o.error
                o.tokens += line.startswith(b"data: {")
            if not o.ok and not o.error:
                o.error = f"stream ended without {end.decode()} (last: {seen[:80]!r})"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        o.error = f"{type(exc).__name__}: {exc}"
    finally:
        o.ended_at = time.monotonic()
    return o


async def throughput(url: str, width: int, n: int, max_tokens: int = 48) -> float:
    """Completion tokens a second for n non-streamed chat requests, width at a time."""
    sem = asyncio.Semaphore(width)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def one(i):
            async with sem:
                o = await request(s, url, "chat", i, False, max_tokens)
                assert o.ok, (o.status, o.error)
                return o.tokens
        t0 = time.perf_counter()
        toks = sum(await asyncio.gather(*(one(i) for i in range(n))))
        return toks / (time.perf_counter() - t0)


# --------------------------------------------------------------------------- the lane


def _turn(url: str, messages: list[dict], session: str | None) -> tuple[dict, str]:
    req = urllib.request.Request(url + "/v1/chat/completions",
                                 json.dumps({"model": "m", "messages": messages, "max_tokens": 12,
                                             "temperature": 0}).encode(),
                                 {"Content-Type": "application/json", **({"X-Session-Id": session} if session else {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read()), r.headers.get("X-Served-By", "")


def _conversation(url: str, topic: str, session: str | None) -> list[tuple[int, int, str]]:
    """Ten turns; per turn (prompt tokens, cached tokens, backend)."""
    messages, rows = [{"role": "system", "content": f"You talk about {topic}."}], []
    for k in range(10):
        messages.append({"role": "user", "content": f"Tell me fact {k + 1} about {topic}."})
        body, backend = _turn(url, messages, session)
        u = body["usage"]
        rows.append((u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], backend))
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return rows


def test_session_header_keeps_a_conversation_on_its_cache(lb):
    proxy, backends = lb
    sticky = _conversation(proxy.url, "owls", "conv-owls")
    loose = _conversation(proxy.url, "rivers", None)
    print("\nwith X-Session-Id (prompt, cached, backend):", sticky)
    print("without it:                                 ", loose)
    assert len({b for _, _, b in sticky}) == 1, (sticky, proxy.log.read_text()[-1500:])  # every turn on one backend
    for (p_prev, _, _), (p, cached, _) in zip(sticky, sticky[1:]):
        # the earlier turn's prompt is a prefix of this one: its full blocks are all hits
        assert cached > 0 and cached >= p_prev // 16 * 16, sticky
    misses = sum(c < pp // 16 * 16 for (pp, _, _), (_, c, _) in zip(loose, loose[1:]))
    print(f"without the header: {len({b for *_, b in loose})} backends, "
          f"{misses} of 9 later turns missed their earlier turn's cache")
    # closing the session (no header: the proxy takes the id from the path) reaches the backend with its pin
    home = next(b for b in backends if b.name == sticky[0][2])
    pinned = lambda: json.loads(urllib.request.urlopen(home.url + "/health").read())["kv_blocks_pinned"]  # noqa: E731
    assert pinned() > 0
    req = urllib.request.Request(proxy.url + "/v1/sessions/conv-owls/close", b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["X-Served-By"] == home.name and json.loads(r.read())["closed"]
    deadline = time.monotonic() + 5
    while pinned() and time.monotonic() < deadline:  # the close reaches the scheduler as a message
        time.sleep(0.05)
    assert pinned() == 0


def test_throughput_through_the_proxy_is_the_sum_of_the_backends(lb):
    """Each backend alone, then both through the proxy; two rounds, the better ratio counts (a
    neighbour on a shared 2-core box takes a round now and then)."""
    proxy, backends = lb
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two backends need a core each for their sum to be reachable; this process has one")
    asyncio.run(throughput(proxy.url, 8, 8))  # warm both
    seen, rounds = [], []

    async def watched():
        t = asyncio.ensure_future(throughput(proxy.url, 8, 32))
        while not t.done():
            seen.append(proxy.servers())
            await asyncio.sleep(0.25)
        return await t

    for _ in range(2):
        alone = [asyncio.run(throughput(b.url, 4, 16)) for b in backends]
        both = asyncio.run(watched())
        rounds.append((both / sum(alone), alone, both))
        print(f"\nalone {alone[0]:.1f} + {alone[1]:.1f} tok/s; through haproxy {both:.1f} tok/s: "
              f"{both / sum(alone):.2f}x")
        if rounds[-1][0] >= 0.95:
            break
    weights = sorted({s["weight"] for view in seen for s in view.values()})
    print(f"agent weights seen {weights} in {len(seen)} samples")
    # >= 0.75: one backend taking it all reads 0.5; the rest of the gap is the other make-test worker on a
    # 2-core box (0.87 / 0.67 on a 2-vCPU EPYC beside it; the ratio itself: bench/haproxy_threads.py)
    assert max(r[0] for r in rounds) >= 0.75, rounds
    # load moves weights, never a backend out of rotation (what /health?ready=1 as the check did)
    assert all(s["up"] and not s["admin"] for view in seen for s in view.values()), seen
    assert weights and min(weights) >= 10


def test_rolling_restart_loses_nothing(lb):
    proxy, backends = lb

    def roll():
        for b in backends:
            t0 = time.monotonic()
            assert b.stop(signal.SIGTERM) == 0, b.tail()
            b.start()
            b.wait_ready()
            proxy.wait_up({b.name})
            print(f"{b.name}: restarted and back in rotation in {time.monotonic() - t0:.1f}s")

    async def load():
        kinds = ("chat", "completions", "messages")
        sem = asyncio.Semaphore(6)
        done = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            async def one(i):
                nonlocal done
                async with sem:
                    o = await request(s, proxy.url, kinds[i % 3], i, stream=i % 2 == 0)
                done += 1
                return o

            tasks = [asyncio.ensure_future(one(i)) for i in range(200)]
            while done < 40:
                await asyncio.sleep(0.05)
            t0 = time.monotonic()
            await asyncio.to_thread(roll)
            print(f"rolling restart took {time.monotonic() - t0:.1f}s, {done} of 200 done when it ended")
            return await asyncio.gather(*tasks)

    out = asyncio.run(load())
    failed = [(o.status, o.backend, o.error) for o in out if not o.ok]
    print(f"\n200 mixed requests across a rolling restart: {len(failed)} failed; served by "
          f"{ {b: sum(o.backend == b for o in out) for b in ('imp1', 'imp2')} }")
    assert not failed, failed[:5]


def test_suspend_drains_a_backend_through_the_checks(lb):
    proxy, (b1, b2) = lb
    st, body = call(b1.url, "/admin/suspend?drain_s=10", {}, "POST")
    assert st == 200 and body["suspended"], body
    try:
        t0 = time.monotonic()
        while proxy.servers()["imp1"]["up"] and time.monotonic() - t0 < 5:
            time.sleep(0.1)
        s = proxy.servers()
        print(f"\nsuspend: imp1 out of rotation after {time.monotonic() - t0:.1f}s ({s})")
        assert not s["imp1"]["up"]
        served = [_turn(proxy.url, [{"role": "user", "content": f"Hi {i}"}], None)[1] for i in range(4)]
        assert served == ["imp2"] * 4
    finally:
        call(b1.url, "/admin/resume", {}, "POST")
    proxy.wait_up({"imp1"})


async def kill_under_load(proxy, backends, kill, kinds: list[str], base: int, after_down: bool, wait_s: float):
    """Long requests on both backends (6 streams of `kinds` in turn and 4 whole answers, 200 tokens: every one still
    running at the kill), then kill() the first backend (or a process of it); 6 new requests right after, or
    once the proxy has marked it down. (the queue_running of each at the kill, the kill's time, seconds until
    marked down or None, the streams', the whole answers' and the new requests' Outcomes)."""
    b1, b2 = backends
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        starts = [asyncio.Event() for _ in range(6)]
        streams = [asyncio.ensure_future(request(s, proxy.url, kinds[i % len(kinds)], base + i, True, 200, starts[i]))
                   for i in range(6)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in starts)), 60)
        plain = [asyncio.ensure_future(request(s, proxy.url, "completions", base + 100 + i, False, 200))
                 for i in range(4)]
        await asyncio.sleep(1.0)
        running = {b.name: json.loads(urllib.request.urlopen(b.url + "/health").read())["queue_running"]
                   for b in (b1, b2)}
        kill()
        killed = time.monotonic()

        def new_requests():
            return [asyncio.ensure_future(request(s, proxy.url, "chat", base + 200 + i, i % 2 == 0)) for i in range(6)]

        after = [] if after_down else new_requests()
        down_at = None
        while time.monotonic() - killed < wait_s:
            if not proxy.servers()["imp1"]["up"]:
                down_at = time.monotonic() - killed
                break
            await asyncio.sleep(0.05)
        if after_down:
            after = new_requests()
        return running, killed, down_at, await asyncio.gather(*streams), await asyncio.gather(*plain), \
            await asyncio.gather(*after)


def show(what: str, running, killed, down_at, streams, plain, after) -> list:
    """kill_under_load's outcomes printed; the streams that ran on the victim."""
    on_victim = [o for o in streams if o.backend == "imp1"]
    print(f"\nrunning at {what}: {running}; streams on imp1: {len(on_victim)} of 6; marked down after {down_at}s")
    for o in streams:
        print(f"  stream on {o.backend}: ok={o.ok} after {o.ended_at - killed:+.2f}s {o.error[:110]}")
    for o in plain:
        print(f"  whole answer on {o.backend}: status {o.status} ok={o.ok} {o.error[:120]}")
    print(f"  after the kill: {[(o.status, o.backend) for o in after]}")
    return on_victim


def test_sigkill_fails_only_the_requests_it_was_running(lb):
    proxy, (b1, b2) = lb

    def kill():
        b1.proc.send_signal(signal.SIGKILL)
        b1.proc.wait()

    running, killed, down_at, streams, plain, after = asyncio.run(
        kill_under_load(proxy, (b1, b2), kill, ["chat"], 0, after_down=False, wait_s=5))
    on_victim = show("the kill", running, killed, down_at, streams, plain, after)
    assert down_at is not None and down_at <= 1.0 + 0.2, down_at
    # streams: exactly those imp1 was running fail, at once and with an error the client sees
    assert [o.ok for o in streams] == [o.backend != "imp1" for o in streams]
    for o in on_victim:
        assert o.error and o.ended_at - killed < 3, o.error
        assert o.tokens > 5, o.tokens  # SSE passed through as it came: chunks arrived long before the end
    # whole answers: imp1's running ones get the proxy's JSON 502, the others their answer
    victim_plain = running["imp1"] - len(on_victim)
    bad = [o for o in plain if not o.ok]
    assert len(bad) == victim_plain, (running, [(o.status, o.error) for o in plain])
    for o in bad:
        assert o.status == 502 and json.loads(o.error)["error"]["code"] == "backend_failed", o.error
    # and whatever comes after the kill is served by the survivor
    assert all(o.ok and o.backend == "imp2" for o in after), [(o.status, o.backend, o.error) for o in after]


def test_sigkill_of_the_engine_process_ends_its_streams_with_an_error_event(lb):
    """The process layout's engine killed: the API server writes each stream's last event itself."""
    proxy, (b1, b2) = lb
    b1.stop(signal.SIGKILL)  # the test before killed it (or left it up)
    b1.extra = ["--api-servers", "1"]
    b1.start()
    b1.wait_ready()
    proxy.wait_up({"imp1"})

    try:
        running, killed, down_at, streams, plain, after = asyncio.run(kill_under_load(
            proxy, (b1, b2), lambda: os.kill(b1.engine_pid(), signal.SIGKILL), ["chat", "messages", "completions"],
            300, after_down=True, wait_s=6))
        ready = urllib.request.Request(b1.url + "/ready")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(ready, timeout=5)
        assert e.value.code == 503 and json.loads(e.value.read())["code"] == "engine_faulted"
    finally:
        b1.stop(signal.SIGKILL)
        b1.extra = []
    on_victim = show("the engine's kill", running, killed, down_at, streams, plain, after)
    assert down_at is not None and down_at <= 2 * 1.0 + 0.5, down_at  # fall 2 x inter 1s of /ready (or the agent)
    assert [o.ok for o in streams] == [o.backend != "imp1" for o in streams]
    for o in on_victim:  # the dialect's own error event, at once: never a cut connection, never a hang
        assert "engine fault" in o.error and o.ended_at - killed < 3, o.error
        assert o.tokens > 5, o.tokens
    victim_plain = running["imp1"] - len(on_victim)
    bad = [o for o in plain if not o.ok]
    assert len(bad) == victim_plain, (running, [(o.status, o.error) for o in plain])
    for o in bad:
        assert o.status == 500 and json.loads(o.error)["error"]["code"] == "engine_faulted", o.error
    assert all(o.ok and o.backend == "imp2" for o in after), [(o.status, o.backend, o.error) for o in after]
