"""One thread starts every OpenMP parallel region of the process: the CPU forward's team.

Why: GNU OpenMP (Numba's `omp` threading layer, and torch's intra-op pool, which share one
libgomp here) gives each thread that starts a parallel region a team of worker threads of its
own, and once the process holds more such threads than CPUs it stops spinning between regions
(libgomp's throttled spin count) — each of a CPU step's ~150 regions then has to wake a sleeping
worker. The server boots on its main thread (load, the warm-up prefill) and steps on the
executor's thread: two teams. Measured on 2 cores (SmolLM2, 2 threads, one decode row): the same
step took 14-18 ms when boot and steps ran on different threads, 6-9 ms when on one; through
HTTP one stream ran at 60 tok/s against 140 in process.

So `ModelRunner` runs its step here, whoever calls it: one team for the life of the process.
A call made on this thread runs inline (no hand-off). torch's inference mode is per thread,
so it is entered here too, when the process has torch at all (`inference_mode`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import sys
import threading

_lock = threading.Lock()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_ident: int | None = None


def _mark() -> None:
    global _ident
    _ident = threading.get_ident()


def default_threads() -> int:
    """Threads for a CPU forward when --threads is not given: one per physical core this process
    may run on (what torch's default was, and llama.cpp's): a GEMV streaming weights gains
    nothing from a core's second hardware thread and loses to it sharing that core's caches.
    Linux's CPU topology; without it, every CPU the process may use."""
    cpus = os.sched_getaffinity(0)
    cores = set()
    for c in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                cores.add(f.read().strip())
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def inference_mode():
    """torch's inference mode where torch is loaded; nothing to do where it is not (the fused CPU
    forward never imports it, and a process without torch has no autograd to turn off)."""
    torch = sys.modules.get("torch")
    return torch.inference_mode() if torch is not None else contextlib.nullcontext()


def _inference(fn, args, kw):
    with inference_mode():
        return fn(*args, **kw)


def pool() -> concurrent.futures.ThreadPoolExecutor:
    """The team's thread as an executor (never shut down: it lives as long as the process).
    A caller that hops to a worker thread anyway (the executor actor) hops here instead and
    saves a second hand-off (~0.1-0.3 ms a step on 2 busy cores)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="omp-team", initializer=_mark)
    return _pool


def run(fn, *args, **kw):
    """fn(*args, **kw) on the team's thread, in inference mode; its result or its exception."""
    if threading.get_ident() == _ident:
        return _inference(fn, args, kw)
    return pool().submit(_inference, fn, args, kw).result()
