"""imp.tools: tool specs, call parsing (whole and streamed), forcing grammars, prompt text.

The two central properties:
- streaming == non-streamed: for generated outputs of every format (text only, calls, text
  around calls, malformed JSON, nested braces and escaped quotes in strings, non-ASCII next
  to markup) and ANY chunking (1-char chunks included), the stream's events spell exactly
  `parse(text)`. The two implementations are independent (json.raw_decode vs an incremental
  scanner), so each checks the other.
- forced calls: random walks through each grammar with llguidance (uniform among allowed
  tokens until EOS), on a byte vocabulary and on the real SmolLM2 vocabulary: every output
  parses into calls whose arguments validate against the tool's schema (jsonschema).
"""

from __future__ import annotations

import json
import random

import jsonschema
import llguidance as llg
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from imp.tools import (ArgsDelta, CallEnd, CallStart, Parsed, Text, Tool, ToolCall, ToolChoice,
                       ToolSpecError, ToolStreamParser, call_grammar, call_message_text, close_objects,
                       collect, counter_ids, from_anthropic, from_openai, from_responses, parse,
                       reprefix, result_text, tools_system_prompt)
from imp.tools.jsontext import DONE, OPEN, JsonScanner, compact, decode_string_body, loads

WEATHER = Tool("get_weather", "Current weather for a city", {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city"],
})
ORDER = Tool("place_order", "Order items for a customer", {
    "type": "object",
    "properties": {
        "customer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                      "vip": {"type": "boolean"}},
                     "required": ["name"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object",
                            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                                           "price": {"type": "number", "minimum": 0}},
                            "required": ["sku", "qty"]}},
        "note": {"type": ["string", "null"], "maxLength": 20},
    },
    "required": ["customer", "items"],
})
PING = Tool("ping", "No parameters at all")
TAGS = Tool("set_tags", "A free-form mapping", {
    "type": "object",
    "properties": {"tags": {"type": "object", "additionalProperties": {"type": "string", "maxLength": 4},
                            "maxProperties": 3}},
    "required": ["tags"],
})
TOOLS = [WEATHER, ORDER, PING, TAGS]
BY_NAME = {t.name: t for t in TOOLS}


def stream(text: str, fmt: str, cuts: list[int], tools=TOOLS) -> tuple[Parsed, list]:
    p = ToolStreamParser(fmt, tools, new_id=counter_ids())
    events, prev = [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        events += p.push(text[prev:c])
        prev = c
    events += p.finish()
    return collect(events), events


def whole(text: str, fmt: str, tools=TOOLS) -> Parsed:
    return parse(text, fmt, tools, new_id=counter_ids())


# ------------------------------------------------------------------------------- spec

def test_from_openai_maps_tools_and_choices():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                                "parameters": WEATHER.parameters, "strict": True}},
             {"type": "function", "function": {"name": "ping"}}]
    out, choice = from_openai(tools, None)
    assert out == [Tool("get_weather", "d", WEATHER.parameters, True), Tool("ping")]
    assert choice == ToolChoice("auto", None, False)  # unset: one call per turn (llama.cpp's default)
    assert from_openai(tools, "required", True)[1] == ToolChoice("required", None, True)
    named = {"type": "function", "function": {"name": "ping"}}
    assert from_openai(tools, named)[1] == ToolChoice("named", "ping", parallel=False)
    assert from_openai(None, None)[1].mode == "none"
    assert from_openai(None, "auto")[1].mode == "none"


@pytest.mark.parametrize("tools, choice, par, param", [
    ("x", None, None, "tools"),
    ([{"type": "retrieval"}], None, None, "tools[0].type"),
    ([{"type": "function"}], None, None, "tools[0].function"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "a", "parameters": []}}], None, None, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "a", "parameters": {"type": "string"}}}], None, None,
     "tools[0].function.parameters.type"),
    ([{"type": "function", "function": {"name": "a", "description": 3}}], None, None, "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "a", "strict": "yes"}}], None, None, "tools[0].function.strict"),
    ([{"type": "function", "function": {"name": "a"}}] * 2, None, None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "a"}}], "always", None, "tool_choice"),
    ([{"type": "function", "function": {"name": "a"}}], {"type": "function", "function": {"name": "b"}}, None,
     "tool_choice.function.name"),
    ([{"type": "function", "function": {"name": "a"}}], {"type": "function"}, None, "tool_choice.function.name"),
    (None, "required", None, "tool_choice"),
    ([{"type": "function", "function": {"name": "a"}}], None, "yes", "parallel_tool_calls"),
])
def test_from_openai_errors_name_the_field(tools, choice, par, param):
    with pytest.raises(ToolSpecError) as e:
        from_openai(tools, choice, par)
    assert e.value.param == param and isinstance(e.value, ValueError) and param.split(".")[0] in str(e.value)


