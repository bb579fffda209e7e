"""Tools and structured outputs through the dialects, against the fake engine (no model).

What crosses the port (the grammar a forced call runs under), how a model's
text comes back as OpenAI `tool_calls` / Anthropic `tool_use` blocks, streamed
and not, the refusals (an unenforceable choice, a hostile schema, two
constraints at once), and Claude Code's request shape accepted whole.
"""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import pytest
from aiohttp.test_utils import TestClient, TestServer

from imp.config import ServerConfig
from imp.constrain.compile import GrammarCache
from imp.constrain.vocab import from_tokenizer
from imp.http.app import create_app
from tests.fake_engine import FakeEngine, Script, text_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}'


@pytest.fixture(scope="module")
def grammars():
    tm = text_model()
    return GrammarCache(from_tokenizer(tm.tokenizer))


@pytest.fixture
async def make(grammars):
    clients = []

    async def make(pieces=None, **kw):
        eng = FakeEngine(Script(pieces=pieces) if pieces is not None else None, **kw)
        c = TestClient(TestServer(create_app(eng, eng.tm, ServerConfig(), grammars=grammars)))
        await c.start_server()
        c.engine = eng
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


def chunks_of(text: str, n: int = 7) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)]


async def sse(resp) -> list[dict]:
    out = []
    for line in (await resp.read()).decode().split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


async def test_forced_call_runs_under_a_grammar_and_comes_back_as_tool_calls(make):
    c = await make(chunks_of(CALL))
    body = {"model": "m", "messages": MSGS, "tools": [WEATHER], "tool_choice": "required"}
    r = await c.post("/v1/chat/completions", json=body)
    out = await r.json()
    assert r.status == 200, out
    sub = c.engine.submissions[-1]
    assert sub.params.constraint is not None and sub.params.constraint.kind == "lark"
    assert "get_weather" in sub.params.constraint.source
    prompt_text = c.engine.tm.tokenizer.decode(list(sub.prompt), skip_special=False)
    assert "get_weather" in prompt_text and '{"tool_call":' in prompt_text  # the tools, in the system prompt
    ch = out["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
    (call,) = ch["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    jsonschema.validate(args, WEATHER["function"]["parameters"])


async def test_streamed_call_follows_openai_conventions_and_equals_the_whole(make):
    c = await make(chunks_of(CALL, 3))
    body = {"model": "m", "messages": MSGS, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                                 "function": {"name": "get_weather"}}}
    whole = (await (await c.post("/v1/chat/completions", json=body)).json())["choices"][0]["message"]
    events = await sse(await c.post("/v1/chat/completions", json=dict(body, stream=True)))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    first = calls[0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(tc["function"].get("arguments", "") for tc in calls)
    assert json.loads(args) == json.loads(whole["tool_calls"][0]["function"]["arguments"])
    assert not any(d.get("content") for d in deltas)  # no markup leaks into content
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]] \
        == ["tool_calls"]


async def test_auto_in_the_generic_shape_answers_text_through_the_envelope(make):
    c = await make(chunks_of('{"response": "It is sunny \\u2600 today."}', 4))
    body = {"model": "m", "messages": MSGS, "tools": [WEATHER]}
    out = await (await c.post("/v1/chat/completions", json=body)).json()
    msg = out["choices"][0]["message"]
    assert msg["content"] == "It is sunny \u2600 today." and "tool_calls" not in msg
    assert out["choices"][0]["finish_reason"] == "stop"
    assert c.engine.submissions[-1].params.constraint.kind == "lark"  # auto is forced into the envelope
    events = await sse(await c.post("/v1/chat/completions", json=dict(body, stream=True)))
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert text == "It is sunny \u2600 today."


async def test_tool_choice_none_hides_the_tools(make):
    c = await make(["plain ", "text"])
    out = await (await c.post("/v1/chat/completions", json={"model": "m", "messages": MSGS, "tools": [WEATHER],
                                                              "tool_choice": "none"})).json()
    sub = c.engine.submissions[-1]
    assert sub.params.constraint is None
    assert "get_weather" not in c.engine.tm.tokenizer.decode(list(sub.prompt), skip_special=False)
    assert out["choices"][0]["message"]["content"] == "plain text"


async def test_tool_loop_history_is_shown_in_the_models_own_shape(make):
    c = await make(chunks_of('{"response": "18 C in Paris."}'))
    msgs = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    out = await (await c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "tools": [WEATHER]})).json()
    assert out["choices"][0]["message"]["content"] == "18 C in Paris."
    prompt = c.engine.tm.tokenizer.decode(list(c.engine.submissions[-1].prompt), skip_special=False)
    assert '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}' in prompt
    assert '"tool_response"' in prompt and "18 C" in prompt


