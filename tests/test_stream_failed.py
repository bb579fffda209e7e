"""How every dialect ends a stream that failed (imp.http.pipeline.sse.stream_failed)."""

import asyncio

import pytest

from imp.http.pipeline.driver import StreamFault
from imp.http.pipeline.sse import stream_failed


class FakeResp:
    def __init__(self, broken=False):
        self.written, self.broken = [], broken

    async def write(self, data):
        if self.broken:
            raise ConnectionResetError
        self.written.append(data)


def render(message, code):
    return f"{code}:{message}".encode()


def run(exc, resp):
    asyncio.run(stream_failed(exc, resp, render, "test stream"))


def test_engine_fault_becomes_an_error_event():
    r = FakeResp()
    run(StreamFault("cuda died"), r)
    assert r.written == [b"engine_faulted:engine fault: cuda died"]
    r = FakeResp()
    run(StreamFault("injected", "engine_step_failed"), r)  # one step failed, the engine went on
    assert r.written == [b"engine_step_failed:engine step failed: injected"]


def test_our_bug_becomes_an_internal_error_event():
    r = FakeResp()
    run(KeyError("x"), r)
    assert r.written == [b"internal_error:internal error: KeyError"]


def test_client_gone_writes_nothing_and_a_dead_socket_is_tolerated():
    r = FakeResp()
    run(ConnectionResetError(), r)
    assert r.written == []
    run(ValueError("late"), FakeResp(broken=True))  # the error event itself cannot be sent


def test_failure_before_the_stream_started_is_reraised():
    with pytest.raises(ValueError):
        run(ValueError("early"), None)