def test_from_responses_flat_functions():
    out, choice = from_responses([{"type": "function", "name": "ping", "parameters": None}],
                                 {"type": "function", "name": "ping"}, True)
    assert out == [Tool("ping")] and choice == ToolChoice("named", "ping", True)
    with pytest.raises(ToolSpecError) as e:
        from_responses([{"type": "custom", "name": "apply_patch"}])
    assert e.value.param == "tools[0].type"
    with pytest.raises(ToolSpecError) as e:
        from_responses([{"type": "function", "name": "ping"}], {"type": "function", "name": "x"})
    assert e.value.param == "tool_choice.name"


def test_from_anthropic_maps_tools_and_choices():
    tools = [{"name": "get_weather", "description": "d", "input_schema": WEATHER.parameters,
              "cache_control": {"type": "ephemeral"}},
             {"type": "web_search_20250305", "name": "web_search"},  # a server tool: left out
             {"type": "custom", "name": "ping", "input_schema": {"type": "object"}}]
    out, choice = from_anthropic(tools)
    assert [t.name for t in out] == ["get_weather", "ping"] and choice == ToolChoice("auto", parallel=False)
    assert from_anthropic(tools, {"type": "any"})[1] == ToolChoice("required", parallel=False)
    assert from_anthropic(tools, {"type": "any", "disable_parallel_tool_use": False})[1] == ToolChoice("required")
    assert from_anthropic(tools, {"type": "none"})[1] == ToolChoice("none", parallel=False)
    assert from_anthropic(tools, {"type": "tool", "name": "ping", "disable_parallel_tool_use": True})[1] == \
        ToolChoice("named", "ping", False)


@pytest.mark.parametrize("tools, choice, param", [
    ([{"name": "a"}], None, "tools[0].input_schema"),
    ([{"name": "a b", "input_schema": {}}], None, "tools[0].name"),
    ([{"name": "a", "input_schema": "x"}], None, "tools[0].input_schema"),
    ([{"name": "a", "input_schema": {}}], {"type": "sometimes"}, "tool_choice.type"),
    ([{"name": "a", "input_schema": {}}], {"type": "tool"}, "tool_choice.name"),
    ([{"name": "a", "input_schema": {}}], {"type": "tool", "name": "b"}, "tool_choice.name"),
    ([{"name": "a", "input_schema": {}}], {"type": "any", "disable_parallel_tool_use": 1},
     "tool_choice.disable_parallel_tool_use"),
    ([], {"type": "any"}, "tool_choice"),
])
def test_from_anthropic_errors_name_the_field(tools, choice, param):
    with pytest.raises(ToolSpecError) as e:
        from_anthropic(tools, choice)
    assert e.value.param == param


def test_ids():
    ids = counter_ids()
    assert ids() == "call_" + "0" * 24 and ids() == "call_" + "0" * 23 + "1"
    from imp.tools import new_call_id
    a = new_call_id()
    assert a.startswith("call_") and len(a) == 29 and int(a[5:], 16) >= 0 and a != new_call_id()
    assert reprefix("call_abc") == "toolu_abc"


# ---------------------------------------------------------------------------- JSON text

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(codec="utf-8"), max_size=6),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=8)


@st.composite
def json_text(draw, top=None):
    v = draw(top if top is not None else st.lists(json_values, max_size=3) | st.dictionaries(
        st.text(max_size=4), json_values, max_size=3))
    indent = draw(st.sampled_from([None, 0, 2, "\t"]))
    seps = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,", " : ")]))
    return json.dumps(v, indent=indent, separators=seps, ensure_ascii=draw(st.booleans()))


def split(text: str, cuts) -> list[str]:
    bounds = [0] + sorted({c for c in cuts if 0 < c < len(text)}) + [len(text)]
    return [text[i:j] for i, j in zip(bounds, bounds[1:])]


@given(json_text(), st.lists(st.integers(0, 200), max_size=6))
@settings(max_examples=300, deadline=None)
def test_scanner_accepts_valid_json_in_any_chunking(text, cuts):
    s = JsonScanner()
    pieces = split(text, cuts)
    for piece in pieces[:-1]:
        assert s.feed(piece) == (OPEN, len(piece))  # a prefix of valid JSON is never refused
    assert s.feed(pieces[-1]) == (DONE, len(pieces[-1]))


