"""The Anthropic Messages dialect (/v1/messages, /v1/messages/count_tokens)
through the official anthropic SDK, against the one shared real server
(tests/conftest.py `imp_server`).

This SDK version no longer lists temperature among create()'s arguments;
it travels in extra_body, exactly as it reaches the wire.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def cl(imp_server):
    import anthropic

    return anthropic.Anthropic(base_url=imp_server.url, api_key="x", max_retries=0, timeout=120)


def create(cl, **kw):
    kw.setdefault("model", "x")
    kw.setdefault("max_tokens", 12)
    kw.setdefault("messages", ASK)
    kw.setdefault("extra_body", GREEDY)
    return cl.messages.create(**kw)


def texts(msg) -> list[tuple[str, str]]:
    return [(b.type, b.text if b.type == "text" else b.thinking) for b in msg.content]


def test_non_stream_shape(cl, imp_server):
    raw = cl.messages.with_raw_response.create(model="x", max_tokens=12, messages=ASK, extra_body=GREEDY)
    m = raw.parse()
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model and m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    # Not "Paris": HF's top-2 margin on the first token is 0.08 and the file's Q4_1 blocks as
    # llama.cpp reads them (our fused kernels do the same) answer "L'Étoile, la Marseillaise,".
    assert [b.type for b in m.content] == ["text"] and m.content[0].text.strip()
    u = m.usage
    assert u.output_tokens > 0 and u.cache_creation_input_tokens == 0
    n = cl.messages.count_tokens(model="x", messages=ASK).input_tokens
    assert u.input_tokens + u.cache_read_input_tokens == n > 0
    assert raw.headers["request-id"] and raw.headers["anthropic-version"]  # the SDK sends one; echoed


def test_stream_equals_non_stream(cl):
    whole = create(cl, max_tokens=16)
    with cl.messages.stream(model="x", max_tokens=16, messages=ASK, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text
    assert texts(final) == texts(whole)
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stream_event_order_and_headers(imp_server):
    body = {"model": "x", "max_tokens": 4, "stream": True, "messages": ASK, **GREEDY}
    req = urllib.request.Request(imp_server.url + "/v1/messages", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "anthropic-version": "2023-06-01",
                                          "anthropic-beta": "some-beta-2025"})
    with urllib.request.urlopen(req, timeout=60) as r:
        headers, raw = dict(r.headers), r.read().decode()
    assert headers["request-id"] and headers["anthropic-version"] == "2023-06-01"
    assert headers["anthropic-beta"] == "some-beta-2025"
    events = [line[7:] for line in raw.splitlines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) == {"content_block_delta"}
    delta = json.loads(next(line for line in raw.splitlines() if '"message_delta"' in line)[6:])
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4


def test_stop_sequences(cl):
    base = create(cl, max_tokens=16).content[0].text
    words = base.split()
    assert len(words) >= 3, base
    m = create(cl, max_tokens=16, stop_sequences=["zzz-never", words[2]])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == words[2]
    assert m.content[0].text == base[: base.index(words[2])]
    with cl.messages.stream(model="x", max_tokens=16, messages=ASK, stop_sequences=[words[2]], extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", words[2])


def test_max_tokens_stop_reason(cl):
    m = create(cl, max_tokens=2)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 2 and m.stop_sequence is None


def test_system_prompt(cl):
    plain = cl.messages.count_tokens(model="x", messages=ASK).input_tokens
    sys_s = cl.messages.count_tokens(model="x", messages=ASK, system="You are a terse geography tutor.").input_tokens
    sys_b = cl.messages.count_tokens(model="x", messages=ASK, system=[
        {"type": "text", "text": "You are a terse geography tutor.", "cache_control": {"type": "ephemeral"}}]).input_tokens
    assert sys_s == sys_b and sys_s != plain
    m = create(cl, system="You are a terse geography tutor.")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == sys_s


def test_prefill_continues_the_assistant_turn(cl):
    msgs = ASK + [{"role": "assistant", "content": "The capital of France is"}]
    m = create(cl, messages=msgs)
    assert m.content[0].text.strip().startswith("Paris")
    assert not m.content[0].text.startswith("The capital")  # only the new text
    with cl.messages.stream(model="x", max_tokens=12, messages=msgs, extra_body=GREEDY) as s:
        assert texts(s.get_final_message()) == texts(m)


def test_thinking_block_from_think_prefill(cl):
    msgs = ASK + [{"role": "assistant", "content": "<think>Let me recall"}]
    m = create(cl, messages=msgs, max_tokens=10, thinking={"type": "enabled", "budget_tokens": 1024})
    assert m.content[0].type == "thinking" and m.content[0].thinking and "<think>" not in m.content[0].thinking
    with cl.messages.stream(model="x", max_tokens=10, messages=msgs, extra_body=GREEDY) as s:
        assert texts(s.get_final_message()) == texts(m)


def test_tools_and_tool_blocks_render(cl):
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    msgs = ASK + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                          {"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": "tu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu_1",
                                      "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "And now?"}]},
    ]
    m = create(cl, messages=msgs, tools=tools, tool_choice={"type": "auto"}, max_tokens=4,
               metadata={"user_id": "u1"})
    assert m.stop_reason in ("end_turn", "max_tokens")
    n = cl.messages.count_tokens(model="x", messages=msgs, tools=tools).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n


def test_count_tokens(cl):
    a = cl.messages.count_tokens(model="x", messages=ASK).input_tokens
    b = cl.messages.count_tokens(model="x", messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is the capital of France?"}]}]).input_tokens
    longer = cl.messages.count_tokens(model="x", messages=[{"role": "user", "content": ASK[0]["content"] * 3}])
    assert a == b > 0 and longer.input_tokens > a


_MSG = {"role": "user", "content": "Hi"}
BAD = [
    ({"max_tokens": 4, "messages": [_MSG]}, "model"),
    ({"model": "x", "messages": [_MSG]}, "max_tokens"),
    ({"model": "x", "max_tokens": 0, "messages": [_MSG]}, "max_tokens"),
    ({"model": "x", "max_tokens": "4", "messages": [_MSG]}, "max_tokens"),
    ({"model": "x", "max_tokens": 4}, "messages"),
    ({"model": "x", "max_tokens": 4, "messages": []}, "messages"),
    ({"model": "x", "max_tokens": 4, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "x", "max_tokens": 4, "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]}, "text-only"),
    ({"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}, "text-only"),
    ({"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages[0].content[0]"),
    ({"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, "messages[0].content[0]"),
    ({"model": "x", "max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": "x"}]}]}, "messages[0].content[0].input"),
    ({"model": "x", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "a", "content": [{"type": "image"}]}]}]}, "text-only"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "temperature": 1.5}, "temperature"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "temperature": "hot"}, "temperature"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "top_p": 0}, "top_p"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "top_k": -1}, "top_k"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "stop_sequences": "x"}, "stop_sequences"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "stop_sequences": [1]}, "stop_sequences"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "stream": "yes"}, "stream"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "system": 5}, "system"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "system": [{"type": "image"}]}, "text-only"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "metadata": "u"}, "metadata"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "tools": {}}, "tools"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "tool_choice": {"type": "bogus"}}, "tool_choice"),
    ({"model": "x", "max_tokens": 4, "messages": [_MSG], "thinking": {"type": "on"}}, "thinking"),
]


@pytest.mark.parametrize("body,names", BAD, ids=[f"{i}-{n}" for i, (_, n) in enumerate(BAD)])
def test_bad_inputs_are_400_in_anthropic_shape(cl, body, names):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as ei:
        cl.post("/v1/messages", body=body, cast_to=object)
    e = ei.value
    assert e.status_code == 400 and names in e.body["error"]["message"], e.body
    assert e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error"
    assert e.body["request_id"] == e.response.headers["request-id"]


def test_count_tokens_bad_input_and_non_json(cl, imp_server):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as ei:
        cl.messages.count_tokens(model="x", messages=[{"role": "user", "content": [{"type": "image"}]}])
    assert "text-only" in ei.value.body["error"]["message"]
    surrogate = b'{"model": "x", "max_tokens": 3, "messages": [{"role": "user", "content": "\\ud800 hi"}]}'
    for data in (b"{nope", b"[" * 100_000, surrogate):
        req = urllib.request.Request(imp_server.url + "/v1/messages", data=data, method="POST",
                                     headers={"X-Request-Id": "client-7"})
        with pytest.raises(urllib.error.HTTPError) as he:
            urllib.request.urlopen(req, timeout=30)
        body = json.loads(he.value.read())
        assert he.value.code == 400 and body["type"] == "error" and body["request_id"] == "client-7"
        assert body["error"]["type"] == "invalid_request_error"
        assert he.value.headers["request-id"] == "client-7"


def test_stream_disconnect_cancels(imp_server):
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", imp_server.port, timeout=60)
    body = {"model": "x", "max_tokens": 2000, "stream": True, "messages": ASK, "ignore_eos": True}
    conn.request("POST", "/v1/messages", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    while b"content_block_delta" not in r.readline():
        pass
    conn.close()  # gone mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with urllib.request.urlopen(imp_server.url + "/health", timeout=5) as h:
            if json.loads(h.read())["queue_running"] == 0:
                return
        time.sleep(0.2)
    pytest.fail("the request kept running after its client left")


def test_cache_control_breakpoints_count_creation_then_reads_and_pin_the_prefix(cl, imp_server):
    """cache_control per breakpoint: the first request writes the marked region (its full blocks) and says so
    in cache_creation_input_tokens; the next reads it (cache_read_input_tokens) and creates nothing; the
    three parts add up to the prompt; the region's blocks are pinned after the request; a breakpoint on the
    system prompt only pins less than one on the last message."""
    nonce = f"{time.time_ns()}"
    system = [{"type": "text", "text": f"Session {nonce}. " + " ".join(f"Rule {i}: mind topic {i}." for i in range(50)),
               "cache_control": {"type": "ephemeral"}}]
    msgs = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
            {"role": "user", "content": [{"type": "text", "text": "Tell me a fact.",
                                          "cache_control": {"type": "ephemeral"}}]}]
    health = lambda: json.loads(urllib.request.urlopen(imp_server.url + "/health", timeout=30).read())  # noqa: E731
    pinned0 = health()["kv_blocks_pinned"]
    first = create(cl, max_tokens=4, system=system, messages=msgs).usage
    second = create(cl, max_tokens=4, system=system, messages=msgs).usage
    total = first.input_tokens + first.cache_creation_input_tokens + first.cache_read_input_tokens
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens > 0
    assert first.cache_creation_input_tokens % 16 == 0 and first.input_tokens < 16  # the region: all full blocks
    assert second.cache_read_input_tokens == first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens == 0
    assert second.input_tokens + second.cache_read_input_tokens == total
    assert health()["kv_blocks_pinned"] >= pinned0 + first.cache_creation_input_tokens // 16
    only_system = [msgs[0], msgs[1], {"role": "user", "content": "Another fact."}]
    third = create(cl, max_tokens=4, system=[dict(system[0], text=system[0]["text"] + " v2")],
                   messages=only_system).usage
    assert 0 < third.cache_creation_input_tokens < first.cache_creation_input_tokens  # through the system prompt
