"""The Responses dialect against the fake engine and store (no model): the official openai SDK's
responses.create / retrieve / delete / input_items, the event contract, tools (function, custom,
namespace, hosted), previous_response_id chains, store: false, refusals."""

from __future__ import annotations

import json

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from imp.config import ServerConfig
from imp.constrain.compile import GrammarCache
from imp.constrain.vocab import from_tokenizer
from imp.http.app import create_app
from tests.fake_engine import FakeEngine, Script, text_model


@pytest.fixture(scope="module")
def grammars():
    return GrammarCache(from_tokenizer(text_model().tokenizer))


@pytest.fixture
async def make(grammars):
    clients = []

    async def make(script=None, **kw):
        eng = FakeEngine(script, **kw)
        c = TestClient(TestServer(create_app(eng, eng.tm, ServerConfig(), grammars=grammars)))
        await c.start_server()
        c.engine = eng
        c.sdk = openai.AsyncOpenAI(base_url=str(c.make_url("/v1")), api_key="none", max_retries=0)
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.sdk.close()
        await c.close()


def pieces(text: str, n: int = 5) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)]


async def test_string_input_shape_and_usage(make):
    c = await make()
    r = await c.sdk.responses.create(model="fake-model", input="Say hello.", instructions="Be nice.")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.output_text == "Hello world!"
    (msg,) = r.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.content[0].type == "output_text"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens == len(c.engine.submissions[0].prompt)
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    prompt = c.engine.tm.tokenizer.decode(list(c.engine.submissions[0].prompt), skip_special=False)
    assert "Be nice." in prompt and "Say hello." in prompt


async def test_stream_event_contract(make):
    c = await make(Script(pieces=["<think>", "hmm", "</think>", "Hi", " there"]))
    seen = []
    async with c.sdk.responses.stream(model="m", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "hi"}]}]) as s:
        async for e in s:
            seen.append(e)
        final = await s.get_final_response()
    types = [e.type for e in seen]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert "response.reasoning_text.delta" in types and "response.output_text.delta" in types
    for t in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
              "response.content_part.done", "response.output_item.done"):
        assert t in types
    done_ids = [e.item.id for e in seen if e.type == "response.output_item.done"]
    assert done_ids == [it.id for it in final.output]  # the same ids in the stream and the final object
    assert [it.type for it in final.output] == ["reasoning", "message"] and final.output_text == "Hi there"
    text = (await (await c.post("/v1/responses", json={"model": "m", "input": "x", "stream": True})).read()).decode()
    assert "[DONE]" not in text and text.strip().split("\n\n")[-1].startswith("event: response.completed")