@given(json_text(), st.integers(0, 400), st.sampled_from(list('{}[]",:\\ 0-.eE+tfnxu\x01')), st.booleans())
@settings(max_examples=500, deadline=None)
def test_scanner_agrees_with_json_loads_on_mutations(text, at, ch, insert):
    at = min(at, len(text))
    text = text[:at] + ch + text[at + (0 if insert else 1):]
    if not text or text[0] not in "{[":
        return
    status, used = JsonScanner().feed(text)
    try:
        loads(text)
        valid = True
    except ValueError:
        valid = False
    if status == DONE:
        loads(text[:used])  # what it calls a value is one
        assert valid == (text[used:].strip(" \t\n\r") == "")
    else:
        assert not valid


@given(st.text(st.characters(codec="utf-8"), max_size=30), st.booleans(), st.integers(0, 40))
@settings(max_examples=300, deadline=None)
def test_decode_string_body_matches_json_and_any_split(s, ascii_, cut):
    body = json.dumps(s, ensure_ascii=ascii_)[1:] + "tail"
    assert decode_string_body(body, final=True) == (s, len(body) - 4, True)
    a, used, closed = decode_string_body(body[:cut], final=False)
    if not closed:
        b, _, _ = decode_string_body(body[used:], final=True)
        assert a + b == s


# ----------------------------------------------------------------------- parse: semantics

def test_hermes_calls_and_content():
    text = ('Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n')
    assert whole(text, "hermes") == Parsed("Let me check.", (
        ToolCall("call_" + "0" * 24, "get_weather", '{"city":"Paris","unit":"c"}'),
        ToolCall("call_" + "0" * 23 + "1", "ping", "{}")))


@pytest.mark.parametrize("text, content, calls", [
    # the closing tag may be missing at the very end; arguments may be a JSON string
    ('<tool_call>{"name": "ping", "arguments": "{\\"a\\": [1, {}]}"}', "", [("ping", '{"a":[1,{}]}')]),
    ('<tool_call>{"name": "ping", "parameters": {"s": "}{\\" </tool_call>"}}</tool_call> ok',
     "ok", [("ping", '{"s":"}{\\" </tool_call>"}')]),
    ('<tool_call>{"name": "ping"}</tool_call>', "", [("ping", "{}")]),
    ('<tool_call>{"name": "ping", "arguments": null}</tool_call>', "", [("ping", "{}")]),
    # never invent a call: these stay text, markup included
    ('a <tool_call>{"name": "ping", "arguments": {]}</tool_call>', 'a <tool_call>{"name": "ping", "arguments": {]}</tool_call>', []),
    ('<tool_call>{"name": "ping", "arguments": {"a": 1}', '<tool_call>{"name": "ping", "arguments": {"a": 1}', []),
    ('<tool_call>{"name": "ping", "arguments": {}} x</tool_call>', '<tool_call>{"name": "ping", "arguments": {}} x</tool_call>', []),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "ping", "arguments": [1]}</tool_call>', '<tool_call>{"name": "ping", "arguments": [1]}</tool_call>', []),
    ('<tool_call>{"name": "ping", "arguments": {"x": NaN}}</tool_call>', '<tool_call>{"name": "ping", "arguments": {"x": NaN}}</tool_call>', []),
    ('<tool_call>{"name": "ping"}</tool_', '<tool_call>{"name": "ping"}</tool_', []),
    # a broken call before a good one: the first stays text, the second is a call
    ('<tool_call>{bad <tool_call>{"name": "ping", "arguments": {"k": "é"}}</tool_call>',
     "<tool_call>{bad", [("ping", '{"k":"é"}')]),
    ('text only, no calls: {"name": "ping"} <tool', 'text only, no calls: {"name": "ping"} <tool', []),
])
def test_hermes_edge_cases(text, content, calls):
    got = whole(text, "hermes")
    assert got.content == content and [(c.name, c.arguments) for c in got.calls] == calls
    assert stream(text, "hermes", list(range(len(text))))[0] == got


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [("get_weather", '{"city":"Oslo"}')]),
    (' {"type": "function", "name": "ping", "parameters": {}} ; {"name": "ping", "arguments": {"a": 1}}\nDone.',
     "Done.", [("ping", "{}"), ("ping", '{"a":1}')]),
    ('[{"name": "ping", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "x"}}] after',
     "after", [("ping", "{}"), ("get_weather", '{"city":"x"}')]),
    ('{"name": "ping", "parameters": {}}; oops', "; oops", [("ping", "{}")]),
    ('{"name": "ping", "parameters": {}} {"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}',
     [("ping", "{}")]),
    # not calls: an unknown name, an extra key, missing arguments, a JSON answer, prose
    ('{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
    ('{"name": "ping", "parameters": {}, "x": 1}', '{"name": "ping", "parameters": {}, "x": 1}', []),
    ('{"name": "ping"}', '{"name": "ping"}', []),
    ('  {"answer": 42}', '  {"answer": 42}', []),
    ('[{"name": "ping", "parameters": {}}, 3]', '[{"name": "ping", "parameters": {}}, 3]', []),
    ("Sure: {\"name\": \"ping\", \"parameters\": {}}", "Sure: {\"name\": \"ping\", \"parameters\": {}}", []),
    ('{"name": "ping", "parameters": {', '{"name": "ping", "parameters": {', []),
])
def test_bare_json_cases(text, content, calls):
    got = whole(text, "json")
    assert got.content == content and [(c.name, c.arguments) for c in got.calls] == calls
    assert stream(text, "json", list(range(len(text))))[0] == got


