"""Start the real server as a subprocess, the way a user does."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: str, *args: str, log_path: Path | None = None, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "imp", "--model", str(model), "--port", str(self.port), *args]
        if os.environ.get("IMP_TEST_API_SERVERS") and "--api-servers" not in args:
            # the whole e2e suite against the process layout: IMP_TEST_API_SERVERS=2 pytest ...
            cmd += ["--api-servers", os.environ["IMP_TEST_API_SERVERS"]]
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.log_path = log_path
        self.out = open(log_path, "wb") if log_path else subprocess.DEVNULL
        # cwd = the checkout: Python 3.11's stdlib `imp` must not shadow ours
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"server not ready in {timeout}s: {self.tail()}")

    @property
    def model_pid(self) -> int:
        """The process that holds the model: the engine process under --api-servers N
        (its pid is in the supervisor's "serving on" line), else the server itself."""
        import re

        text = self.log_path.read_bytes().decode(errors="replace") if self.log_path and self.log_path.exists() else ""
        m = re.search(r"engine pid (\d+)", text)
        return int(m.group(1)) if m else self.proc.pid

    def tail(self) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_bytes()[-3000:].decode(errors="replace")
        return ""

    def __enter__(self) -> "ServerProcess":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> int:
        try:
            return end(self.proc, 20)
        finally:
            if self.out is not subprocess.DEVNULL:
                self.out.close()


def end(proc: subprocess.Popen, grace: float = 10) -> int:
    """SIGTERM, `grace` seconds to exit, then SIGKILL: a child process gone, its exit code."""
    proc.terminate()
    try:
        return proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(5)


def call(url: str, path: str, body: dict | None = None, method: str | None = None,
         timeout: float = 120) -> tuple[int, dict]:
    """One JSON request to a running server: (status, decoded body), error statuses included."""
    req = urllib.request.Request(url + path, json.dumps(body).encode() if body is not None else None,
                                 {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream_completion(url: str, body: dict, timeout: float = 300) -> tuple[str, int, str | None]:
    """POST /v1/completions with stream (and the usage chunk): (text, completion tokens, last finish_reason)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    text, tokens, finish = "", 0, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
                for c in ev.get("choices") or []:
                    text += c.get("text") or ""
                    finish = c.get("finish_reason") or finish
    return text, tokens, finish