@pytest.mark.parametrize("body,param,code", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", None),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "tool_choice_unenforceable"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     None),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", None),
    ({"audio": {"voice": "alloy"}}, "audio", "unsupported_parameter"),
])
async def test_refusals_name_the_field(make, body, param, code):
    c = await make()
    r = await c.post("/v1/chat/completions", json={"model": "m", "messages": MSGS, **body})
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == param, err
    if code:
        assert err["code"] == code
    assert not c.engine.submissions


def _nested_one_of(depth: int) -> dict:
    s = {"type": "string"}
    for _ in range(depth):
        s = {"oneOf": [{"type": "object", "properties": {"a": s, "b": s}}, {"type": "array", "items": s}]}
    return s


@pytest.mark.parametrize("schema", [
    _nested_one_of(8),
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 10**9}}},
    {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}},
], ids=["oneOf-8-deep", "maxLength-1e9", "5000-properties"])
async def test_pathological_schemas_are_400_fast_and_the_server_keeps_serving(make, schema):
    c = await make()
    body = {"model": "m", "messages": MSGS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    t0 = time.monotonic()
    health = asyncio.create_task(c.get("/health"))
    r = await c.post("/v1/chat/completions", json=body)
    took = time.monotonic() - t0
    err = (await r.json())["error"]
    assert r.status == 400 and err["code"] == "invalid_constraint" and err["param"] == "response_format"
    assert took < 2.0, took
    assert (await health).status == 200
    ok = await c.post("/v1/chat/completions", json={"model": "m", "messages": MSGS})
    assert ok.status == 200


async def test_every_structured_spelling_reaches_the_engine(make):
    c = await make(['{"a": 1}'])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}},
         "json_schema"),
        ({"json_schema": schema}, "json_schema"),
        ({"grammar": 'root ::= "yes" | "no"'}, "gbnf"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "regex"),
        ({"guided_json": schema}, "json_schema"),
        ({"guided_regex": "[0-9]{3}"}, "regex"),
    ]
    for extra, kind in cases:
        r = await c.post("/v1/chat/completions", json={"model": "m", "messages": MSGS, **extra})
        assert r.status == 200, (extra, await r.text())
        assert c.engine.submissions[-1].params.constraint.kind == kind, extra
    r = await c.post("/v1/completions", json={"model": "m", "prompt": "x", "guided_regex": "[0-9]+"})
    assert r.status == 200 and c.engine.submissions[-1].params.constraint.kind == "regex"


# --------------------------------------------------------------------------- Anthropic

A_TOOL = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"],
          "cache_control": {"type": "ephemeral"}}


async def test_anthropic_forced_tool_use_block_and_stream(make):
    c = await make(chunks_of('{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}', 5))
    body = {"model": "m", "max_tokens": 400, "messages": MSGS, "tools": [A_TOOL],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}}
    out = await (await c.post("/v1/messages", json=body)).json()
    assert out["stop_reason"] == "tool_use", out
    (blk,) = out["content"]
    assert blk["type"] == "tool_use" and blk["id"].startswith("toolu_") and blk["input"] == {"city": "Oslo"}
    r = await c.post("/v1/messages", json=dict(body, stream=True))
    text = (await r.read()).decode()
    events = [(b.split("\n")[0][7:], json.loads(b.split("\n")[1][6:])) for b in text.strip().split("\n\n")]
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert starts == [{"type": "tool_use", "id": starts[0]["id"], "name": "get_weather", "input": {}}]
    partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert json.loads(partial) == {"city": "Oslo"}
    assert all(d["delta"]["type"] == "input_json_delta" for n, d in events if n == "content_block_delta")
    assert [d["delta"]["stop_reason"] for n, d in events if n == "message_delta"] == ["tool_use"]


async def test_claude_code_request_shape_is_accepted(make):
    """What Claude Code 2.x sends: beta query + headers, system blocks with cache_control,
    system-role messages inside messages, adaptive thinking, context management, effort,
    32k max_tokens (clamped to the context), metadata.user_id, tools with cache_control."""
    c = await make(chunks_of('{"response": "Done."}'), context_length=4096)
    body = {
        "model": "gemma-3-270m", "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "The date is today."},
            {"role": "user", "content": "list files"},
        ],
        "tools": [A_TOOL, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_abc_account__session_x"},
    }
    r = await c.post("/v1/messages?beta=true", json=body, headers={
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
        "anthropic-version": "2023-06-01"})
    text = (await r.read()).decode()
    assert r.status == 200, text
    assert "event: message_stop" in text and "Done." in text
    sub = c.engine.submissions[-1]
    assert sub.params.max_tokens == 4096 - len(sub.prompt)  # clamped to the context, not refused
    prompt = c.engine.tm.tokenizer.decode(list(sub.prompt), skip_special=False)
    assert "The date is today." in prompt and "web_search" not in prompt
    assert (await c.head("/")).status == 200  # the probe it sends first


