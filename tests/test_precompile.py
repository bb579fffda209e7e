"""imp/precompile.py: a boot on a cold Numba cache compiles in a child, so the server keeps
none of the compiler's memory (issue 15's memory goal on a fresh clone's first `make serve`)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from numba import njit

from imp import precompile
from imp.config import ServerConfig

ROOT = Path(__file__).resolve().parent.parent


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

    def run(argv, input=None, preexec_fn=None, pass_fds=(), env=None):
        assert preexec_fn is not None  # the child dies with this process
        # and reports each kernel it compiled on a pipe the parent reads (imp.bootstatus)
        assert env["IMP_PROGRESS_FD"] == str(pass_fds[0])
        os.write(pass_fds[0], b"twice\n")
        children.append((argv, json.loads(input)))
        return subprocess.CompletedProcess(argv, 0)

    class Head:  # the output head's compile child, started beside the main one
        def __init__(self, argv, stdin=None, preexec_fn=None, pass_fds=(), env=None, **kw):
            assert preexec_fn is not None and env["IMP_PROGRESS_FD"] == str(pass_fds[0])
            children.append((argv, None))
            self.stdin, self.returncode = io.BytesIO(), 0

        def wait(self):
            return 0

    monkeypatch.setattr(precompile.subprocess, "run", run)
    monkeypatch.setattr(precompile.subprocess, "Popen", Head)
    cfg = ServerConfig(model="some.gguf")
    assert precompile.boot_warm(steps, cfg, notes.append) == 42
    # stopped at the first compile, checked again under the compile lock (another boot may have
    # compiled meanwhile), then again after the child
    assert len(calls) == 3
    (head, _), (argv, sent) = children
    assert head[1:] == ["-m", "imp", "_precompile", "head"]
    assert argv[1:] == ["-m", "imp", "_precompile", "engine"] and sent["model"] == "some.gguf"
    assert "compiling them in a child process" in notes[0] and "twice" in notes[0]
    assert "compiled 1 kernels" in notes[-1]


def test_a_warm_boot_spawns_nothing_and_a_failed_child_falls_back(monkeypatch):
    twice = _fresh_kernel()
    twice(np.int64(1))  # compiled: nothing left to compile
    monkeypatch.setattr(precompile.subprocess, "run", lambda *a, **k: pytest.fail("no child on a warm boot"))
    monkeypatch.setattr(precompile.subprocess, "Popen", lambda *a, **k: pytest.fail("no child on a warm boot"))
    assert precompile.boot_warm(lambda: int(twice(np.int64(4))), ServerConfig(model="m"), print) == 8
    fresh, notes = _fresh_kernel(), []
    monkeypatch.setattr(precompile.subprocess, "run", lambda argv, input=None, **kw: subprocess.CompletedProcess(argv, 3))

    class FailedHead:
        stdin, returncode = io.BytesIO(), 4

        def __init__(self, *a, **kw):
            pass

        def wait(self):
            return 4

    monkeypatch.setattr(precompile.subprocess, "Popen", FailedHead)
    assert precompile.boot_warm(lambda: int(fresh(np.int64(5))), ServerConfig(model="m"), notes.append) == 10
    assert "exited 3: compiling in this process instead" in notes[-1]
    assert any("head's compile child exited 4" in n for n in notes)
    # and the guard is gone afterwards: a compile elsewhere is not refused
    assert int(_fresh_kernel()(np.int64(2))) == 4


def test_two_boots_sharing_a_cache_compile_once(tmp_path, monkeypatch):
    """The compile lock: a second process waits while the first holds it (flock; the kernel
    drops it if the holder dies)."""
    import numba

    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    code = ("import numba, time; numba.config.CACHE_DIR = %r\nfrom imp import precompile\n"
            "with precompile.compile_lock(print): print('got', time.time())"
            % str(tmp_path))
    with precompile.compile_lock():
        other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
        time.sleep(1.5)
        assert other.poll() is None  # still waiting for the lock
        released = time.time()
    out, _ = other.communicate(timeout=30)
    # it took the lock only once this holder let go (its own wait depends on how long its imports took)
    assert "another boot is compiling" in out and float(out.split("got ")[1]) >= released - 0.05, (out, released)


def test_the_compile_child_dies_with_its_parent(tmp_path):
    """A server killed mid-compile leaves no compile child behind (PR_SET_PDEATHSIG)."""
    pidfile = tmp_path / "child.pid"
    code = ("import os, subprocess, sys, time\nfrom imp import precompile\n"
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
            "preexec_fn=precompile.die_with(os.getpid()))\n"
            f"open({str(pidfile)!r}, 'w').write(str(c.pid))\ntime.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    for _ in range(100):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.1)
    child = int(pidfile.read_text())
    parent.kill()
    parent.wait()
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, os.WNOHANG)
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        pytest.fail("the compile child outlived its parent")


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


_SECOND_CHILD = """
import json, sys
from numba.core import event
from imp.config import ServerConfig
from imp import server
names = []
class L(event.Listener):
    def on_start(self, ev):
        names.append(getattr(ev.data.get("dispatcher"), "__qualname__", "?"))
    def on_end(self, ev):
        pass
if sys.argv[1] == "steps":
    event.register("numba:compile", L())
(server.compile_head if sys.argv[1] == "head" else server.compile_steps)(ServerConfig(model=sys.argv[2]))
print(json.dumps(names))
"""


@pytest.mark.slow
def test_the_second_compile_child_compiles_what_the_forward_then_loads(smollm2_path, tmp_path):
    """A cold boot's `_precompile head` child compiles the layers' non-GEMM kernels and the head
    with the types the forward gives them: a boot's steps run after it compile none of them (they
    load from the disk cache), only the GEMMs and what the head child does not cover."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    root = Path(__file__).resolve().parent.parent

    def run(part):
        r = subprocess.run([sys.executable, "-c", _SECOND_CHILD, part, str(smollm2_path)], cwd=root, env=env,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    run("head")
    compiled = run("steps")
    assert "forward_layers" in compiled and "_gemm_multi" in compiled, compiled  # the cache was cold for these
    for name in ("attention", "_qkv_post_par", "_post_norm_add", "_act_rows", "_lora_add", "corrections",
                 "row_dot16", "row_dots", "predecoded_dots", "rows_dot4", "rows_dot4x2", "rows_dot4x3", "rows_dot4x4", "row_dot"):
        assert name not in compiled, (name, compiled)
