"""Admission: what is refused (400 / 429), what is reserved, cancel forwarding."""

from __future__ import annotations

import pytest

from imp.core.admission import AdmissionConfig, AdmissionCore
from imp.core.core import CoreError
from imp.messages import Cancel, Enqueue, Finished, FinishReason, Reject, SamplingParams, Submit

P = SamplingParams(max_tokens=8)


def submit(core, req_id, n_prompt, params=P, n=1):
    (receiver, msg), = core.handle("ingress", Submit(req_id, tuple(range(n_prompt)), params, 0, n=n))
    return receiver, msg


def test_prompt_that_can_never_fit_is_400_with_capacity():
    core = AdmissionCore(AdmissionConfig(num_blocks=512, block_size=16, max_context=100_000))
    receiver, msg = submit(core, "a", 9000)
    assert receiver == "ingress" and isinstance(msg, Reject) and msg.status == 400
    assert msg.message == "prompt of 9000 tokens exceeds KV capacity of 8192 tokens"
    # prompt + 1 generated token must fit: 8191 does, 8192 does not
    assert isinstance(submit(core, "b", 8191)[1], Enqueue)
    assert submit(core, "c", 8192)[1].status == 400


def test_context_empty_and_bad_fields_are_400():
    core = AdmissionCore(AdmissionConfig(num_blocks=512, block_size=16, max_context=1024))
    assert "model context of 1024" in submit(core, "a", 1024)[1].message
    assert submit(core, "b", 0)[1].status == 400
    assert submit(core, "c", 5, SamplingParams(max_tokens=0))[1].status == 400
    assert submit(core, "d", 5, n=0)[1].status == 400
    assert isinstance(submit(core, "e", 5)[1], Enqueue)
    assert submit(core, "e", 5)[1].status == 400  # id in use


def test_queued_tokens_limit_is_429_and_released_by_finished():
    core = AdmissionCore(AdmissionConfig(num_blocks=64, block_size=16, max_context=1024,
                                         max_queued_tokens=100, retry_after_s=2.5))
    assert isinstance(submit(core, "big", 500)[1], Enqueue)  # an empty system takes anything
    r = submit(core, "x", 10)[1]
    assert (r.status, r.retry_after_s) == (429, 2.5)
    assert core.handle("scheduler", Finished("big", FinishReason.STOP)) == []
    assert isinstance(submit(core, "x", 60)[1], Enqueue)
    assert isinstance(submit(core, "y", 40)[1], Enqueue)  # exactly at the limit
    assert submit(core, "z", 1)[1].status == 429


def test_reserved_blocks():
    core = AdmissionCore(AdmissionConfig(num_blocks=100, block_size=16, admission_decode_tokens=256))
    # 40 prompt + min(8, 256) decode = 48 tokens = 3 blocks
    assert submit(core, "a", 40)[1].reserved_blocks == 3
    # n = 3: siblings share blocks 0-1 (full, not the last token's) and own 1 each
    assert submit(core, "b", 40, n=3)[1].reserved_blocks == 3 + 2 * 1
    # capped at the pool
    assert submit(core, "c", 100, SamplingParams(max_tokens=5000), n=10)[1].reserved_blocks == 100


def test_cancel_forwarded_only_while_known():
    core = AdmissionCore(AdmissionConfig(num_blocks=64))
    submit(core, "a", 5)
    assert core.handle("ingress", Cancel("a")) == [("scheduler", Cancel("a"))]
    core.handle("scheduler", Finished("a", FinishReason.CANCELLED))
    assert core.handle("ingress", Cancel("a")) == []
    assert core.handle("ingress", Cancel("never")) == []
    with pytest.raises(CoreError):
        core.handle("scheduler", Finished("a", FinishReason.STOP))
    with pytest.raises(ValueError):
        AdmissionConfig(num_blocks=0)


def test_suspend_refuses_new_requests_503_and_lets_admitted_ones_finish():
    from imp.messages import Resume, Suspend

    core = AdmissionCore(AdmissionConfig(num_blocks=64, block_size=16, max_context=1024))
    assert isinstance(submit(core, "running", 10)[1], Enqueue)
    assert core.handle("ingress", Suspend()) == []
    r = submit(core, "new", 10)[1]
    assert (r.status, r.code) == (503, "suspended") and "resume" in r.message
    assert submit(core, "huge", 5000)[1].status == 400  # a request that can never run stays a 400
    # the admitted request is never cancelled: its Cancel still forwards, its Finished releases it
    assert core.handle("ingress", Cancel("running")) == [("scheduler", Cancel("running"))]
    assert core.handle("scheduler", Finished("running", FinishReason.STOP)) == []
    assert core.handle("ingress", Suspend()) == []  # idempotent
    assert core.handle("ingress", Resume()) == []
    assert isinstance(submit(core, "new", 10)[1], Enqueue)
    assert core.handle("ingress", Resume()) == []  # resuming an open core is a no-op


def test_suspend_and_resume_round_trip_through_msgspec():
    import msgspec

    from imp.messages import Message, Resume, Suspend

    for m in (Suspend(), Suspend("idle"), Resume()):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(m), type=Message) == m
