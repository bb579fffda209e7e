"""The CPU runner's OpenMP team: every step and load runs on one thread, whoever calls.

Why it matters is in imp/model/team.py (two threads starting parallel regions halved the
CPU forward's speed through the server). Here: the routing itself, on a small synthetic
model, and team.run's contract (inline on its own thread, exceptions, inference mode)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest
import torch

from imp.messages import SamplingParams, SeqWork
from imp.model import team
from imp.model.runner import ModelRunner
from tests.fixtures.synth import write_synthetic_gguf


def test_run_is_one_thread_inline_there_and_raises_what_fn_raises():
    here = threading.get_ident()
    ids = {team.run(threading.get_ident) for _ in range(3)}
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        ids |= set(ex.map(lambda _: team.run(threading.get_ident), range(4)))
    assert len(ids) == 1 and here not in ids
    # called from the team's own thread: inline, no hand-off to itself (which would deadlock)
    assert team.run(lambda: team.run(threading.get_ident)) in ids
    assert team.run(torch.is_inference_mode_enabled) is True

    def boom():
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        team.run(boom)


def test_runner_loads_and_steps_on_the_team_thread(tmp_path):
    path = write_synthetic_gguf(tmp_path / "t.gguf", n_layers=1)
    r = ModelRunner.load(path, kv_tokens=256, num_threads=1)
    seen = []
    forward = r.model.forward

    def spy(*a, **kw):
        seen.append(threading.get_ident())
        return forward(*a, **kw)

    r.model.forward = spy
    p = SamplingParams(max_tokens=4, temperature=0.0)
    r.step([SeqWork("a", (1, 2, 3), 0, (0,), True, p)])  # this thread
    with concurrent.futures.ThreadPoolExecutor(1) as ex:  # as the executor actor calls it
        ex.submit(r.step, [SeqWork("b", (4, 5), 0, (1,), True, p)]).result()
    assert len(seen) == 2 and seen[0] == seen[1] == team.run(threading.get_ident)
    assert seen[0] != threading.get_ident()


def test_default_threads_is_one_per_physical_core(monkeypatch):
    """Hardware threads that share a core count once (torch's old default, llama.cpp's); no
    topology to read: every CPU the process may use."""
    import builtins
    import io

    from imp.model import team

    siblings = {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}  # 2 cores x 2 threads
    real_open = builtins.open

    def fake_open(path, *a, **kw):
        if str(path).startswith("/sys/devices/system/cpu/cpu"):
            return io.StringIO(siblings[int(str(path).split("/cpu/cpu")[1].split("/")[0])] + "\n")
        return real_open(path, *a, **kw)

    monkeypatch.setattr(team.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(builtins, "open", fake_open)
    assert team.default_threads() == 2
    monkeypatch.setattr(team.os, "sched_getaffinity", lambda pid: {0, 2})  # pinned to one core's two threads
    assert team.default_threads() == 1

    def no_sys(path, *a, **kw):
        if str(path).startswith("/sys/"):
            raise OSError("no sysfs")
        return real_open(path, *a, **kw)

    monkeypatch.setattr(builtins, "open", no_sys)
    monkeypatch.setattr(team.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert team.default_threads() == 3
