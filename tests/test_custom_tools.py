"""Custom tools (raw-text input under the tool's own grammar) in every tool_choice mode.

A custom call is a raw block, the whole reply (imp.tools.custom); the grammar a request runs
under composes each custom tool's Lark / regex grammar into that block, next to the function
tools' JSON calls, so whenever the model calls the tool its input parses under the tool's
grammar. Checked here without a model: the composed grammars accept and refuse what they must
(every shape, auto / required / named, parallel or not, Codex's real apply_patch grammar, the
`lark` package agreeing on every accepted input); the parser and the stream parser agree on
any chunking; the Responses and chat dialects return and stream the calls through the SDK;
a grammar that cannot compile is a 400 naming the tool. tests/test_custom_tools_model.py runs
the real model at temperature 0.8.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import lark
import llguidance
import openai
import pytest
from imp.constrain.spec import grammar_text
from imp.constrain.vocab import from_tokenizer
from imp.messages import Constraint
from imp.tools import Tool, ToolChoice, collect, parse, stream_parser
from imp.tools.custom import block
from imp.tools.grammar import tools_grammar
from tests.fake_engine import Script, text_model
from tests.test_responses import grammars, make  # noqa: F401 - the fake-engine app and its SDK client

APPLY_PATCH = json.loads((Path(__file__).parent / "data" / "codex_apply_patch_tool.json").read_text())["tool"]
PATCH = "*** Begin Patch\n*** Update File: src/app.py\n@@\n-x = 1\n+x = 2\n*** End Patch"
GREET = 'start: "hello " NUM\nNUM: /[0-9]+/\n'
AP = Tool("apply_patch", "Edit files", custom=True, grammar=("lark", APPLY_PATCH["format"]["definition"]))
GR = Tool("greet", "", custom=True, grammar=("lark", GREET))
RX = Tool("digits", "", custom=True, grammar=("regex", "[0-9]{3}"))
FREE = Tool("note", "", custom=True)
FN = Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TOOLS = [FN, AP, GR, RX, FREE]


@pytest.fixture(scope="module")
def tm():
    return text_model()


def accepts(tm, g: str, s: str) -> bool:
    m = llguidance.LLMatcher(from_tokenizer(tm.tokenizer), g)
    ok = all(m.consume_token(t) for t in tm.tokenizer.encode(s, add_special=False))
    return ok and not m.is_error() and m.is_accepting()


@pytest.mark.parametrize("shape", ["generic", "hermes", "json"])
@pytest.mark.parametrize("mode", ["auto", "required"])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_grammar_holds_each_custom_tools_input(tm, shape, mode, parallel):
    kind, src = tools_grammar(TOOLS, ToolChoice(mode, parallel=parallel), shape)
    g = grammar_text(Constraint(kind, src))
    assert accepts(tm, g, block("apply_patch", PATCH))
    assert not accepts(tm, g, block("apply_patch", PATCH.replace("*** End Patch", "*** Fin")))
    assert accepts(tm, g, block("greet", "hello 42")) and not accepts(tm, g, block("greet", "hello x"))
    assert accepts(tm, g, block("digits", "123")) and not accepts(tm, g, block("digits", "12"))
    assert accepts(tm, g, block("note", "anything\nat all"))
    assert not accepts(tm, g, block("unknown", "x"))
    # free text may never open a block outside its grammar
    assert not accepts(tm, g, '<custom_tool name="greet">\nhello x')


def test_a_named_custom_tool_is_its_block_only(tm):
    kind, src = tools_grammar(TOOLS, ToolChoice("named", "greet"), "generic")
    g = grammar_text(Constraint(kind, src))
    assert accepts(tm, g, block("greet", "hello 7")) and not accepts(tm, g, block("digits", "123"))
    assert tools_grammar(TOOLS, ToolChoice("named", "get_weather"), "generic")[0] == "lark"  # no custom part


def lark_parser(definition: str) -> lark.Lark:
    """The `lark` package's parser for a tool's grammar. Its Earley lexer refuses a terminal that
    can match "" (Codex 0.171's `/(.*)/` for a patch line), so such a terminal is read as the
    same language spelled `[/(.+)/]` (empty or one-or-more)."""
    return lark.Lark(definition.replace("/(.*)/", "[/(.+)/]"), start="start")


APPLY_PATCH_0171 = json.loads((Path(__file__).parent / "data" / "codex_apply_patch_tool_0171.json").read_text())["tool"]


def test_codex_0171_patch_grammar_takes_empty_lines(tm):
    # the grammar Codex 0.171 sends through imp's catalog: a changed or added line may be empty
    src = APPLY_PATCH_0171["format"]["definition"]
    ap = Tool("apply_patch", "", custom=True, grammar=("lark", src))
    g = grammar_text(Constraint(*tools_grammar([FN, ap], ToolChoice("auto"), "generic")))
    patch = "*** Begin Patch\n*** Update File: a.txt\n@@\n-x\n+\n+y\n*** End Patch"
    assert accepts(tm, g, block("apply_patch", patch))
    assert not accepts(tm, g, block("apply_patch", patch.replace("*** End Patch", "*** Fin")))
    lark_parser(src).parse(patch + "\n")
    with pytest.raises(lark.exceptions.LarkError):
        lark_parser(src).parse(patch.replace("@@", "@") + "\n")


def test_the_lark_package_agrees_with_llguidance_on_the_inputs():
    parser = lark.Lark(APPLY_PATCH["format"]["definition"], start="start")
    parser.parse(PATCH + "\n")
    with pytest.raises(lark.exceptions.LarkError):
        parser.parse(PATCH.replace("*** End Patch", "*** Fin") + "\n")


CASES = [block("greet", "hello 42"), "  " + block("note", "line 1\n</custom\nline 3"),
         block("apply_patch", PATCH), '<custom_tool name="greet">\nhello 4',  # cut by max_tokens
         '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}', '{"response": "hi"}',
         '<custom_tool name="nope">\nx\n</custom_tool>', "<custom tool?"]


@pytest.mark.parametrize("text", CASES)
def test_the_stream_parser_agrees_with_the_parser_on_any_chunking(text):
    whole = parse(text, "generic", TOOLS, new_id=lambda: "id")
    rng = random.Random(text)
    for _ in range(20):
        p = stream_parser("generic", TOOLS, new_id=lambda: "id")
        events, i = [], 0
        while i < len(text):
            k = rng.randint(1, 7)
            events += p.push(text[i:i + k])
            i += k
        events += p.finish()
        assert collect(events) == whole, (text, events)
    if text.lstrip().startswith('<custom_tool name="greet">'):
        (call,) = whole.calls
        assert json.loads(call.arguments)["input"] in ("hello 42", "hello 4")


def chunks(s: str, n: int = 5) -> list[str]:
    return [s[i:i + n] for i in range(0, len(s), n)]


RESP_TOOLS = [APPLY_PATCH, {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("stream", [False, True])
async def test_responses_returns_and_streams_a_custom_call_in_every_mode(make, choice, parallel, stream):
    c = await make(Script(pieces=chunks(block("apply_patch", PATCH))))
    kw = dict(model="m", input="change x to 2 in src/app.py", tools=RESP_TOOLS, tool_choice=choice,
              parallel_tool_calls=parallel, store=False)
    if stream:
        deltas, done = [], []
        async with c.sdk.responses.stream(**kw) as s:
            async for e in s:
                if e.type == "response.custom_tool_call_input.delta":
                    deltas.append(e.delta)
                elif e.type == "response.custom_tool_call_input.done":
                    done.append(e.input)
            r = await s.get_final_response()
        assert "".join(deltas) == done[0] == PATCH
    else:
        r = await c.sdk.responses.create(**kw)
    (item,) = r.output
    assert item.type == "custom_tool_call" and item.name == "apply_patch" and item.input == PATCH
    lark.Lark(APPLY_PATCH["format"]["definition"]).parse(item.input + "\n")
    sub = c.engine.submissions[-1]
    assert sub.params.constraint.kind == "llguidance" and "Begin Patch" in sub.params.constraint.source
    prompt = c.engine.tm.tokenizer.decode(list(sub.prompt), skip_special=False)
    assert '<custom_tool name="<tool name>">' in prompt and "apply_patch" in prompt


async def test_responses_history_shows_a_custom_call_as_its_block(make):
    c = await make(Script(pieces=chunks('{"response": "done"}')))
    r = await c.sdk.responses.create(model="m", store=False, tools=RESP_TOOLS, input=[
        {"role": "user", "content": "patch it"},
        {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done!"}])
    assert r.output_text == "done"
    prompt = c.engine.tm.tokenizer.decode(list(c.engine.submissions[-1].prompt), skip_special=False)
    assert block("apply_patch", PATCH) in prompt


async def test_a_custom_grammar_that_cannot_compile_is_a_400_naming_the_tool(make):
    c = await make()
    for fmt in ({"type": "grammar", "syntax": "lark", "definition": "start: nothing_defined\n"},
                {"type": "grammar", "syntax": "regex", "definition": "[a-"}):
        with pytest.raises(openai.BadRequestError) as ei:
            await c.sdk.responses.create(model="m", input="x", store=False, tool_choice="auto", tools=[
                {"type": "custom", "name": "broken", "format": fmt}])
        assert "broken" in ei.value.body["message"] and ei.value.body["param"] == "tools"
    assert not c.engine.submissions


async def test_a_grammar_no_call_can_finish_inside_the_output_limit_is_a_400_naming_the_tool(make):
    """Codex's apply_patch needs '*** Begin Patch' ... '*** End Patch' around a hunk: with room for
    fewer tokens than its shortest call, every call would be cut unparsable. Refused up front, in
    both dialects; a limit that fits, or no limit, runs."""
    from imp.constrain.vocab import from_tokenizer
    from imp.tools.shortest import fewest_tokens, shortest_input

    c = await make()
    need = fewest_tokens(from_tokenizer(c.engine.tm.tokenizer),
                         block("apply_patch", shortest_input(APPLY_PATCH["format"]["definition"])))
    for mode in ("auto", "required", {"type": "custom", "name": "apply_patch"}):
        with pytest.raises(openai.BadRequestError) as ei:
            await c.sdk.responses.create(model="m", input="edit", store=False, tool_choice=mode,
                                         tools=[APPLY_PATCH], max_output_tokens=need - 1)
        body = ei.value.body
        assert "apply_patch" in body["message"] and f"takes {need} tokens" in body["message"], body
        assert body["param"] == "tools" and body["code"] == "tool_call_exceeds_max_tokens"
    with pytest.raises(openai.BadRequestError) as ei:
        await c.sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "edit"}], max_tokens=3,
                                            tools=[{"type": "custom", "custom": {
                                                "name": "apply_patch", "format": {"type": "grammar", "grammar": {
                                                    "syntax": "lark",
                                                    "definition": APPLY_PATCH["format"]["definition"]}}}}])
    assert "apply_patch" in ei.value.body["message"]
    assert not c.engine.submissions
    await c.sdk.responses.create(model="m", input="edit", store=False, tools=[APPLY_PATCH], max_output_tokens=need)
    await c.sdk.responses.create(model="m", input="edit", store=False, tools=[APPLY_PATCH])
    assert len(c.engine.submissions) == 2


CHAT_TOOLS = [{"type": "custom", "custom": {"name": "greet", "description": "greets",
                                            "format": {"type": "grammar", "grammar": {"syntax": "lark",
                                                                                      "definition": GREET}}}},
              {"type": "function", "function": {"name": "get_weather", "parameters": {
                  "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "custom", "custom": {"name": "greet"}}])
async def test_chat_takes_custom_tools_and_returns_their_calls(make, choice):
    c = await make(Script(pieces=chunks(block("greet", "hello 42"), 4)))
    r = await c.sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "greet"}],
                                            tools=CHAT_TOOLS, tool_choice=choice)
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "custom" and call.custom.name == "greet" and call.custom.input == "hello 42"
    assert r.choices[0].finish_reason == "tool_calls"
    assert c.engine.submissions[-1].params.constraint.kind == "llguidance"
    got, name = "", None
    stream = await c.sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "greet"}],
                                                 tools=CHAT_TOOLS, tool_choice=choice, stream=True)
    async for ch in stream:
        for tc in ch.choices[0].delta.tool_calls or ():
            assert tc.type in (None, "custom")
            d = tc.model_dump()
            name = name or (d.get("custom") or {}).get("name")
            got += (d.get("custom") or {}).get("input") or ""
    assert name == "greet" and got == "hello 42"
    # and the call goes back as history, shown as its block
    await c.sdk.chat.completions.create(model="m", tools=CHAT_TOOLS, messages=[
        {"role": "user", "content": "greet"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "custom",
                                              "custom": {"name": "greet", "input": "hello 42"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}])
    prompt = c.engine.tm.tokenizer.decode(list(c.engine.submissions[-1].prompt), skip_special=False)
    assert block("greet", "hello 42") in prompt


@pytest.mark.parametrize("named", [False, True])
async def test_a_custom_call_cut_by_max_output_tokens_is_incomplete(make, named):
    from imp.messages import FinishReason

    partial = "*** Begin Patch\n*** Add File: a.txt\n+hel"
    text = partial if named else '<custom_tool name="apply_patch">\n' + partial
    c = await make(Script(pieces=chunks(text), finish=FinishReason.LENGTH))
    choice = {"type": "custom", "name": "apply_patch"} if named else "required"
    kw = dict(model="m", input="x", tools=RESP_TOOLS, tool_choice=choice, store=False)
    r = await c.sdk.responses.create(**kw)
    (item,) = r.output
    assert r.status == "incomplete" and item.status == "incomplete" and item.input == partial
    final = None
    async for e in await c.sdk.responses.create(**kw, stream=True):
        final = e
    assert final.type == "response.incomplete" and final.response.output[0].status == "incomplete"
