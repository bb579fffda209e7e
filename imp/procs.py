"""The process layout (--api-servers N): one engine process, N API-server processes.

    python -m imp --api-servers 2        (this process: the supervisor)
      ├─ python -m imp _engine           the actors and the executors; owns the device,
      │                                   the event log and the Responses store
      ├─ python -m imp _api 0            HTTP, tokenization, chat templates, grammars,
      └─ python -m imp _api 1            detokenization and SSE; all accept on one socket

The supervisor reads nothing heavy: it binds the listening socket once (so a port
in use is one clear error), starts the engine, waits until it has loaded the model,
then starts the API servers, which inherit the socket and connect to the engine
over ZMQ (`imp.engine.host` <-> `imp.engine.remote`). Children get their config
on stdin and say "ready" on a pipe.

Lifecycle:
- a dead API server is started again (its open requests were cancelled by the engine);
- a dead engine: every API server fails its waiting requests with `engine_faulted`
  and answers /health 503 until the operator restarts the server;
- SIGTERM / SIGINT: the engine drains (new requests 503 `draining`, admitted ones run
  up to --shutdown-timeout, streamed out through the API servers), says Bye, and
  every process exits 0; a second signal cuts the drain;
- no orphans: children die with the supervisor (PR_SET_PDEATHSIG) and run in their
  own session, so a terminal's Ctrl-C reaches only the supervisor.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import msgspec

from imp.config import ServerConfig, api_servers

log = logging.getLogger("imp.procs")


def _progress(msg: str) -> None:
    print(f"imp: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- children


def _die_with_parent(sig: int, parent: int) -> None:
    """Linux: the kernel sends sig when the supervisor dies, however it dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _child_args(argv: list[str]) -> tuple[ServerConfig, dict]:
    args = dict(a.split("=", 1) for a in argv)
    cfg = msgspec.json.decode(sys.stdin.buffer.read(), type=ServerConfig)
    _die_with_parent(signal.SIGTERM if args["role"] == "engine" else signal.SIGKILL, int(args["parent"]))
    return cfg, args


def _ready(fd: int) -> None:
    os.write(fd, b"ready\n")
    os.close(fd)


def _run(coro) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:  # pragma: no cover
        asyncio.run(coro)


def engine_main(argv: list[str]) -> int:
    """`python -m imp _engine ...`: load the model, run the actors, serve the API servers."""
    from imp.fetch import FetchError
    from imp.formats.gguf_file import ModelFileError
    from imp.server import load_engine, open_responses_store, setup_logging
    from imp.settle import settle_after_boot
    from imp.store.sqlite import StoreOpenError

    cfg, args = _child_args(argv)
    setup_logging(cfg)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides; it sends SIGTERM
    try:
        store = open_responses_store(cfg)
    except (StoreOpenError, ValueError) as exc:
        _progress(f"cannot start: {exc}")
        return 2
    from imp.config import fleet_mode
    from imp.engine.catalog import CatalogError

    fleet = None
    try:
        if fleet_mode(cfg):  # models on demand: the fleet lives here, the API servers route by model
            from dataclasses import replace

            from imp.server import fleet_for

            engine, text = load_engine(replace(cfg, idle_unload_s=0.0), store)
            fleet = fleet_for(cfg, engine, text)
        else:
            engine, _text = load_engine(cfg, store)
    except (ModelFileError, FetchError, CatalogError) as exc:  # a wrong --model: one line, not a traceback
        _progress(f"cannot start: {exc}")
        return 2
    settle_after_boot()
    _run(_engine(cfg, engine, args["endpoint"], int(args["ready"]), fleet))
    return 0


async def _engine(cfg: ServerConfig, engine, endpoint: str, ready_fd: int, fleet=None) -> None:
    from imp.engine.host import EngineHost
    from imp.server import drain

    await engine.start()
    if fleet is not None:
        await fleet.start()
    rate_take = None
    if cfg.rate_limit:  # one set of buckets for every API server
        from imp.http.access import RateLimiter

        limiter = RateLimiter(cfg.rate_limit)
        rate_take = lambda caller: limiter.take(caller, time.monotonic())  # noqa: E731
    host = EngineHost(engine, endpoint, grammars=engine.grammars, rate_take=rate_take, fleet=fleet)
    await host.start()
    if cfg.agent_port:  # HAProxy's agent-check lives where the figures are: the engine (imp.http.agent)
        from imp.http.agent import engine_answer, start_agent

        await start_agent(cfg.host, cfg.agent_port, engine_answer(engine, fleet))
    signals: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, signals.put_nowait, signal.SIGTERM)
    _ready(ready_fd)
    await signals.get()
    _progress(f"engine: draining (up to {cfg.shutdown_timeout_s:g}s) ...")
    left = await drain(fleet or engine, signals, cfg.shutdown_timeout_s)
    if left:
        _progress(f"engine: {left} requests still running are cut")
    await asyncio.sleep(0.05)  # the last Items go out before the Bye
    host.bye()
    deadline = loop.time() + 10.0  # the API servers write their last bytes and exit
    while host.peers and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await host.stop()
    if fleet is not None:  # the other models' logs
        await fleet.stop()
    await engine.stop()  # the event log and the store are flushed and closed


