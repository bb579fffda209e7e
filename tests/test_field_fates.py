"""Every request field has a fate (imp.http.pipeline.fates), on every dialect, against a fake engine.

A field the dialect takes is honoured or refused by the dialect itself (the dialect tests
cover each); a field of imp's API reference not implemented yet is a 400 naming it unless
its value turns the feature off; a field no one defines is reported (the imp-ignored-fields
header, one log line per field and client, the imp_ignored_fields_total metric) or, under
--strict-fields, a 400 in the dialect's words. What real clients send is never reported:
the captured Claude Code and Codex requests, and the official SDKs with every parameter.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from imp.config import ServerConfig
from imp.constrain.compile import GrammarCache
from imp.constrain.vocab import from_tokenizer
from imp.http.pipeline.fates import NOT_YET, TUNING
from tests.fake_engine import fake_client, text_model

MSGS = [{"role": "user", "content": "Say hello."}]
BODIES = {
    "/v1/chat/completions": {"model": "m", "messages": MSGS},
    "/v1/completions": {"model": "m", "prompt": "Hello"},
    "/v1/messages": {"model": "m", "max_tokens": 16, "messages": MSGS},
    "/v1/responses": {"model": "m", "input": "Hello", "store": False},
}
# a value that switches each unimplemented feature on, and one that leaves it off
ON = {"dry_multiplier": 0.8, "mirostat": 2, "banned_strings": ["Paris"], "banned_regex": ["P.*s"], "cfg_scale": 1.5,
      "logit_lens": True}
OFF = {"dry_multiplier": 0, "mirostat": 0, "banned_strings": [], "banned_regex": [], "cfg_scale": 1,
       "logit_lens": False}


@pytest.fixture
async def make():
    clients = []

    async def make(strict: bool = False, **kw):
        grammars = GrammarCache(from_tokenizer(text_model().tokenizer))  # the agents' tool calls need it
        c = await fake_client(config=ServerConfig(strict_fields=strict), grammars=grammars, **kw)
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


def test_the_reference_fields_are_listed_once():
    assert set(ON) == set(OFF) == set(NOT_YET)
    assert not TUNING & set(NOT_YET)


@pytest.mark.parametrize("path", list(BODIES))
async def test_an_unknown_field_is_reported_logged_once_and_counted(make, path, caplog, monkeypatch):
    from imp.http.pipeline import fates

    monkeypatch.setattr(fates, "_said", set())  # once per field and client in this process: start afresh
    c = await make()
    caplog.set_level(logging.WARNING, logger="imp.http")
    for _ in range(2):
        r = await c.post(path, json=dict(BODIES[path], frobnicate=1, **{"x y": 2}))
        assert r.status == 200, await r.text()
        assert r.headers["imp-ignored-fields"] == "frobnicate, other"  # a name that is not a label: "other"
        await r.read()
    said = [rec for rec in caplog.records if "frobnicate" in rec.getMessage()]
    assert len(said) == 1  # once per field and client, not per request
    assert c.engine.reports[-1].ignored_fields == ("frobnicate", "other")
    r = await c.post(path, json=BODIES[path])
    assert r.status == 200 and "imp-ignored-fields" not in r.headers
    assert c.engine.reports[-1].ignored_fields == ()


@pytest.mark.parametrize("path", list(BODIES))
async def test_strict_fields_refuses_an_unknown_field_in_the_dialects_words(make, path):
    c = await make(strict=True)
    r = await c.post(path, json=dict(BODIES[path], frobnicate=1))
    body = await r.json()
    assert r.status == 400, body
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["message"] == "frobnicate: Extra inputs are not permitted"
    else:
        assert body["error"]["message"] == "Unrecognized request argument supplied: frobnicate"
        assert body["error"]["param"] == "frobnicate"
    assert not c.engine.submissions  # nothing ran
    r = await c.post(path, json=BODIES[path])  # a body of known fields still runs
    assert r.status == 200


_OPENAI = ("/v1/chat/completions", "/v1/completions")
HONOURED = {"dry_multiplier": _OPENAI, "mirostat": _OPENAI, "banned_strings": _OPENAI,  # routes that implement it
            "banned_regex": _OPENAI, "logit_lens": ("/v1/chat/completions",), "cfg_scale": ("/v1/chat/completions",)}


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("name", sorted(NOT_YET))
async def test_a_reference_field_not_implemented_yet_is_a_400_naming_it(make, path, name):
    c = await make()
    with_ = {"cfg_negative_prompt": "Answer badly."} if name == "cfg_scale" else {}  # what guidance needs
    r = await c.post(path, json=dict(BODIES[path], **{name: ON[name]}, **with_))
    body = await r.json()
    if path in HONOURED.get(name, ()):
        assert r.status == 200, body
        return
    assert r.status == 400, body
    err = body["error"]
    code = "unsupported_parameter" if name in HONOURED else "not_implemented"
    assert name in err["message"] and ("not implemented" in err["message"] or code != "not_implemented")
    if path != "/v1/messages":
        assert err["param"] == name and err["code"] == code
    # the value that turns it off is what this server does: honoured, not reported
    r = await c.post(path, json=dict(BODIES[path], **{name: OFF[name]}, dry_base=1.75, mirostat_tau=5.0))
    assert r.status == 200, await r.text()
    assert "imp-ignored-fields" not in r.headers


async def test_banned_strings_reach_the_engine(make):
    """The issue's case: banned_strings was dropped without a word; now the engine gets it (the rewind itself:
    tests/test_banned.py, and on the real model tests/test_server_api.py)."""
    c = await make()
    r = await c.post("/v1/chat/completions", json={
        "model": "m", "temperature": 0, "banned_strings": ["Paris"], "banned_regex": ["Lyon|Nice"],
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]})
    assert r.status == 200, await r.text()
    p = c.engine.submissions[-1].params
    assert p.banned_strings == ("Paris",) and p.banned_regex == ("Lyon|Nice",)


@pytest.mark.parametrize("capture", ["claude_code_request.json", "claude_code_tool_result_request.json",
                                     "codex_request.json", "codex_tool_output_request.json"])
async def test_the_real_agent_clients_are_not_reported(make, capture):
    cap = json.loads((Path(__file__).parent / "data" / capture).read_text())
    c = await make(strict=True, context_length=131072)  # strict: a reported field would be a 400
    r = await c.post(cap["path"], json=dict(cap["body"], model="m"))
    assert r.status == 200, await r.text()
    assert "imp-ignored-fields" not in r.headers


async def test_the_openai_sdk_with_every_chat_and_completions_parameter(make):
    openai = pytest.importorskip("openai")
    c = await make(strict=True)
    sdk = openai.AsyncOpenAI(base_url=str(c.make_url("/v1")), api_key="x", max_retries=0)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    r = await sdk.chat.completions.with_raw_response.create(
        model="m", messages=MSGS, frequency_penalty=0.1, logit_bias={"5": 1}, logprobs=True, top_logprobs=2,
        max_completion_tokens=8, max_tokens=8, metadata={"k": "v"}, modalities=["text"], n=1,
        parallel_tool_calls=False, presence_penalty=0.1, prompt_cache_key="conv-1",
        prompt_cache_options={"mode": "implicit"}, prompt_cache_retention="24h", reasoning_effort="low",
        response_format={"type": "text"}, safety_identifier="u1", seed=1, service_tier="auto", stop=["\n\n"],
        store=False, stream=False, temperature=0.5, tool_choice="auto", tools=[tool], top_p=0.9, user="u1",
        verbosity="low")
    assert r.http_response.status_code == 200 and "imp-ignored-fields" not in r.headers
    r = await sdk.chat.completions.with_raw_response.create(
        model="m", messages=MSGS, functions=[tool["function"]], function_call="auto", stream=True,
        stream_options={"include_usage": True})
    assert "imp-ignored-fields" not in r.headers
    for name, value in (("audio", {"voice": "alloy", "format": "wav"}),
                        ("prediction", {"type": "content", "content": "x"}), ("web_search_options", {}),
                        ("moderation", {"model": "omni-moderation-latest"})):
        with pytest.raises(openai.BadRequestError) as ei:  # refused by the dialect, naming it
            await sdk.chat.completions.create(model="m", messages=MSGS, **{name: value})
        assert ei.value.body["param"] == name
    r = await sdk.completions.with_raw_response.create(
        model="m", prompt="Hi", best_of=1, echo=False, frequency_penalty=0.1, logit_bias={"5": 1}, logprobs=1,
        max_tokens=8, n=1, presence_penalty=0.1, seed=1, stop=["\n"], stream=False, suffix=None, temperature=0.5,
        top_p=0.9, user="u1")
    assert r.http_response.status_code == 200 and "imp-ignored-fields" not in r.headers


async def test_the_openai_sdk_with_every_responses_parameter(make):
    openai = pytest.importorskip("openai")
    c = await make(strict=True)
    sdk = openai.AsyncOpenAI(base_url=str(c.make_url("/v1")), api_key="x", max_retries=0)
    r = await sdk.responses.with_raw_response.create(
        model="m", input="Hello", access_programs={"cyber": "standard"}, background=False, background_options={},
        context_management=[{"type": "compaction", "compact_threshold": 1000}], image={"context_compression": "auto"},
        include=["reasoning.encrypted_content"], instructions="Be brief.", max_output_tokens=16,
        metadata={"k": "v"}, parallel_tool_calls=False, prompt_cache_key="c1", prompt_cache_options={"mode": "implicit"},
        prompt_cache_retention="24h", reasoning={"effort": "low"}, safety_identifier="u", service_tier="auto",
        store=False, stream=False, temperature=0.5, text={"format": {"type": "text"}}, tool_choice="auto",
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}], top_p=0.9,
        truncation="disabled", user="u")
    assert r.http_response.status_code == 200 and "imp-ignored-fields" not in r.headers
    for name, value in (("conversation", "conv_1"), ("prompt", {"id": "p1"}), ("max_tool_calls", 2),
                        ("moderation", {"model": "omni-moderation-latest"}), ("top_logprobs", 2)):
        with pytest.raises(openai.BadRequestError) as ei:
            await sdk.responses.create(model="m", input="Hello", store=False, **{name: value})
        assert ei.value.body["param"] == name


async def test_the_anthropic_sdk_with_every_messages_parameter(make):
    anthropic = pytest.importorskip("anthropic")
    c = await make(strict=True)
    sdk = anthropic.AsyncAnthropic(base_url=str(c.make_url("")), api_key="x", max_retries=0)
    common = dict(model="m", messages=MSGS, system="Be brief.", cache_control={"type": "ephemeral"},
                  output_config={"effort": "low"}, thinking={"type": "disabled"},
                  tools=[{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
                  tool_choice={"type": "auto"})
    r = await sdk.messages.with_raw_response.create(
        max_tokens=16, **common, container=None, diagnostics=None, inference_geo="us", metadata={"user_id": "u"},
        service_tier="auto", speed="standard", stop_sequences=["\n\n"], stream=False, user_profile_id="p",
        workspace_id="w", extra_body={"temperature": 0.5, "top_k": 5, "top_p": 0.9})
    assert r.http_response.status_code == 200 and "imp-ignored-fields" not in r.headers
    r = await sdk.messages.with_raw_response.count_tokens(**common, speed="standard", user_profile_id="p",
                                                           workspace_id="w")
    assert r.http_response.status_code == 200 and "imp-ignored-fields" not in r.headers


async def test_the_logit_lens_is_a_400_where_an_executor_cannot_keep_the_residuals(make):
    """The GPU executor (and the torch CPU forward) keep no per-layer residual: the card says so, and a
    request asking is told which engine it is talking to, before anything runs."""
    import msgspec

    c = await make()
    c.engine.card = msgspec.structs.replace(c.engine.card, logit_lens=False, device="cuda")
    r = await c.post("/v1/chat/completions", json={"model": "m", "logit_lens": True,
                                                   "messages": [{"role": "user", "content": "hi"}]})
    body = await r.json()
    assert r.status == 400 and body["error"]["param"] == "logit_lens" and "cuda" in body["error"]["message"]
    assert not c.engine.submissions
