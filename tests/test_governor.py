"""The CPU forward's thread governor (imp/model/governor.py): one thread while a neighbour takes
the cores, all of them again once a probe finds the cores free; the width changes no bits.

The pure `decide` is walked through the cases bench/cpu_neighbour.py measures (alone, beside a
second server, beside a one-core hog, the neighbour gone); the shell is checked on real /proc
reads and on a busy thread of its own that it must see waiting for a CPU when squeezed."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import numpy as np
import pytest

from imp.model import governor as gv
from imp.model.governor import Governor, GovernorConfig, decide, initial

CFG = GovernorConfig(max_threads=2, cpus=2)


def test_alone_it_keeps_every_thread():
    st = initial(CFG)
    for k in range(20):
        st = decide(CFG, st, k * 0.25, waited=0.06, runnable=2.0)
    assert st.threads == 2 and not st.probing


def test_a_neighbour_shrinks_it_and_failed_probes_back_off_to_the_limit():
    st = decide(CFG, initial(CFG), 10.0, waited=0.51, runnable=4.0)  # beside a second server
    assert st.threads == 1 and st.backoff_s == CFG.probe_after_s and st.shrunk_at == 10.0
    t, probes = 10.0, []
    while t < 200:
        t += 0.25
        st = decide(CFG, st, t, waited=0.0, runnable=2.0)  # one thread each: no waiting, no room
        if st.threads == 2:
            probes.append(t)
            t += 0.25
            st = decide(CFG, st, t, waited=0.5, runnable=4.0)  # the probe meets the neighbour
            assert st.threads == 1
    gaps = np.diff(probes)
    assert gaps[0] < gaps[1] < gaps[2] and max(gaps) <= CFG.probe_max_s + 0.5
    assert len(probes) < 15  # ~10 probes in 190 s, not one a window


def test_room_on_the_cores_probes_early_and_a_passed_probe_stays():
    st = decide(CFG, initial(CFG), 0.0, waited=0.35, runnable=3.0)  # beside a one-core hog
    st = decide(CFG, st, 0.3, waited=0.0, runnable=1.0)  # the hog ended, but too soon after shrinking
    assert st.threads == 1
    st = decide(CFG, st, 0.6, waited=0.0, runnable=1.0)  # room, and the least gap passed: probe
    assert st.threads == 2 and st.probing
    st = decide(CFG, st, 0.75, waited=0.05, runnable=2.0)  # passed
    assert st.threads == 2 and not st.probing and st.backoff_s == CFG.probe_after_s


def test_one_thread_or_bad_config_is_left_alone():
    one = GovernorConfig(max_threads=1, cpus=8)
    assert decide(one, initial(one), 5.0, waited=0.9, runnable=20).threads == 1
    with pytest.raises(ValueError):
        GovernorConfig(max_threads=0, cpus=2)
    assert Governor(one).threads() == 1 and not Governor(one).enabled
    assert Governor(CFG, enabled=False).threads() == 2


@pytest.mark.skipif(not gv.usable(), reason="needs Linux /proc")
def test_the_shell_reads_this_process_and_the_system():
    times = gv._task_times()
    me = str(threading.get_native_id())
    assert me in times and times[me][0] > 0
    assert gv._runnable() >= 1  # this thread is running while it reads


@pytest.mark.skipif(not gv.usable() or len(os.sched_getaffinity(0)) < 1, reason="needs Linux /proc")
def test_the_shell_sees_its_busy_thread_wait_when_a_hog_shares_its_cpu():
    """A thread of ours spins on CPU k while a second busy thread of ours is pinned to the same
    CPU: each waits about half the time, which is what a neighbour does to the team."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    stop = threading.Event()

    block = os.urandom(1 << 22)

    def spin():  # sha256 of a large buffer lets go of the GIL: both threads are runnable at once
        os.sched_setaffinity(0, {cpu})
        while not stop.is_set():
            hashlib.sha256(block).digest()

    hogs = [threading.Thread(target=spin) for _ in range(2)]
    for h in hogs:
        h.start()
    g = Governor(GovernorConfig(max_threads=2, cpus=2, window_s=0.3))
    try:
        g.threads()
        time.sleep(0.35)
        assert g.threads() == 1, g.state  # two of ours on one CPU: each waited about half the window
    finally:
        stop.set()
        for h in hogs:
            h.join()


def test_width_changes_no_bits(tmp_path):
    """The same forward at one and two threads: identical logits (each output is one fixed chain)."""
    from imp.messages import SamplingParams, SeqWork
    from imp.model.runner import ModelRunner
    from tests.fixtures.synth import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "t.gguf", n_layers=2)
    p = SamplingParams(max_tokens=4, temperature=0.0)
    prompt = tuple(range(1, 40))
    out = []
    for n in (1, 2):
        r = ModelRunner.load(path, kv_tokens=256, num_threads=n)
        out.append(r.forward([SeqWork("a", prompt, 0, (0, 1, 2), True, p)]))
    assert np.array_equal(out[0], out[1])