@pytest.mark.parametrize("text, content, calls", [
    ('{"tool_calls": [{"name": "ping", "arguments": {}, "id": "abcd"}, {"name": "get_weather", "arguments": '
     '{"city": "Rome"}}]}', "", [("ping", "{}"), ("get_weather", '{"city":"Rome"}')]),
    ('{"tool_call": {"name": "ping", "arguments": {"a": [1, 2]}}}', "", [("ping", '{"a":[1,2]}')]),
    ('{"response": "Hi \\"you\\" \\u00e9\\ud83d\\ude00\\n"}', 'Hi "you" é😀\n', []),
    ('\n{ "response" : "cut by max_tok', "cut by max_tok", []),
    ('{"response": "ends in an escape \\u00', "ends in an escape ", []),
    ('{"response": "x"} and more', 'x} and more', []),
    ('{"tool_calls": []}', '{"tool_calls": []}', []),
    ('{"tool_calls": [{"name": "ping", "arguments": 1}]}', '{"tool_calls": [{"name": "ping", "arguments": 1}]}', []),
    ('{"answer": 1}', '{"answer": 1}', []),
    ("plain text", "plain text", []),
    ('{"respo', '{"respo', []),
])
def test_generic_cases(text, content, calls):
    got = whole(text, "generic")
    assert got.content == content and [(c.name, c.arguments) for c in got.calls] == calls
    assert stream(text, "generic", list(range(len(text))))[0] == got


def test_unknown_format():
    with pytest.raises(ValueError):
        parse("x", "xml")
    with pytest.raises(ValueError):
        ToolStreamParser("xml")


# --------------------------------------------------------------------- stream: hold-back

def test_stream_holds_back_possible_markup_and_releases_text():
    p = ToolStreamParser("hermes", TOOLS, new_id=counter_ids())
    assert p.push("Hello <tool") == [Text("Hello")]
    assert p.push("_c") == []
    assert p.push("all>\n{\"name\": \"ping\", ") == []
    assert p.push('"arguments": {}}\n</tool_call>') == [
        CallStart(0, "call_" + "0" * 24, "ping"), ArgsDelta(0, "{}"), CallEnd(0)]
    assert p.push("\n\nThen ") == [Text("Then")]
    assert p.finish() == [Text(" ")]
    # a "<" that does not become the tag is released as soon as that is known
    p = ToolStreamParser("hermes")
    assert p.push("a <b") == [Text("a <b")]
    # a broken call is released at its first bad character, not at the end
    p = ToolStreamParser("hermes")
    assert p.push('<tool_call>{"name": x') == [Text('<tool_call>{"name": x')]


def test_stream_generic_response_streams_text():
    p = ToolStreamParser("generic")
    assert p.push('{"response": "Hel') == [Text("Hel")]
    assert p.push('lo \\u00') == [Text("lo ")]
    assert p.push('e9!"') == [Text("é!")]
    assert p.push("}") == []
    assert p.finish() == []


# ------------------------------------------------------------ stream == parse, property

PIECES = ["<tool", "<tool_call>", "</tool_call>", "{", "}", "[", "]", '"', "\\", ";", "é", "日", "😀", "\n", " ",
          '{"name": ', '"arguments"', "response", '{"response": "', "tool_calls"]
free_text = st.lists(st.sampled_from(PIECES) | st.text(st.sampled_from(list("ab <>{}\"\\:,\n é日😀")), max_size=6),
                     max_size=5).map("".join)
