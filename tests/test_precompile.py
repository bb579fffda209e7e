"""imp/precompile.py: a boot on a cold Numba cache compiles in a child, so the server keeps
none of the compiler's memory (issue 15's memory goal on a fresh clone's first `make serve`)."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import numpy as np
import pytest
from numba import njit

from imp import precompile
from imp.config import ServerConfig


def _fresh_kernel():
    @njit  # a new dispatcher: its first call compiles (no disk cache)
    def twice(x):
        return x * 2

    return twice


def test_a_compile_at_boot_goes_to_a_child_then_the_steps_run_again(monkeypatch):
    calls, children, notes = [], [], []
    twice = _fresh_kernel()

    def steps():
        calls.append(1)
        return int(twice(np.int64(21)))

    def run(argv, input=None):
        children.append((argv, json.loads(input)))
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(precompile.subprocess, "run", run)
    cfg = ServerConfig(model="some.gguf")
    assert precompile.boot_warm(steps, cfg, notes.append) == 42
    assert len(calls) == 2  # stopped at the first compile, then again after the child
    (argv, sent), = children
    assert argv[1:] == ["-m", "imp", "_precompile", "engine"] and sent["model"] == "some.gguf"
    assert "compiling them in a child process" in notes[0] and "twice" in notes[0]


def test_a_warm_boot_spawns_nothing_and_a_failed_child_falls_back(monkeypatch):
    twice = _fresh_kernel()
    twice(np.int64(1))  # compiled: nothing left to compile
    monkeypatch.setattr(precompile.subprocess, "run", lambda *a, **k: pytest.fail("no child on a warm boot"))
    assert precompile.boot_warm(lambda: int(twice(np.int64(4))), ServerConfig(model="m"), print) == 8
    fresh, notes = _fresh_kernel(), []
    monkeypatch.setattr(precompile.subprocess, "run", lambda argv, input=None: subprocess.CompletedProcess(argv, 3))
    assert precompile.boot_warm(lambda: int(fresh(np.int64(5))), ServerConfig(model="m"), notes.append) == 10
    assert "exited 3: compiling in this process instead" in notes[-1]
    # and the guard is gone afterwards: a compile elsewhere is not refused
    assert int(_fresh_kernel()(np.int64(2))) == 4


def test_disabled_is_a_plain_call(monkeypatch):
    monkeypatch.setattr(precompile.subprocess, "run", lambda *a, **k: pytest.fail("disabled"))
    fresh = _fresh_kernel()
    assert precompile.boot_warm(lambda: int(fresh(np.int64(3))), ServerConfig(model="m"), print, enabled=False) == 6


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) // 1024


@pytest.mark.slow
def test_a_cold_cache_boot_serves_with_a_warm_boots_memory(smollm2_path, tmp_path):
    """The whole thing: a server on an empty NUMBA_CACHE_DIR (every kernel compiles, ~1 min on
    2 cores) answers, and holds the memory of a warm boot (~270 MiB here; ~900 when it compiled
    in-process)."""
    from tests.serverproc import ServerProcess

    log = tmp_path / "server.out"
    srv = ServerProcess(smollm2_path, "--kv-cache-tokens", "2048", log_path=log,
                        env={"NUMBA_CACHE_DIR": str(tmp_path / "numba")})
    try:
        srv.wait_ready(600)
        body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "Say hi."}],
                           "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(srv.url + "/v1/chat/completions", body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 8
        rss = _rss_mib(srv.model_pid)
    finally:
        srv.stop()
    text = log.read_text()
    assert "compiling them in a child process" in text
    assert rss < 450, (rss, text[-2000:])
