"""A boot that finds the kernels missing from Numba's disk cache compiles them in a child.

Why: Numba keeps what it compiled in the process that compiled it (each function's LLVM
module and the compiler's arenas). A CPU server booted on a cold cache (a fresh clone's
`make serve`, or the first boot after an upgrade) held ~900 MB of RSS for the 94 MB SmolLM2
file, against ~270 MB on every later boot, which loads the same kernels from the cache
(measured, docs/perf-history/2026-12-03-twelfth.md). So the boot's model steps (load, tokenizer,
warm-up prefill, the embedder) first run with compiling forbidden: the first compile
Numba would start raises `ColdCache` instead, before any compile work. Then
`python -m imp _precompile` (the same configuration on stdin; `imp.server.precompile_main`)
runs the same steps in a child process, which compiles and saves everything to the cache and exits, and the
steps run again here, now loading from the cache. A compile still needed on the second
run (a cache that cannot be written, say) simply happens here, as before.

Only CPU boots: a GPU runner's CUDA kernels are not on Numba's disk cache path, and a
second process would load the model onto the device again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Callable, TypeVar

T = TypeVar("T")


class ColdCache(BaseException):
    """Raised from Numba's compile event: BaseException, so no `except Exception` on the way
    (a loader's fallback, a thread pool's future) takes it for a failure of its own."""


@contextlib.contextmanager
def _no_compiles():
    from numba.core import event

    class Forbid(event.Listener):
        def on_start(self, ev):
            raise ColdCache(getattr(ev.data.get("dispatcher"), "__qualname__", "a kernel") if ev.data else "a kernel")

        def on_end(self, ev):
            pass

    listener = Forbid()
    event.register("numba:compile", listener)
    try:
        yield
    finally:
        event.unregister("numba:compile", listener)


def boot_warm(steps: Callable[[], T], cfg, progress: Callable[[str], None], enabled: bool = True,
              part: str = "engine", status_at: tuple[str, int] | None = None) -> T:
    """steps() with its kernels loaded from Numba's disk cache, compiling them first in a
    child process (`_precompile PART`, given cfg) when the cache lacks any. part: "engine" (the
    model, its text side, the embedder) or "text" (an API server's: text side and embedder).
    status_at: (host, port) to answer 503 "compiling" with progress on while it compiles
    (imp.bootstatus; the process that will serve HTTP on that port)."""
    if not enabled:
        return steps()
    try:
        with _no_compiles():
            return steps()
    except ColdCache as cold:
        progress(f"kernels not in Numba's disk cache yet (first: {cold}): compiling them in a child process "
                 "(once; this process then loads them and keeps none of the compiler's memory)")
    from imp import bootstatus

    status = bootstatus.BootStatus()
    stop = bootstatus.serve_status(*status_at, status) if status_at else None
    if stop is not None:
        progress(f"answering 503 'compiling' with progress on http://{status_at[0]}:{status_at[1]}/health meanwhile")
    try:
        with compile_lock(progress):
            try:  # another boot sharing this cache may have compiled them while we waited
                with _no_compiles():
                    return steps()
            except ColdCache:
                pass
            code = _compile_children(cfg, part, status, progress)
            if code != 0:
                progress(f"the compile child exited {code}: compiling in this process instead")
            else:
                progress(f"compiled {status.kernels} kernels in {time.monotonic() - status.started:.0f} s")
            return steps()
    finally:
        if stop is not None:
            stop()


def _compile_children(cfg, part: str, status, progress: Callable[[str], None]) -> int:
    """Run `_precompile PART` (and, on an engine boot, `_precompile head` beside it: the output
    head's GEMM on another core), each finished kernel reported to status over a pipe; the main
    child's exit code. A failed head child costs nothing: the main child compiles the head too."""
    import msgspec

    from imp import bootstatus

    body = msgspec.json.encode(cfg)
    rfd, wfd = os.pipe()
    reader = bootstatus.read_progress(rfd, status)
    kw = dict(preexec_fn=die_with(os.getpid()), pass_fds=(wfd,), env={**os.environ, "IMP_PROGRESS_FD": str(wfd)})
    head = None
    try:
        if part == "engine":
            head = subprocess.Popen([sys.executable, "-m", "imp", "_precompile", "head"], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
            try:
                head.stdin.write(body)
                head.stdin.close()
            except OSError:  # it died before reading its configuration: reported below
                pass
        code = subprocess.run([sys.executable, "-m", "imp", "_precompile", part], input=body, **kw).returncode
    finally:
        os.close(wfd)
        if head is not None and head.wait() != 0:
            progress(f"the head's compile child exited {head.returncode} (no harm: compiled with the rest)")
    reader.join(5)
    return code


@contextlib.contextmanager
def compile_lock(progress: Callable[[str], None] = lambda m: None):
    """One compile at a time per Numba cache: two boots sharing it (a second replica, a restart
    while the first still compiles) compile once; the later one then loads from the cache.
    An flock on a file in the cache folder: released by the kernel if its holder dies."""
    import fcntl

    import numba

    folder = numba.config.CACHE_DIR or os.path.join(os.path.dirname(__file__), "__pycache__")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".imp-compile.lock"), "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress("another boot is compiling the kernels into the same cache: waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def die_with(parent: int) -> Callable[[], None]:
    """A child's preexec: Linux sends it SIGKILL when `parent` dies, however it dies (a server
    killed mid-compile leaves no compile child behind, and a restart starts no second one)."""
    def preexec() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - not Linux
            pass
        if os.getppid() != parent:  # it died before the line above
            os._exit(1)
    return preexec
