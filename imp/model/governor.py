"""How many threads the CPU forward uses: all it was given while they get the cores, one while a
neighbour takes them.

Why: a step is ~150 OpenMP parallel regions, each ending in a barrier. With the cores to
itself a team of 2 finishes a region together; beside another busy process (a second replica,
a compile, `make test`, a browser) one of the two is often descheduled, and its partner waits
at every barrier for a whole time slice. Measured on 2 cores (SmolLM2, 8 streams, 64 tokens,
bench/cpu_neighbour.py): one server 273 tok/s; two servers side by side 26 + 31; beside a
one-core busy loop 76. The same with one thread each: 120 + 128 side by side, 155 beside the
busy loop: a lone thread is never waited for. So the team shrinks to one thread while its
threads wait for a CPU, and grows back when a probe finds the cores free again. The thread
count changes no bits (every output is one fixed chain, whichever thread computes it).

The signal: /proc/self/task/*/schedstat says, per thread, the time it ran and the time it
was runnable but waiting for a CPU. Alone, our busy threads wait 2-7% of a window; beside a
one-core hog 35%; beside a second server 51% (measured). At one thread that signal says
nothing about the other core, so the shell also reads the system's runnable count
(/proc/loadavg): room for a second thread triggers a probe after 0.5 s, else a probe comes
after a back-off that doubles while probes fail (2 s .. 30 s). A probe is one window at full
width.

Core: `decide` (pure: state, clock and measurements in, state out). Shell: `Governor`, which
reads /proc on the team's thread at the start of a forward (a few µs per step; the task files
once a window).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace

log = logging.getLogger("imp.governor")


@dataclass(frozen=True)
class GovernorConfig:
    max_threads: int  # the team's full width (--threads or one per core)
    cpus: int  # CPUs this process may run on
    window_s: float = 0.15  # one measurement (5-15 steps; the signal is 2-7% alone against 35-51% squeezed)
    contended: float = 0.2  # a busy thread of ours waited this share of a window for a CPU
    busy: float = 0.3  # a thread counts when it ran or waited this share of the window
    probe_after_s: float = 2.0  # first back-off after shrinking (a probe the clock calls)
    probe_max_s: float = 30.0
    room_after_s: float = 0.5  # the least between shrinking and a probe that idle CPUs call

    def __post_init__(self):
        if self.max_threads < 1 or self.cpus < 1 or not 0 < self.contended < 1:
            raise ValueError(f"bad governor config {self}")


@dataclass(frozen=True)
class GovernorState:
    threads: int
    probing: bool = False  # this window runs at full width to test the cores
    backoff_s: float = 0.0  # wait before the next probe
    shrunk_at: float = 0.0  # when the team last shrank (or a probe failed)


def initial(cfg: GovernorConfig) -> GovernorState:
    return GovernorState(cfg.max_threads, backoff_s=cfg.probe_after_s)


def decide(cfg: GovernorConfig, st: GovernorState, now: float, waited: float, runnable: float) -> GovernorState:
    """After a window. waited: the largest share of it one of our busy threads spent runnable but
    not running; runnable: the system's mean runnable count over it (our own running threads
    included)."""
    if cfg.max_threads == 1:
        return st
    if st.threads > 1:
        if waited < cfg.contended:  # the cores are ours (a probe that passed resets the back-off)
            return GovernorState(st.threads, backoff_s=cfg.probe_after_s)
        backoff = min(2 * st.backoff_s, cfg.probe_max_s) if st.probing else cfg.probe_after_s
        return GovernorState(1, backoff_s=backoff, shrunk_at=now)
    since = now - st.shrunk_at
    room = runnable <= cfg.cpus - 0.5  # our one thread and the others leave a CPU mostly idle
    if since >= st.backoff_s or (room and since >= cfg.room_after_s):
        return replace(st, threads=cfg.max_threads, probing=True)
    return st


def _task_times() -> dict[str, tuple[int, int]]:
    """Per thread of this process: (ns on a CPU, ns runnable and waiting for one)."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ran, waited, _ = f.read().split()
            out[tid] = (int(ran), int(waited))
        except (OSError, ValueError):
            continue  # a thread that just ended
    return out


def _runnable() -> float:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0.0


def usable() -> bool:
    return os.path.exists("/proc/self/task") and os.path.exists("/proc/loadavg")


class Governor:
    """Call `threads()` on the team's thread at the start of each forward; it returns the width
    to use. Without Linux's /proc (or at max_threads 1) it always answers max_threads."""

    def __init__(self, cfg: GovernorConfig, enabled: bool = True):
        self.cfg = cfg
        self.state = initial(cfg)
        self.enabled = enabled and cfg.max_threads > 1 and usable()
        self._t0 = 0.0
        self._times: dict[str, tuple[int, int]] = {}
        self._run_sum = 0.0
        self._run_n = 0
        self.changes = 0

    def threads(self) -> int:
        if not self.enabled:
            return self.cfg.max_threads
        now = time.monotonic()
        self._run_sum += _runnable()
        self._run_n += 1
        if not self._times:
            self._start(now)
        elif now - self._t0 >= self.cfg.window_s:
            self._decide(now)
        return self.state.threads

    def _start(self, now: float) -> None:
        self._t0, self._times, self._run_sum, self._run_n = now, _task_times(), 0.0, 0

    def _decide(self, now: float) -> None:
        wall = (now - self._t0) * 1e9
        waited = 0.0
        for tid, (ran, wt) in _task_times().items():
            r0, w0 = self._times.get(tid, (0, 0))
            dr, dw = ran - r0, wt - w0
            if dr + dw >= self.cfg.busy * wall:
                waited = max(waited, dw / wall)
        runnable = self._run_sum / max(1, self._run_n)
        before = self.state
        self.state = decide(self.cfg, before, now, waited, runnable)
        if self.state.threads != before.threads:
            self.changes += 1
            why = (f"a busy thread waited {waited:.0%} of the last {self.cfg.window_s:g} s for a CPU"
                   if self.state.threads < before.threads else
                   f"probing: {runnable:.1f} runnable on {self.cfg.cpus} CPUs")
            # every change on the first few, then one in 64: a contended box may flip often
            if self.changes <= 8 or self.changes % 64 == 0:
                log.info("CPU forward threads %d -> %d (%s)", before.threads, self.state.threads, why)
        self._start(now)