arg_strings = st.text(st.sampled_from(list('ab{}[]"\\:, é日😀\n<>/')), max_size=8)
arg_values = st.recursive(st.none() | st.booleans() | st.integers(-99, 99) | arg_strings,
                          lambda k: st.lists(k, max_size=2) | st.dictionaries(arg_strings, k, max_size=2),
                          max_leaves=5)
arguments = st.dictionaries(arg_strings, arg_values, max_size=3)


@st.composite
def call_json(draw, key="arguments", names=("ping", "get_weather", "place_order")):
    name = draw(st.sampled_from(names))
    args = draw(arguments)
    sep = draw(st.sampled_from([(", ", ": "), (",", ":"), (" , ", " :\n ")]))
    asc = draw(st.booleans())
    if draw(st.integers(0, 9)) == 0:  # OpenAI-style string arguments
        return name, args, json.dumps({"name": name, key: json.dumps(args)}, separators=sep, ensure_ascii=asc)
    return name, args, json.dumps({"name": name, key: args}, separators=sep, ensure_ascii=asc)


def malform(draw, text):
    how = draw(st.integers(0, 2))
    at = draw(st.integers(0, max(0, len(text) - 1)))
    if how == 0:
        return text[:at]  # cut
    if how == 1:
        return text[:at] + draw(st.sampled_from(list('{}[]":,x\\'))) + text[at:]
    return text[:at] + text[at + 1:]


@st.composite
def hermes_output(draw):
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            parts.append(draw(free_text))
        else:
            _, _, body = draw(call_json())
            ws = draw(st.sampled_from(["", "\n", " \n"]))
            call = f"<tool_call>{ws}{body}{ws}</tool_call>" if kind < 3 or draw(st.booleans()) else f"<tool_call>{body}"
            parts.append(malform(draw, call) if kind == 3 else call)
            parts.append(draw(st.sampled_from(["", "\n", "\n\n", " "])))
    return "".join(parts)


@st.composite
def bare_output(draw):
    kind = draw(st.integers(0, 3))
    lead = draw(st.sampled_from(["", " ", "\n"]))
    if kind == 0:
        return lead + draw(free_text)
    key = draw(st.sampled_from(["parameters", "arguments"]))
    calls = [draw(call_json(key=key, names=("ping", "get_weather", "nope")))[2] for _ in range(draw(st.integers(1, 3)))]
    if kind == 1:
        body = draw(st.sampled_from(["; ", ";", " ", "\n", ""])).join(calls)
    else:
        body = "[" + ", ".join(calls) + "]"
    if draw(st.booleans()):
        body = malform(draw, body)
    return lead + body + draw(free_text)


@st.composite
def generic_output(draw):
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(free_text)
    if kind == 1:
        s = draw(st.text(st.sampled_from(list('ab"\\ é日😀\n{}')), max_size=12))
        text = json.dumps({"response": s}, ensure_ascii=draw(st.booleans()),
                          separators=draw(st.sampled_from([(", ", ": "), (",", ":"), (", ", " : ")])))
    else:
        calls = [json.loads(draw(call_json())[2]) for _ in range(draw(st.integers(1, 3)))]
        env = {"tool_calls": calls} if kind == 2 else {"tool_call": calls[0]}
        text = json.dumps(env, ensure_ascii=draw(st.booleans()))
    if draw(st.booleans()):
        text = malform(draw, text)
    return draw(st.sampled_from(["", " ", "\n"])) + text + draw(st.sampled_from(["", "\n", " x"]))


chunkings = st.one_of(st.just("chars"), st.lists(st.integers(0, 300), max_size=12))


def _cuts(text, how):
    return list(range(1, len(text))) if how == "chars" else how


@pytest.mark.parametrize("fmt, outputs", [("hermes", hermes_output()), ("json", bare_output()),
                                          ("generic", generic_output())])
def test_stream_equals_parse_for_any_chunking(fmt, outputs):
    @given(outputs, chunkings)
    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def check(text, how):
        expected = whole(text, fmt)
        got, events = stream(text, fmt, _cuts(text, how))
        assert got == expected
        # every call's events: start (id, name), its deltas, end; in index order
        starts = [e for e in events if isinstance(e, CallStart)]
        assert [e.index for e in starts] == list(range(len(expected.calls)))
        for c in expected.calls:  # arguments are compact JSON objects
            assert isinstance(loads(c.arguments), dict) and c.arguments == compact(c.arguments)
    check()


@given(st.lists(st.tuples(free_text.filter(lambda t: "<tool_call>" not in t), call_json()), max_size=3),
       free_text.filter(lambda t: "<tool_call>" not in t), chunkings)
