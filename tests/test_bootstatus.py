"""While a cold boot compiles, the port answers 503 'compiling' with progress (imp/bootstatus.py):
/health's body says how far it is, inference routes get a JSON error and a Retry-After, and the
port is free for the real server once it stops. The whole path (a server booted on an empty
Numba cache) is the slow test at the end."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import pytest

from imp.bootstatus import BootStatus, read_progress, serve_status
from tests.serverproc import ServerProcess, free_port


def _get(url, data=None):
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def test_the_port_answers_compiling_with_progress_then_frees_itself():
    port = free_port()
    status = BootStatus()
    rfd, wfd = os.pipe()
    reader = read_progress(rfd, status)
    stop = serve_status("127.0.0.1", port, status)
    try:
        os.write(wfd, b"block_dots\nforward_layers\n")
        time.sleep(0.2)
        code, headers, body = _get(f"http://127.0.0.1:{port}/health")
        assert code == 503 and body["status"] == "compiling" and body["model_loaded"] is False
        assert body["compiling"]["kernels_compiled"] == 2 and body["compiling"]["current"] == "forward_layers"
        assert body["error"]["type"] == "unavailable_error"  # llama-server's shape while it loads
        code, headers, body = _get(f"http://127.0.0.1:{port}/v1/chat/completions",
                                   json.dumps({"model": "m", "messages": []}).encode())
        assert code == 503 and headers["Retry-After"] == "5"
        assert body["error"]["code"] == "compiling" and "Compiling kernels" in body["error"]["message"]
    finally:
        os.close(wfd)
        reader.join(5)
        stop()
        stop()  # idempotent
    import socket

    with socket.socket() as s:  # the real server can bind it now
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_garbage_and_hang_ups_get_json_or_nothing_and_it_keeps_answering(capsys):
    import socket

    port = free_port()
    stop = serve_status("127.0.0.1", port, BootStatus())
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GARBAGE\r\n\r\n")
            got = s.recv(4096)
        # a line that is no HTTP/1.x request line is answered as HTTP/0.9 would be: the body alone
        body = got.partition(b"\r\n\r\n")[2] if got.startswith(b"HTTP/") else got
        assert json.loads(body)["error"]["type"] == "invalid_request_error"
        for _ in range(3):  # a body promised and never sent; a connection closed at once
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 99999\r\n\r\nabc")
            socket.create_connection(("127.0.0.1", port)).close()
        time.sleep(0.3)
        code, _, body = _get(f"http://127.0.0.1:{port}/health")
        assert code == 503 and body["status"] == "compiling"
    finally:
        stop()
    assert "Traceback" not in capsys.readouterr().err


def test_a_port_in_use_gives_no_responder():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert serve_status("127.0.0.1", s.getsockname()[1], BootStatus()) is None


@pytest.mark.slow
def test_a_cold_boot_says_compiling_on_health_until_it_serves(tmp_path):
    srv = ServerProcess("smollm2-135m", log_path=tmp_path / "server.log",
                        env={"NUMBA_CACHE_DIR": str(tmp_path / "numba")})
    seen = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert srv.proc.poll() is None, srv.tail()
            try:
                code, _, body = _get(srv.url + "/health")
            except (OSError, ValueError):
                time.sleep(0.3)
                continue
            seen.append((code, body.get("status"), (body.get("compiling") or {}).get("kernels_compiled")))
            if code == 200:
                break
            time.sleep(0.5)
        compiling = [s for s in seen if s[1] == "compiling"]
        assert compiling and all(c == 503 for c, _, _ in compiling), seen[:5]
        counts = [k for _, _, k in compiling]
        assert counts == sorted(counts) and counts[-1] > 0  # progress moves forward
        assert seen[-1][0] == 200 and seen[-1][1] == "ok"
        assert "compiled" in srv.tail()
    finally:
        srv.stop()