def api_main(argv: list[str]) -> int:
    """`python -m imp _api ...`: one HTTP front end on the shared socket."""
    from imp.http.access import load_api_keys
    from imp.precompile import boot_warm
    from imp.server import cpu_boot, load_embedder, load_text, setup_logging
    from imp.settle import settle_after_boot

    cfg, args = _child_args(argv)
    setup_logging(cfg)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    api_keys = load_api_keys(cfg.api_key, cfg.api_key_file)
    (text, grammars), embedder = boot_warm(lambda: (load_text(cfg), load_embedder(cfg)), cfg, _progress,
                                           enabled=cpu_boot(cfg), part="text")
    settle_after_boot()
    sock = socket.socket(fileno=int(args["sock"]))
    _run(_api(cfg, text, grammars, api_keys, args["endpoint"], int(args["index"]), sock, int(args["ready"]),
              embedder))
    return 0


async def _api(cfg, text, grammars, api_keys, endpoint: str, index: int, sock, ready_fd: int,
               embedder=None) -> None:
    from aiohttp import web

    from imp.engine.remote import RemoteEngine
    from imp.http.app import create_app
    from imp.http.closing import close_when_quiet

    port = RemoteEngine(endpoint, text.tokenizer, api=index)
    await port.start()
    fleet = None
    if port.default_model:  # models on demand: route by model; each model's text side read here when named
        from dataclasses import replace

        from imp.engine.remote_fleet import RemoteFleet
        from imp.server import load_text

        fleet = RemoteFleet(port, lambda path: load_text(replace(cfg, model=path)), (port.card.path, text, grammars))
    app = create_app(port, text, cfg, grammars=grammars, api_keys=api_keys, rate=port.rate_take, embedder=embedder,
                     fleet=fleet)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=max(1.0, cfg.shutdown_timeout_s))
    await runner.setup()
    await web.SockSite(runner, sock).start()
    term = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, term.set)
    _ready(ready_fd)
    bye = asyncio.ensure_future(port.wait_bye())
    stop = asyncio.ensure_future(term.wait())
    await asyncio.wait((bye, stop), return_when=asyncio.FIRST_COMPLETED)
    if not bye.done():  # asked to stop without the engine: let this server's streams finish
        await port.drain(cfg.shutdown_timeout_s)
    elif not stop.done():  # the engine drained: the listener closes once the balancer has stopped sending
        # (bounded by the whole --shutdown-timeout from the Bye: this process never saw the signal's time;
        # the supervisor stops an API server 10 s after the engine has gone anyway)
        quiet = asyncio.ensure_future(close_when_quiet(app, cfg.shutdown_quiet_s, cfg.shutdown_timeout_s))
        await asyncio.wait((quiet, stop), return_when=asyncio.FIRST_COMPLETED)  # a SIGTERM here stops waiting
        quiet.cancel()
    bye.cancel()
    stop.cancel()
    await runner.cleanup()


# ---------------------------------------------------------------------- supervisor


class _Child:
    def __init__(self, role: str, cfg: ServerConfig, endpoint: str, extra: dict, pass_fds: tuple = ()):
        r, w = os.pipe()
        args = [f"role={role}", f"parent={os.getpid()}", f"endpoint={endpoint}", f"ready={w}",
                *(f"{k}={v}" for k, v in extra.items())]
        self.role = role
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "imp", "_" + role.split(":")[0], *args], stdin=subprocess.PIPE,
            pass_fds=(w, *pass_fds), start_new_session=True)
        os.close(w)
        self.proc.stdin.write(msgspec.json.encode(cfg))
        self.proc.stdin.close()
        self.ready_fd = r
        self.started = time.monotonic()

    def wait_ready(self) -> bool:
        """Blocks until the child says ready (True) or exits first (False)."""
        data = b""
        while True:
            chunk = os.read(self.ready_fd, 64)
            if not chunk:
                break
            data += chunk
        os.close(self.ready_fd)
        return data.startswith(b"ready")


class _Stop(Exception):
    pass