@settings(max_examples=200, deadline=None)
def test_hermes_finds_every_well_formed_call(pairs, tail, how):
    """Text around well-formed calls: the calls come back exactly, content is the text."""
    text = "".join(f"{t}<tool_call>\n{body}\n</tool_call>" for t, (_, _, body) in pairs) + tail
    got, _ = stream(text, "hermes", _cuts(text, how))
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [(n, a) for _, (n, a, _) in pairs]
    texts = [t for t, _ in pairs] + [tail]
    ws = " \t\n\r"
    expected = "".join((t.lstrip(ws) if k else t).rstrip(ws) if k < len(pairs) else (t.lstrip(ws) if k else t)
                       for k, t in enumerate(texts))
    assert got.content == expected


# ------------------------------------------------------------------------ grammar: walks

class _Vocab:
    """A byte-level vocabulary (one token per byte) plus EOS, for llguidance."""

    def __init__(self, tokens: list[bytes], eos: int):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids = [eos]

    def encode(self, b: bytes) -> list[int]:
        return list(b)

    def __call__(self, b: bytes) -> list[int]:
        return self.encode(b)


@pytest.fixture(scope="module")
def byte_tok():
    return llg.LLTokenizer(llg.TokenizerWrapper(_Vocab([bytes([i]) for i in range(256)] + [b"\xff<eos>"], 256)))


@pytest.fixture(scope="module")
def smol_tok(smollm2_path):
    from imp.text.tokenizer import Tokenizer

    tk = Tokenizer.from_gguf(smollm2_path)
    # special tokens get llguidance's 0xFF marker so that no grammar string can match them
    v = _Vocab([b"\xff" + tk.piece_bytes(i) if tk.is_special(i) else tk.piece_bytes(i)
                for i in range(tk.vocab_size)], tk.eos_id)
    v.bos_token_id = tk.bos_id
    v.special_token_ids = [i for i in range(tk.vocab_size) if tk.is_special(i)]
    v.encode = lambda b: tk.encode(b.decode("utf-8", "replace"))
    return llg.LLTokenizer(llg.TokenizerWrapper(v))


def walk(tok, grammar: str, rng: random.Random, prefix: bytes = b"", limit: int = 4000) -> str:
    """Sample uniformly among the allowed tokens until EOS (allowed only where the grammar
    may end) or the grammar stops; `prefix` is forced first (a model that chose to call)."""
    g = llg.grammar_from("lark", grammar)
    m = llg.LLMatcher(tok, g, log_level=0)
    assert not m.is_error(), m.get_error()
    out = tok.tokenize_bytes(prefix) if prefix else []
    assert m.consume_tokens(out), m.get_error()
    while not m.is_stopped():
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), np.uint8), bitorder="little")[: tok.vocab_size]
        allowed = np.flatnonzero(bits)
        t = int(allowed[rng.randrange(len(allowed))])
        if t == tok.eos_token:
            break
        assert m.consume_token(t), m.get_error()
        out.append(t)
        assert len(out) < limit, "walk did not end"
    assert m.is_accepting()
    return tok.decode_bytes(out).decode("utf-8")


def check_calls(text: str, shape: str, tools, choice: ToolChoice, must_call: bool) -> int:
    got = whole(text, shape, tools)
    assert got == stream(text, shape, list(range(1, len(text))), tools)[0]
    if must_call:
        assert got.calls, text
    if choice.forces_call:
        assert got.content == "", text
    if not choice.parallel:
        assert len(got.calls) <= 1
    for c in got.calls:
        assert choice.mode != "named" or c.name == choice.name
        jsonschema.validate(json.loads(c.arguments), BY_NAME[c.name].parameters)
    return len(got.calls)


CASES = [  # (shape, choice, walk prefix for "auto" walks that must call)
    ("hermes", ToolChoice("required", None, True), b""),
    ("hermes", ToolChoice("required", None, False), b""),
    ("hermes", ToolChoice("named", "place_order", True), b""),
    ("hermes", ToolChoice("auto", None, True), b"Sure.\n<tool_call>"),
    ("json", ToolChoice("required", None, True), b""),
    ("json", ToolChoice("named", "set_tags", False), b""),
    ("json", ToolChoice("auto", None, False), b'{"name": "'),
    ("generic", ToolChoice("required", None, True), b""),
    ("generic", ToolChoice("required", None, False), b""),
    ("generic", ToolChoice("named", "ping", True), b""),
    ("generic", ToolChoice("auto", None, True), b""),
]