WEATHER = {"type": "function", "name": "get_weather", "description": "Weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


async def test_function_tool_round_trip(make):
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    c = await make(lambda sub: Script(pieces=pieces(call)) if len(c.engine.submissions) == 1 else
                   Script(pieces=pieces('{"response": "18 C and clear."}')))
    r = await c.sdk.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER], tool_choice="required")
    (fc,) = r.output
    assert fc.type == "function_call" and fc.call_id.startswith("call_") and json.loads(fc.arguments) == {"city": "Paris"}
    r2 = await c.sdk.responses.create(model="m", tools=[WEATHER], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": fc.call_id, "name": "get_weather", "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": '{"temp_c": 18}'}])
    assert r2.output_text == "18 C and clear."
    prompt = c.engine.tm.tokenizer.decode(list(c.engine.submissions[-1].prompt), skip_special=False)
    assert '"tool_response"' in prompt and "temp_c" in prompt


async def test_streamed_function_call_events(make):
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    c = await make(Script(pieces=pieces(call, 3)))
    events = []
    async with c.sdk.responses.stream(model="m", input="weather?", tools=[WEATHER], tool_choice="required") as s:
        async for e in s:
            events.append(e)
        final = await s.get_final_response()
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Oslo"} and final.output[0].call_id == added.item.call_id


async def test_previous_response_chain_of_three_retrieve_delete_and_store_false(make):
    c = await make()
    r1 = await c.sdk.responses.create(model="m", input="turn one")
    r2 = await c.sdk.responses.create(model="m", input="turn two", previous_response_id=r1.id)
    r3 = await c.sdk.responses.create(model="m", input="turn three", previous_response_id=r2.id)
    prompt = c.engine.tm.tokenizer.decode(list(c.engine.submissions[-1].prompt), skip_special=False)
    assert prompt.index("turn one") < prompt.index("turn two") < prompt.index("turn three")
    assert prompt.count("Hello world!") == 2  # both earlier answers are in the conversation
    got = await c.sdk.responses.retrieve(r3.id)
    assert got.id == r3.id and got.output_text == "Hello world!" and got.previous_response_id == r2.id
    items = await c.sdk.responses.input_items.list(r3.id)
    assert [it.content[0].text for it in items.data] == ["turn three"]
    await c.sdk.responses.delete(r2.id)
    with pytest.raises(openai.NotFoundError):
        await c.sdk.responses.retrieve(r2.id)
    with pytest.raises(openai.BadRequestError) as e:  # the chain through r2 is broken now
        await c.sdk.responses.create(model="m", input="turn four", previous_response_id=r3.id)
    assert e.value.body["code"] == "previous_response_not_found"
    r = await c.sdk.responses.create(model="m", input="unsaved", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        await c.sdk.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        await c.sdk.responses.create(model="m", input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"


async def test_a_failed_store_write_keeps_the_answer_and_says_store_false(make):
    c = await make()
    c.engine.store.fail_puts = True
    r = await c.sdk.responses.create(model="m", input="hi")
    assert r.status == "completed" and r.output_text == "Hello world!" and r.store is False


APPLY_PATCH_LARK = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?
hunk: add_hunk
add_hunk: "*** Add File: " filename LF add_line+
filename: /[a-z_]+\.txt/
add_line: "+" /[a-z ]{0,30}/ LF
%import common.LF
'''


async def test_codex_shaped_request_forced_custom_tool(make):
    patch = "*** Begin Patch\n*** Add File: notes.txt\n+hello world\n*** End Patch\n"
    c = await make(Script(pieces=pieces(patch, 6)))
    body = {
        "model": "m", "stream": True, "store": False, "include": ["reasoning.encrypted_content"],
        "reasoning": {"summary": "auto"}, "parallel_tool_calls": True, "prompt_cache_key": "conv-1",
        "instructions": "You are Codex.",
        "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "add notes.txt"}]}],
        "tools": [
            {"type": "custom", "name": "apply_patch", "description": "Edit files",
             "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_LARK}},
            {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {
                "cmd": {"type": "string"}}, "required": ["cmd"]}},
            {"type": "namespace", "name": "multi_agent_v1", "tools": [
                {"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}]},
            {"type": "web_search"},
        ],
        "tool_choice": {"type": "custom", "name": "apply_patch"},
    }
    r = await c.post("/v1/responses", json=body, headers={"session-id": "s1", "x-client-request-id": "abc"})
    text = (await r.read()).decode()
    assert r.status == 200, text
    sub = c.engine.submissions[-1]
    assert sub.params.constraint.kind == "lark" and "Begin Patch" in sub.params.constraint.source
    assert sub.session_id == "conv-1"  # prompt_cache_key: the prefix-cache affinity key
    events = [json.loads(b.split("\n")[1][6:]) for b in text.strip().split("\n\n")]
    final = events[-1]
    assert final["type"] == "response.completed"
    (item,) = final["response"]["output"]
    assert item["type"] == "custom_tool_call" and item["name"] == "apply_patch" and item["input"] == patch
    assert any(e["type"] == "response.custom_tool_call_input.delta" for e in events)
    import llguidance

    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", APPLY_PATCH_LARK)) == ""


async def test_namespaced_call_carries_its_namespace(make):
    call = '{"tool_calls": [{"name": "spawn_agent", "arguments": {}}]}'
    c = await make(Script(pieces=pieces(call)))
    tools = [{"type": "namespace", "name": "multi_agent_v1", "tools": [
        {"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}]}]
    r = await c.post("/v1/responses", json={"model": "m", "input": "go", "tools": tools, "tool_choice": "required"})
    out = (await r.json())["output"]
    assert out[0]["type"] == "function_call" and out[0]["namespace"] == "multi_agent_v1"


@pytest.mark.parametrize("body,param", [
    ({"input": "x"}, "model"),
    ({"model": "m"}, "input"),
    ({"model": "m", "input": ""}, "input"),
    ({"model": "m", "input": []}, "input"),
    ({"model": "m", "input": "x", "tools": [{"type": "teleport"}]}, "tools[0].type"),
    ({"model": "m", "input": [{"type": "message", "role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "m", "input": "x", "background": True}, "background"),
    ({"model": "m", "input": "x", "conversation": "conv_1"}, "conversation"),
    ({"model": "m", "input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"model": "m", "input": "x", "truncation": "auto"}, "truncation"),
    ({"model": "m", "input": "x", "top_logprobs": 3}, "top_logprobs"),
    ({"model": "m", "input": "x", "max_tool_calls": 2}, "max_tool_calls"),
])
async def test_errors_in_the_openai_shape_with_param(make, body, param):
    c = await make()
    r = await c.post("/v1/responses", json=body)
    err = (await r.json())["error"]
    assert r.status == 400 and err["param"] == param and err["type"] == "invalid_request_error", err


async def test_text_format_json_schema_reaches_the_engine(make):
    c = await make(Script(pieces=['{"a": 1}']))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = await c.sdk.responses.create(model="m", input="x", text={"format": {"type": "json_schema", "name": "t",
                                                                            "schema": schema, "strict": True}})
    assert json.loads(r.output_text) == {"a": 1}
    assert c.engine.submissions[-1].params.constraint.kind == "json_schema"


@pytest.mark.parametrize("capture", ["codex_request.json", "codex_tool_output_request.json"])
async def test_the_real_codex_requests_stream_a_response(make, capture):
    """The bodies the real Codex CLI sent (captured by bench/capture_proxy.py: its ~20 tools,
    namespaced agents, hosted web_search, reasoning, store false, include, prompt_cache_key; the
    second with function_call / function_call_output history) stream to response.completed."""
    from pathlib import Path

    cap = json.loads((Path(__file__).parent / "data" / capture).read_text())
    c = await make(Script(pieces=pieces('{"response": "Hi!"}', 5)), context_length=131072)  # a byte-level fake tokenizer
    r = await c.post("/v1/responses", json=dict(cap["body"], model="m"))
    text = (await r.read()).decode()
    assert r.status == 200, text
    types = [b.split("\n")[0][7:] for b in text.strip().split("\n\n")]
    assert types[0] == "response.created" and types[-1] == "response.completed", types
    sub = c.engine.submissions[-1]
    assert sub.session_id == cap["body"]["prompt_cache_key"]