def supervise(cfg: ServerConfig) -> int:
    from imp.http.access import load_api_keys
    from imp.server import setup_logging

    setup_logging(cfg)
    n = api_servers(cfg, os.cpu_count() or 1)
    try:
        load_api_keys(cfg.api_key, cfg.api_key_file)  # a bad key file is one error here, not one per child
    except ValueError as exc:
        _progress(f"cannot start: {exc}")
        return 2
    tmp = tempfile.mkdtemp(prefix="imp-")
    endpoint = f"ipc://{tmp}/engine.sock"
    children: list[_Child] = []
    stopping = []

    def on_signal(sig, _frame):
        stopping.append(sig)
        if len(stopping) == 1 and not ready_flag:
            raise _Stop()

    ready_flag = False
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sock = None
    try:
        engine = _Child("engine", cfg, endpoint, {})
        children.append(engine)
        if not engine.wait_ready():
            code = engine.proc.wait()
            _progress(f"the engine process exited with {code} before it was ready")
            return code or 2
        try:
            sock = socket.create_server((cfg.host, cfg.port), reuse_port=False, backlog=1024)
        except OSError as exc:
            _progress(f"cannot listen on {cfg.host}:{cfg.port}: {exc}")
            return 2
        sock.set_inheritable(True)
        apis: list[_Child] = []
        for i in range(n):
            c = _Child(f"api:{i}", cfg, endpoint, {"index": i, "sock": sock.fileno()}, pass_fds=(sock.fileno(),))
            apis.append(c)
            children.append(c)
        for c in apis:
            if not c.wait_ready():
                _progress(f"API server {c.role} exited with {c.proc.wait()} before it was ready")
                return 2
        ready_flag = True
        _progress(f"serving on http://{cfg.host}:{cfg.port} (engine pid {engine.proc.pid}, "
                  f"{n} API server{'s' if n != 1 else ''}: {', '.join(str(c.proc.pid) for c in apis)})")
        return _watch(cfg, engine, apis, children, sock, endpoint, stopping)
    except _Stop:
        _progress("stopped while starting")
        return 0
    finally:
        for c in children:
            if c.proc.poll() is None:
                c.proc.terminate()
        for c in children:
            try:
                c.proc.wait(10)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        if sock is not None:
            sock.close()
        try:
            os.unlink(f"{tmp}/engine.sock")
            os.rmdir(tmp)
        except OSError:
            pass


def _watch(cfg, engine: _Child, apis: list[_Child], children: list, sock, endpoint: str, stopping: list) -> int:
    restarts: list[float] = []
    engine_dead = False
    signalled = 0
    running = lambda cs: [c for c in cs if c.proc.poll() is None]  # noqa: E731
    while True:
        time.sleep(0.1)
        if len(stopping) > signalled:  # SIGTERM / SIGINT: the engine drains, then says Bye
            signalled = len(stopping)
            if signalled == 1:
                _progress(f"{signal.Signals(stopping[0]).name}: draining (up to {cfg.shutdown_timeout_s:g}s) ...")
            for c in running([engine]) or running(apis):  # a second signal cuts the drain
                c.proc.send_signal(signal.SIGTERM)
        if not engine_dead and engine.proc.poll() is not None:
            engine_dead = True
            if not stopping:
                _progress(f"the engine process exited with {engine.proc.returncode}: requests fail with "
                          "engine_faulted and /health answers 503 until the server is restarted")
        if stopping and engine_dead:
            # drained and gone: the API servers have their Bye and exit; stop any that does not
            for wait_s, sig in ((10.0, None), (cfg.shutdown_timeout_s + 5, signal.SIGTERM)):
                for c in running(apis) if sig else ():
                    c.proc.send_signal(sig)
                deadline = time.monotonic() + wait_s
                while running(apis) and time.monotonic() < deadline:
                    time.sleep(0.05)
            _progress("shut down")
            return 0
        if stopping:
            # reap the API servers that exited on the engine's Bye: a zombie still answers kill(pid, 0), and the
            # engine waits (up to 10 s) until every API server it knows is gone: a SIGTERM took 11.5 s, now 2.3 s
            running(apis)
            continue
        for i, c in enumerate(apis):
            if c.proc.poll() is None:
                continue
            if engine_dead:  # nothing to connect to: it is not started again
                continue
            now = time.monotonic()
            restarts[:] = [t for t in restarts if now - t < 60] + [now]
            if len(restarts) > 5:
                _progress("API servers keep dying (6 restarts in a minute): shutting down")
                stopping.append(signal.SIGTERM)
                break
            _progress(f"API server {i} (pid {c.proc.pid}) exited with {c.proc.returncode}: starting it again")
            nc = _Child(f"api:{i}", cfg, endpoint, {"index": i, "sock": sock.fileno()}, pass_fds=(sock.fileno(),))
            children.append(nc)
            apis[i] = nc
            if not nc.wait_ready():
                _progress(f"API server {i} did not start again (exit {nc.proc.wait()})")
        if engine_dead and not running(apis):
            _progress("no API server left and the engine is gone: exiting")
            return 1