@pytest.mark.parametrize("shape, choice, prefix", CASES)
def test_forced_calls_parse_and_validate(byte_tok, shape, choice, prefix):
    grammar = call_grammar(TOOLS, choice, shape)
    assert llg.LLMatcher.validate_grammar(llg.grammar_from("lark", grammar), byte_tok) == ""
    rng = random.Random(f"{shape}{choice}")
    n_calls = 0
    for _ in range(50):
        text = walk(byte_tok, grammar, rng, prefix)
        n_calls += check_calls(text, shape, TOOLS, choice, must_call=choice.forces_call or bool(prefix))
    assert n_calls >= (50 if choice.forces_call else 1)


@pytest.mark.parametrize("shape, choice", [("hermes", ToolChoice("required", None, True)),
                                           ("generic", ToolChoice("named", "get_weather", False)),
                                           ("generic", ToolChoice("required", None, True))])
def test_forced_calls_on_the_smollm2_vocabulary(smol_tok, shape, choice):
    # tools whose strings are bounded: in a 49k vocabulary few tokens close a string, so an
    # unbounded one takes a uniform walk thousands of tokens (the byte vocabulary covers those)
    tools = [WEATHER, ORDER, PING]
    grammar = call_grammar(tools, choice, shape)
    rng = random.Random(shape)
    for _ in range(50):
        check_calls(walk(smol_tok, grammar, rng), shape, tools, choice, must_call=True)


def test_auto_text_never_holds_a_stray_tag(byte_tok):
    """hermes "auto": free text cannot contain the open tag, and once the tag is written
    (here forced, as if the model chose it) a valid call must follow."""
    grammar = call_grammar([PING, WEATHER], ToolChoice("auto"), "hermes")
    rng = random.Random(1)
    for _ in range(30):
        got = whole(walk(byte_tok, grammar, rng), "hermes", TOOLS)
        assert "<tool_call>" not in got.content
        text = walk(byte_tok, grammar, rng, "é x<tool_call>".encode())
        assert check_calls(text, "hermes", TOOLS, ToolChoice("auto"), must_call=True) >= 1


def test_grammar_none_and_errors():
    assert call_grammar(TOOLS, ToolChoice("none"), "hermes") is None
    with pytest.raises(ValueError):
        call_grammar(TOOLS, ToolChoice("named", "nope"), "hermes")
    with pytest.raises(ValueError):
        call_grammar([], ToolChoice("required"), "generic")
    with pytest.raises(ValueError):
        call_grammar(TOOLS, ToolChoice("required"), "xml")


def test_unknown_keywords_strict_when_forced_lenient_in_auto(byte_tok):
    odd = Tool("odd", "", {"type": "object", "properties": {"a": {"type": "string"}},
                           "propertyNames": {"pattern": "^a"}})
    forced = llg.grammar_from("lark", call_grammar([odd], ToolChoice("required"), "generic"))
    auto = llg.grammar_from("lark", call_grammar([odd], ToolChoice("auto"), "generic"))
    assert "propertyNames" in llg.LLMatcher.validate_grammar(forced, byte_tok)
    is_error, _ = llg.LLMatcher.validate_grammar_with_warnings(auto, byte_tok)
    assert not is_error


