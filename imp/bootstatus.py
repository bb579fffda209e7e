"""While a cold boot compiles its kernels, the port answers: 503 "compiling", with progress.

Why: a fresh clone's first boot compiles the CPU kernels for tens of seconds (imp.precompile).
Before this the port was closed all that time, so a user's `curl /health` said "connection
refused" (is it dead?) and an orchestrator could not tell a compiling server from a crashed one.
Now the port is bound for the compile and every request gets a JSON 503 with a Retry-After —
llama-server answers its own model load the same way (503 "Loading model"), so scripts that
poll /health until 200 keep working — and /health's body says how far the compile is:

    {"status": "compiling", "code": "compiling", "model_loaded": false,
     "compiling": {"kernels_compiled": 14, "current": "forward_layers", "elapsed_s": 21.3},
     "error": {"code": 503, "message": "Compiling kernels ...", "type": "unavailable_error"}}

The compile child reports each kernel it finished on a pipe (`child_reporter`); a thread here
reads it. A plain stdlib HTTP server on a thread: the boot is synchronous and the real
(aiohttp) server binds the same port right after this one closes.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading
import time


class BootStatus:
    def __init__(self):
        self.started = time.monotonic()
        self.kernels = 0
        self.current = ""
        self._lock = threading.Lock()

    def compiled(self, name: str) -> None:
        with self._lock:
            self.kernels += 1
            self.current = name

    def body(self) -> dict:
        with self._lock:
            k, cur = self.kernels, self.current
        t = time.monotonic() - self.started
        msg = f"Compiling kernels for this CPU ({k} done, {t:.0f} s); retry shortly"
        return {"status": "compiling", "code": "compiling", "model_loaded": False, "pid": os.getpid(),
                "compiling": {"kernels_compiled": k, "current": cur, "elapsed_s": round(t, 1)},
                "error": {"code": 503, "message": msg, "type": "unavailable_error"}}


def _handler(status: BootStatus):
    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            body = status.body()
            if self.path.split("?")[0].rstrip("/") not in ("/health", "/healthz", "/ready", "/readyz"):
                body = {"error": {**body["error"], "code": "compiling", "type": "unavailable"}}
            data = json.dumps(body).encode()
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(min(length, 1 << 24))  # drain the body so the client sees the answer
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Retry-After", "5")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_POST = do_HEAD = do_DELETE = do_PUT = do_OPTIONS = _answer

        def send_error(self, code, message=None, explain=None) -> None:
            """A request the stdlib cannot parse: JSON in the same shape, not its HTML page."""
            data = json.dumps({"error": {"code": "bad_request", "message": message or "malformed request",
                                         "type": "invalid_request_error"}}).encode()
            self.send_response(code, message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD" and code >= 200 and code not in (204, 304):
                self.wfile.write(data)

        def log_message(self, *a) -> None:  # the boot's own progress lines say enough
            pass

    return H


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up mid-answer is no news during a boot (the stdlib prints a traceback)."""
        import sys

        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


def serve_status(host: str, port: int, status: BootStatus):
    """Answer on host:port from a thread; returns stop() (idempotent). None when the port
    cannot be bound (the real server will then say why, as before)."""
    try:
        srv = (_Server6 if ":" in host else _Server)((host, port), _handler(status))
    except OSError:
        return None
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2}, name="imp-boot-status",
                         daemon=True)
    t.start()
    done = []

    def stop() -> None:
        if not done:
            done.append(1)
            srv.shutdown()
            srv.server_close()
    return stop


def read_progress(fd: int, status: BootStatus) -> threading.Thread:
    """A thread that reads the child's kernel names, one a line, until the pipe closes."""
    def run() -> None:
        with os.fdopen(fd, "r", errors="replace") as f:
            for line in f:
                status.compiled(line.strip())
    t = threading.Thread(target=run, name="imp-compile-progress", daemon=True)
    t.start()
    return t


def child_reporter(fd: int) -> None:
    """In the compile child: write each finished compile's function name to fd."""
    from numba.core import event

    out = os.fdopen(fd, "w", buffering=1)

    class Report(event.Listener):
        def on_start(self, ev):
            pass

        def on_end(self, ev):
            d = ev.data.get("dispatcher") if ev.data else None
            try:
                out.write(f"{getattr(d, '__qualname__', 'kernel')}\n")
            except OSError:
                pass

    event.register("numba:compile", Report())
