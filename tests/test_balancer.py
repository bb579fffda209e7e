"""What a load balancer is told (imp/http/endpoints/readiness.py, imp/http/agent.py) and the X-Session-Id
header (imp/http/pipeline/fields.py), in seconds: the pure decisions, the agent's socket, and
the header through every dialect of the real app on the fake engine. The real thing (HAProxy
in front of two servers) is tests/test_haproxy.py."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from imp.config import ServerConfig
from imp.engine.port import Rates, Snapshot
from imp.http.endpoints import readiness
from imp.http.agent import engine_answer, start_agent
from imp.http.app import create_app
from imp.messages import KvFigures, QueueFigures
from tests.fake_engine import FakeEngine
from tests.serverproc import free_port

MSGS = [{"role": "user", "content": "Say hello."}]


def _snap(waiting=0, running=0, used=0, reserved=0, total=100, suspended=False, draining=False, fault=None):
    kv = KvFigures(total, total - used, used, reserved, 0, 16)
    return Snapshot(kv=kv, replica_kv=(kv,), queue=QueueFigures(waiting, running, 0), rates=Rates(),
                    suspended=suspended, draining=draining, fault=fault, rejections=0, last_reject_reason=None,
                    in_flight=running, uptime_s=1.0)


CARD = FakeEngine().card  # max_batch_size 8, one replica


def test_ready_is_a_state_never_load():
    assert readiness.not_ready(_snap()) is None
    assert readiness.not_ready(_snap(waiting=50, running=8, used=99)) is None  # loaded: still ready
    assert readiness.not_ready(_snap(fault="boom", suspended=True)) == "engine_faulted"
    assert readiness.not_ready(_snap(suspended=True, draining=True)) == "suspended"
    assert readiness.not_ready(_snap(draining=True)) == "draining"


def test_busy_is_load():
    assert readiness.busy(_snap(), CARD) is None
    assert readiness.busy(_snap(used=90), CARD) == "pressure"
    assert readiness.busy(_snap(waiting=1), CARD) == "queue"
    assert readiness.busy(_snap(running=8), CARD) == "busy"
    assert readiness.busy(_snap(draining=True, waiting=3), CARD) == "draining"


@pytest.mark.parametrize("snap,line", [
    (_snap(), "up ready 100%\n"),
    (_snap(running=2), "up ready 80%\n"),  # 2 of 8 slots
    (_snap(running=4), "up ready 50%\n"),
    (_snap(used=60), "up ready 40%\n"),  # the pool, when it is the worse
    (_snap(running=4, used=10, reserved=60), "up ready 40%\n"),  # reserved counts what was promised
    (_snap(running=8, waiting=20, used=100), "up ready 10%\n"),  # never 0: loaded, still in rotation
    (_snap(running=3, suspended=True), "drain #suspended\n"),
    (_snap(draining=True), "drain #draining\n"),
    (_snap(fault="illegal address"), "down #engine_faulted\n"),
])
def test_agent_line(snap, line):
    assert readiness.agent_line(snap, CARD) == line


def test_agent_line_with_other_resident_models():
    """Models on demand: the resident models share the server, so the busiest sets the weight and a fault in
    any is down; the boot model's state (suspended, draining: server-wide) still drains."""
    idle, busy_other = (_snap(), CARD), (_snap(running=4), CARD)
    assert readiness.agent_line(_snap(), CARD, (idle,)) == "up ready 100%\n"
    assert readiness.agent_line(_snap(running=2), CARD, (busy_other,)) == "up ready 50%\n"
    assert readiness.agent_line(_snap(), CARD, (idle, (_snap(fault="oom"), CARD))) == "down #engine_faulted\n"
    assert readiness.agent_line(_snap(draining=True), CARD, (busy_other,)) == "drain #draining\n"


async def test_agent_answer_reads_every_resident_model():
    boot, other = FakeEngine(), FakeEngine()

    class Fleet:
        def ports(self):
            return [boot, other]  # the boot model is among the resident: counted once

    answer = engine_answer(boot, Fleet())
    assert await answer() == "up ready 100%\n"
    other.draining = True  # (a state only the boot model's port carries in a real fleet: here, a marker read)
    assert await answer() == "up ready 100%\n"  # others' states other than a fault do not drain the server
    other._fault = "device lost"
    assert await answer() == "down #engine_faulted\n"


def test_weight_moves_in_steps_and_never_leaves_the_range():
    seen = {readiness.weight(_snap(running=r, waiting=w, used=u), CARD)
            for r in range(9) for w in range(0, 12, 3) for u in range(0, 101, 7)}
    assert seen <= set(range(10, 101, 10)) and {10, 100} <= seen