async def test_a_call_envelope_cut_by_max_tokens_keeps_its_complete_calls(make, grammars):
    from imp.messages import FinishReason

    cut = ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
           '{"name": "get_weather", "arguments": {"city": "Lyon"}}, {"name": "get_wea')
    eng = FakeEngine(Script(pieces=chunks_of(cut, 5), finish=FinishReason.LENGTH))
    c = TestClient(TestServer(create_app(eng, eng.tm, ServerConfig(), grammars=grammars)))
    await c.start_server()
    try:
        body = {"model": "m", "messages": MSGS, "tools": [WEATHER], "tool_choice": "required"}
        ch = (await (await c.post("/v1/chat/completions", json=body)).json())["choices"][0]
        assert ch["finish_reason"] == "length" and ch["message"]["content"] is None
        assert [json.loads(t["function"]["arguments"])["city"] for t in ch["message"]["tool_calls"]] == ["Paris", "Lyon"]
        events = await sse(await c.post("/v1/chat/completions", json=dict(body, stream=True)))
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        assert not any(d.get("content") for d in deltas)  # the cut envelope never shows as text
        names = [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", []) if "id" in tc]
        assert names == ["get_weather", "get_weather"]
    finally:
        await c.close()


@pytest.mark.parametrize("cut", ['{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par',
                                 '{"tool_call": {"name": "get_we', '{"tool_'])
async def test_a_reply_cut_inside_its_first_call_shows_no_envelope_text(grammars, cut):
    """Cut before any call completed: no call, and the envelope JSON never becomes the answer's
    text (Codex showed it as the agent's message) in any dialect, streamed or not; the
    finish reason says why it is empty. Responses marks the message item incomplete."""
    from imp.messages import FinishReason

    eng = FakeEngine(Script(pieces=chunks_of(cut, 4), finish=FinishReason.LENGTH))
    c = TestClient(TestServer(create_app(eng, eng.tm, ServerConfig(), grammars=grammars)))
    await c.start_server()
    try:
        await _cut_in_every_dialect(c)
    finally:
        await c.close()


async def _cut_in_every_dialect(c):
    chat = {"model": "m", "messages": MSGS, "tools": [WEATHER], "tool_choice": "auto"}
    ch = (await (await c.post("/v1/chat/completions", json=chat)).json())["choices"][0]
    assert ch["finish_reason"] == "length" and not ch["message"].get("content") and not ch["message"].get("tool_calls")
    events = await sse(await c.post("/v1/chat/completions", json=dict(chat, stream=True)))
    assert not any(e["choices"][0]["delta"].get("content") for e in events if e["choices"])
    tool = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER["function"]["parameters"]}
    msg = {"model": "m", "max_tokens": 50, "messages": MSGS, "tools": [tool]}
    m = await (await c.post("/v1/messages", json=msg)).json()
    assert m["stop_reason"] == "max_tokens" and all(not b.get("text") for b in m["content"]), m
    raw = (await (await c.post("/v1/messages", json=dict(msg, stream=True))).read()).decode()
    assert "tool_call" not in raw and "text_delta" not in raw
    rtool = {"type": "function", **WEATHER["function"]}
    r = await (await c.post("/v1/responses", json={"model": "m", "input": "Hi", "tools": [rtool]})).json()
    assert r["status"] == "incomplete", r
    assert all(it["status"] == "incomplete" for it in r["output"] if it["type"] == "message"), r["output"]
    assert "tool_call" not in json.dumps([it.get("content") for it in r["output"]])
    raw = (await (await c.post("/v1/responses", json={"model": "m", "input": "Hi", "tools": [rtool],
                                                       "stream": True})).read()).decode()
    assert "response.output_text.delta" not in raw and '\\"tool_' not in raw and "response.incomplete" in raw


async def test_after_a_tool_round_auto_in_the_generic_shape_must_answer(make):
    """A model with no tool format of its own, shown its call and the result, would call again
    forever: after GENERIC_TOOL_ROUNDS rounds since the user spoke, auto is answer-only."""
    c = await make(chunks_of('{"response": "18 C."}'))
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    await c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "tools": [WEATHER]})
    g = c.engine.submissions[-1].params.constraint.source
    assert '"{\\"response\\": "' in g and "tool_call" not in g
    await c.post("/v1/chat/completions", json={"model": "m", "messages": MSGS, "tools": [WEATHER]})
    assert "tool_call" in c.engine.submissions[-1].params.constraint.source  # a fresh user turn may call
    r = await c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "tools": [WEATHER],
                                                   "tool_choice": "required"})
    assert r.status == 200 and "tool_call" in c.engine.submissions[-1].params.constraint.source
