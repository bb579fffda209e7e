"""End to end: the real server, the real default model, the official openai client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.serverproc import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(imp_server):
    return imp_server  # one server process for every e2e module (tests/conftest.py)


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _raw(server, method, path, body: bytes | None = None, headers=None):
    req = urllib.request.Request(server.url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _health(server) -> dict:
    return json.loads(_raw(server, "GET", "/health")[2])


MSGS = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def test_chat_non_streaming(server):
    r = _client(server).chat.completions.create(model="x", messages=MSGS, max_tokens=16, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert "Paris" in c.message.content
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-")


def test_chat_streaming_equals_non_streaming(server):
    cl = _client(server)
    whole = cl.chat.completions.create(model="x", messages=MSGS, max_tokens=24, temperature=0)
    chunks = list(
        cl.chat.completions.create(
            model="x", messages=MSGS, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_seeded_sampling_is_reproducible(server):
    cl = _client(server)
    kw = dict(model="x", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=20,
              temperature=1.0, seed=1234)
    a = cl.chat.completions.create(**kw).choices[0].message.content
    b = cl.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_eight_concurrent_half_streaming(server):
    import openai

    async def main():
        cl = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

        async def one(i):
            msgs = [{"role": "user", "content": f"Count from {i} to {i + 5}."}]
            if i % 2:
                text = ""
                async for ch in await cl.chat.completions.create(
                    model="x", messages=msgs, max_tokens=24, temperature=0.7, seed=i, stream=True
                ):
                    if ch.choices and ch.choices[0].delta.content:
                        text += ch.choices[0].delta.content
                return text
            r = await cl.chat.completions.create(model="x", messages=msgs, max_tokens=24, temperature=0.7, seed=i)
            return r.choices[0].message.content

        return await asyncio.gather(*(one(i) for i in range(8)))

    texts = asyncio.run(main())
    assert len(texts) == 8 and all(t.strip() for t in texts)
    h = _health(server)
    # idle baseline: only pinned prompts (cache_prompt / session_id tests) hold blocks
    assert h["kv_blocks_used"] == h["kv_blocks_pinned"], h
    assert h["kv_blocks_free"] + h["kv_blocks_pinned"] == h["kv_blocks_total"]  # free counts evictable cached


@pytest.mark.parametrize(
    "body,needle",
    [
        (b"{not json", "not valid JSON"),
        (b"[1,2]", "JSON object"),
        (b'{"model":"x"}', "'messages' is required"),
        (b'{"model":"x","messages":"hi"}', "non-empty array"),
        (b'{"model":"x","messages":[]}', "non-empty array"),
        (b'{"model":"x","messages":[{"role":"wizard","content":"hi"}]}', "role"),
        (b'{"model":"x","messages":[{"role":"user","content":5}]}', "content"),
        (b'{"model":"x","messages":[{"role":"user","content":"hi"}],"temperature":"hot"}', "temperature"),
        (b'{"model":"x","messages":[{"role":"user","content":"hi"}],"temperature":3}', "temperature"),
        (b'{"model":"x","messages":[{"role":"user","content":"hi"}],"max_tokens":0}', "max_tokens"),
        (b'{"model":"x","messages":[{"role":"user","content":"hi"}],"n":9}', "'n'"),
        (b'{"model":"x","messages":[{"role":"user","content":"hi"}],"logit_bias":{"abc":1}}', "logit_bias"),
        (b'{"model":"x","messages":[{"role":"user","content":"hi"}],"logit_bias":{"99999999":1}}', "vocabulary"),
        (b'{"model":"x","messages":[{"role":"user","content":"hi"}],"best_of":3}', "best_of"),
        (b'{"model":"x","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}', "text-only"),
        (b'{"model":"x","messages":[{"role":"user","content":"\\ud800 lone"}]}', "surrogate"),
        (b'{"model":"x","messages":' + b"[" * 100000 + b"]" * 100000 + b"}", "nested too deeply"),
    ],
)
def test_bad_input_is_a_400_envelope(server, body, needle):
    status, headers, raw = _raw(server, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert needle in err["message"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert headers.get("X-Request-Id")


def test_unknown_route_and_request_id_echo(server):
    status, headers, raw = _raw(server, "GET", "/v1/nope", headers={"X-Request-Id": "abc def"})
    assert status == 404
    assert json.loads(raw)["error"]["message"].startswith("no route")
    assert headers["X-Request-Id"] == "abcdef"  # sanitized to printable ASCII without spaces
    status, headers, raw = _raw(server, "GET", "/v1/nope", headers={"X-Request-Id": "x" * 300})
    assert status == 404 and headers["X-Request-Id"] == "x" * 128


def test_server_keeps_serving_and_lists_model(server):
    models = _client(server).models.list()
    assert models.data[0].id
    assert _health(server)["status"] == "ok"
    status, _, raw = _raw(server, "GET", "/metrics")
    assert status == 200 and b"imp_kv_blocks_total" in raw


def test_client_disconnect_frees_kv(server):
    """A streaming client that goes away mid-generation frees its blocks."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"model": "x", "messages": MSGS, "max_tokens": 400, "stream": True, "ignore_eos": True})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.read1(200)
    conn.sock.close()  # hard disconnect mid-stream
    conn.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        h = _health(server)
        if h["kv_blocks_used"] == h["kv_blocks_pinned"] and h["queue_depth"] == 0:
            break
        time.sleep(0.2)
    assert h["kv_blocks_used"] == h["kv_blocks_pinned"] and h["queue_depth"] == 0, h


def test_non_streaming_disconnect_frees_kv(server):
    """A non-streaming client that gives up is cancelled too (aiohttp handler cancellation)."""
    import socket

    body = json.dumps({"model": "x", "messages": MSGS, "max_tokens": 2000, "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 10
    while _health(server)["queue_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _health(server)["queue_running"] >= 1
    s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        h = _health(server)
        if h["queue_depth"] == 0 and h["kv_blocks_used"] == h["kv_blocks_pinned"]:
            break
        time.sleep(0.1)
    assert h["queue_depth"] == 0 and h["kv_blocks_used"] == h["kv_blocks_pinned"], h
    assert h["cancellations"] >= 1


def test_session_pins_prompt_until_closed(server):
    cl = _client(server)
    msgs = [{"role": "system", "content": "You are a careful assistant. " * 30},
            {"role": "user", "content": "Say hi."}]
    before = _health(server)["kv_blocks_pinned"]
    a = cl.chat.completions.create(model="x", messages=msgs, max_tokens=2, temperature=0,
                                   extra_body={"session_id": "sess-e2e"})
    pinned = _health(server)["kv_blocks_pinned"]
    assert pinned >= before + a.usage.prompt_tokens // 16 - 1  # the prompt's full blocks
    b = cl.chat.completions.create(model="x", messages=msgs, max_tokens=2, temperature=0)
    assert b.usage.prompt_tokens_details.cached_tokens >= 16 * (a.usage.prompt_tokens // 16 - 1)
    status, _, raw = _raw(server, "POST", "/v1/sessions/sess-e2e/close")
    assert status == 200 and json.loads(raw)["closed"] is True
    deadline = time.monotonic() + 10
    while _health(server)["kv_blocks_pinned"] > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _health(server)["kv_blocks_pinned"] <= before


def test_event_log_replays_identical(server):
    """Runs last in this module: everything above went through the log."""
    time.sleep(0.3)  # the writer thread flushes every 50 ms
    out = subprocess.run(
        [sys.executable, "-m", "imp", "replay", str(server.event_log)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert "identical" in last