def test_agent_port_config():
    assert ServerConfig().agent_port == 0
    assert ServerConfig(agent_port=9100).agent_port == 9100
    for bad in (-1, 65536, 8080):  # 8080 is --port
        with pytest.raises(ValueError, match="--agent-port"):
            ServerConfig(agent_port=bad)


async def _agent_reply(port: int) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    data = await asyncio.wait_for(r.read(), 5)
    w.close()
    return data


async def test_agent_socket_answers_one_line_and_closes():
    eng = FakeEngine()
    port = free_port()
    server = await start_agent("127.0.0.1", port, engine_answer(eng))
    try:
        assert await _agent_reply(port) == b"up ready 100%\n"
        eng.draining = True
        assert await _agent_reply(port) == b"drain #draining\n"

        async def broken() -> str:
            raise RuntimeError("engine gone")

        other = free_port()
        s2 = await start_agent("127.0.0.1", other, broken)
        try:
            assert await _agent_reply(other) == b"down #no_answer\n"  # never kept in rotation by its own agent
        finally:
            s2.close()
    finally:
        server.close()
        await server.wait_closed()


BODIES = {
    "/v1/chat/completions": {"model": "m", "messages": MSGS, "max_tokens": 4},
    "/v1/completions": {"model": "m", "prompt": "Hi", "max_tokens": 4},
    "/v1/messages": {"model": "m", "messages": MSGS, "max_tokens": 4},
    "/v1/responses": {"model": "m", "input": "Hi", "max_output_tokens": 16, "store": False},
}


@pytest.fixture
async def client():
    eng = FakeEngine()
    c = TestClient(TestServer(create_app(eng, eng.tm, ServerConfig())))
    await c.start_server()
    c.engine = eng
    yield c
    await c.close()


@pytest.mark.parametrize("path", list(BODIES))
async def test_session_header_is_the_session_id(client, path):
    r = await client.post(path, json=BODIES[path], headers={"X-Session-Id": "conv-1"})
    assert r.status == 200, await r.text()
    assert client.engine.submissions[-1].session_id == "conv-1"
    assert "imp-ignored-fields" not in r.headers
    # the body's own session_id wins; the header then only steered the proxy
    r = await client.post(path, json={**BODIES[path], "session_id": "from-body"}, headers={"X-Session-Id": "x"})
    assert r.status == 200 and client.engine.submissions[-1].session_id == "from-body"
    r = await client.post(path, json=BODIES[path])
    assert r.status == 200 and client.engine.submissions[-1].session_id == ""


def test_every_dialect_with_session_id_takes_the_header():
    """/infill too (the fake model has no FIM tokens to run it): the pipeline reads the header for
    every dialect that takes the field."""
    from imp.http.dialects import anthropic, chat, completions, infill, responses

    assert all("session_id" in d.DIALECT.fields for d in (anthropic, chat, completions, infill, responses))


async def test_a_bad_session_header_is_a_400_naming_it(client):
    r = await client.post("/v1/chat/completions", json=BODIES["/v1/chat/completions"],
                          headers={"X-Session-Id": "x" * 300})
    assert r.status == 400
    err = (await r.json())["error"]
    assert "X-Session-Id" in err["message"] and err["param"] == "X-Session-Id"
    r = await client.post("/v1/messages", json=BODIES["/v1/messages"], headers={"X-Session-Id": "a\tb"})
    assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"


def test_endpoint_picker_gauges():
    """The Gateway API Inference Extension's endpoint picker reads a queue gauge, a KV-use fraction and
    vLLM's LoRA info shape: imp_queue_waiting, imp_kv_cache_usage_perc, imp_lora_requests_info."""
    from imp.actors.base import Bus
    from imp.actors.metrics import MetricsActor
    from imp.log.eventlog import EventLog

    m = MetricsActor(Bus(EventLog(None)), "m", KvFigures(100, 100, 0, 0, 0, 16))
    m._apply_kv(KvFigures(100, 70, 30, 45, 0, 16))
    m.set_loras(("sql", "poems"), 1234.0)
    text = m.exposition().decode()
    assert "imp_kv_cache_usage_perc 0.45" in text
    assert 'imp_lora_requests_info{max_lora="64",running_lora_adapters="sql,poems",waiting_lora_adapters=""} 1234.0' \
        in text
    m.set_loras((), 1300.0)  # unloaded: the old label set is gone, not left behind
    assert "sql" not in m.exposition().decode()
    assert "imp_queue_waiting 0.0" in text