def test_close_objects_only_where_safe():
    s = close_objects({"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                                        "b": {"type": "object"},
                                                        "c": {"properties": {"x": {}}, "anyOf": [{"required": ["y"]}]}},
                       "required": ["a"]})
    assert s["additionalProperties"] is False
    assert s["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in s["properties"]["b"]  # a free-form mapping stays free
    assert "additionalProperties" not in s["properties"]["c"]
    assert "additionalProperties" not in close_objects({"properties": {"a": {}}, "required": ["b"]})
    assert "additionalProperties" not in close_objects({"properties": {"a": {}}, "allOf": [{}]})


# ------------------------------------------------------------------------------ render

CALLS = (ToolCall("call_1", "get_weather", '{"city":"Paris","unit":"c"}'), ToolCall("call_2", "ping", "{}"))


@pytest.mark.parametrize("shape", ["hermes", "json", "generic"])
def test_call_message_text_round_trips_through_the_parser(shape):
    for calls, parallel in ((CALLS, True), (CALLS[:1], False), (CALLS[:1], True)):
        text = call_message_text(calls, shape, parallel=parallel)
        got = parse(text, shape, TOOLS)
        assert [(c.name, c.arguments) for c in got.calls] == [(c.name, c.arguments) for c in calls]
        # and the forcing grammar accepts it: what the model sees is what it may write
        m = llg.LLMatcher(llg.LLTokenizer(llg.TokenizerWrapper(_Vocab([bytes([i]) for i in range(256)] + [b"\xff"], 256))),
                          llg.grammar_from("lark", call_grammar(TOOLS, ToolChoice("required", None, parallel), shape)),
                          log_level=0)
        assert m.consume_tokens(list(text.encode())) and m.is_accepting(), (text, m.get_error())
    assert parse(call_message_text((), "generic", "Hello"), "generic").content == "Hello"
    assert parse(call_message_text(CALLS[:1], "hermes", "Checking."), "hermes").content == "Checking."


def test_result_text_shapes():
    assert result_text("get_weather", "18C", "hermes") == "<tool_response>\n18C\n</tool_response>"
    assert json.loads(result_text("get_weather", "18C", "generic", "call_1", True)) == \
        {"tool_response": {"tool": "get_weather", "content": "18C", "tool_call_id": "call_1", "is_error": True}}
    assert result_text("x", "boom", "json", is_error=True) == "Error: boom"


@pytest.mark.parametrize("shape", ["hermes", "json", "generic"])
def test_tools_system_prompt(shape):
    p = tools_system_prompt(TOOLS, ToolChoice("auto"), shape)
    assert all(t.name in p for t in TOOLS) and json.dumps(WEATHER.parameters) in p
    assert p == tools_system_prompt(TOOLS, ToolChoice("auto"), shape)  # deterministic
    named = tools_system_prompt(TOOLS, ToolChoice("named", "ping"), shape)
    assert "ping" in named and "get_weather" not in named and "must" in named
    assert tools_system_prompt(TOOLS, ToolChoice("none"), shape) == ""


def test_unbounded_numbers_get_a_bound_so_a_call_always_closes():
    """Codex's exec_command has `yield_time_ms: {"type": "number"}`: unbounded, a small model ran
    its digits to max_tokens, and past 2^31 Codex cannot parse it ("expected i32"). Forced
    arguments bound every integer / number to ±(2^31 - 1); values in enum / const / default are
    instances and stay as they are."""
    from imp.tools.grammar import bound_numbers

    B = 2**31 - 1
    schema = {"type": "object", "properties": {
        "ms": {"type": "number"}, "n": {"type": ["integer", "null"], "minimum": 0},
        "default": {"type": "integer", "exclusiveMaximum": 10},
        "xs": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "c": {"const": {"type": "number"}},
        "type": {"type": "string"}, "properties": {"type": "object", "properties": {"type": {"type": "integer"}}}}}
    out = bound_numbers(schema)
    p = out["properties"]
    assert p["ms"] == {"type": "number", "minimum": -B, "maximum": B}
    assert p["n"] == {"type": ["integer", "null"], "minimum": 0, "maximum": B}
    assert p["default"] == {"type": "integer", "exclusiveMaximum": 10, "minimum": -B}
    assert p["xs"]["items"]["anyOf"][0] == {"type": "integer", "minimum": -B, "maximum": B}
    assert p["c"] == {"const": {"type": "number"}} and schema["properties"]["ms"] == {"type": "number"}
    assert p["type"] == {"type": "string"} and p["properties"]["properties"]["type"]["maximum"] == B


@pytest.mark.parametrize("capture", ["codex_request.json", "claude_code_request.json"])
def test_the_agent_clis_tools_all_compile_to_call_grammars(capture, byte_tok):
    """Every tool schema Codex and Claude Code send (captured from the real CLIs) becomes a
    call grammar llguidance accepts, forced and auto (a schema we choke on is a 500 for every
    turn of that client)."""
    from pathlib import Path

    from imp.tools import from_anthropic, from_openai

    body = json.loads((Path(__file__).parent / "data" / capture).read_text())["body"]
    if "input_schema" in json.dumps(body["tools"][:1]):
        tools, _ = from_anthropic(body["tools"])
    else:
        tools, _ = from_openai([{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                                   if k in t}}
                                for t in body["tools"] if t.get("type") == "function"])
    assert len(tools) >= 4
    for choice in (ToolChoice("required"), ToolChoice("auto")):
        for shape in ("generic", "hermes"):
            g = llg.grammar_from("lark", call_grammar(tools, choice, shape))
            is_error, msgs = llg.LLMatcher.validate_grammar_with_warnings(g, byte_tok)
            if choice.mode == "required" and capture.startswith("claude"):
                # one of Claude Code's tools uses propertyNames, which llguidance cannot enforce: a
                # forced call over them is a 400 naming it (never a quietly unchecked schema);
                # Claude Code itself sends auto
                assert is_error and "propertyNames" in str(msgs)
            else:
                assert not is_error, (choice.mode, shape, msgs)
