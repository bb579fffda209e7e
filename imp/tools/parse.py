"""A model's output text -> (content, tool calls), for the three call formats.

Formats (`Format`):

- "hermes": `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`, one or several, with
  text around them (Qwen 2.5/3, Hermes 2 Pro and many fine-tunes). Whitespace between the tag
  and the JSON is allowed; a call the generation ends in after its JSON, without the closing
  tag, still counts (some templates make `</tool_call>` a skipped special token).
- "json": bare JSON (Llama 3.x): the output, after leading whitespace, is a call object
  `{"name": "f", "parameters"|"arguments": {...}}` (optionally `"type": "function"`, no other
  keys), several of them separated by whitespace or `;`, or one JSON array of them; text after
  the calls is content. A name that is not one of the request's tools makes the object plain
  text (a JSON answer is not a call). Anything else is plain text.
- "generic": llama.cpp's generic form for models with no native format (SmolLM2, Gemma 3),
  the whole output being one JSON object: `{"tool_calls": [{"name", "arguments", "id"?}, ...]}`
  (parallel), `{"tool_call": {"name", "arguments"}}` (one call) or `{"response": "text"}`.
  The response's text is the content (a cut string gives its decoded prefix); any other
  output is plain text. A model-written `id` is ignored (ids are ours).

Rules shared by all formats:
- `arguments` is the compact JSON text of an object in the model's own spelling (insignificant
  whitespace removed, escapes and numbers as written); arguments given as a JSON string that
  holds an object are unwrapped; absent or null arguments are `{}` (not in "json").
- A call whose JSON does not parse, or that is not a call object, stays text: never invent a
  call. Its markup then shows in the content, which is the honest outcome.
- Content is the text outside the calls, with the whitespace that touches a call removed (text
  before a call loses its trailing whitespace, text after one its leading whitespace), so a
  reply that is only calls has content "".

`ToolStreamParser` (stream.py) gives the same result for any chunking of the same text; this
module is the non-streamed reference, written independently of it (Python's JSON decoder
here, an incremental scanner there) so that the equality test checks one against the other.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from imp.tools.jsontext import (WS, compact, decode_string_body, elements, loads, members,
                                raw_decode, skip_ws)
from imp.tools.custom import arguments as custom_arguments
from imp.tools.custom import custom_names, parse_block
from imp.tools.spec import Tool

Format = Literal["hermes", "json", "generic"]
FORMATS: tuple[str, ...] = ("hermes", "json", "generic")

HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # compact JSON text of an object


@dataclass(frozen=True, slots=True)
class Parsed:
    content: str
    calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    """OpenAI's spelling: call_ + 24 hex chars."""
    return "call_" + secrets.token_hex(12)


def reprefix(call_id: str, prefix: str = "toolu_") -> str:
    """The same id in another dialect's spelling (call_abc -> toolu_abc)."""
    return prefix + (call_id[5:] if call_id.startswith("call_") else call_id)


def counter_ids(prefix: str = "call_") -> Callable[[], str]:
    """Deterministic ids (call_000000000000000000000000, ...001, ...) for tests and replay."""
    n = iter(range(1 << 62))
    return lambda: f"{prefix}{next(n):024x}"


def tool_names(tools: Sequence[Tool] | None) -> frozenset[str] | None:
    return None if tools is None else frozenset(t.name for t in tools)


# ------------------------------------------------------------- call objects (shared rules)

_BARE_KEYS = frozenset(("name", "arguments", "parameters", "type"))


def call_in_object(text: str, start: int, end: int, *, bare: bool = False,
                   names: frozenset[str] | None = None) -> tuple[str, str] | None:
    """(name, arguments) when text[start:end] is a JSON object that is a call, else None.
    `bare` applies the stricter "json" rules (known keys only, arguments present, a known
    name when `names` is given). Shared by parse and stream: both decide on the same text."""
    try:
        obj = loads(text[start:end])
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = "arguments" if "arguments" in obj else "parameters" if "parameters" in obj else None
    if bare:
        if not obj.keys() <= _BARE_KEYS or key is None or ("arguments" in obj and "parameters" in obj):
            return None
        if obj.get("type", "function") != "function" or (names is not None and name not in names):
            return None
    value = None if key is None else obj[key]
    if value is None:
        return name, "{}"
    if isinstance(value, dict):
        vs, ve = members(text, start)[key]
        return name, compact(text[vs:ve])
    if isinstance(value, str):  # OpenAI-style arguments: a string holding the JSON object
        inner = value.strip(WS)
        try:
            if isinstance(loads(inner), dict):
                return name, compact(inner)
        except ValueError:
            pass
    return None


def calls_in_envelope(text: str, start: int, end: int) -> list[tuple[str, str]] | None:
    """The calls of a generic-form object `{"tool_calls": [...]}` / `{"tool_call": {...}}`."""
    try:
        obj = loads(text[start:end])
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    spans = members(text, start)
    if "tool_calls" in obj:
        if not isinstance(obj["tool_calls"], list) or not obj["tool_calls"]:
            return None
        vs, _ = spans["tool_calls"]
        items = elements(text, vs)
    elif "tool_call" in obj:
        items = [spans["tool_call"]]
    else:
        return None
    out = []
    for s, e in items:
        call = call_in_object(text, s, e) if text[s] == "{" else None
        if call is None:
            return None
        out.append(call)
    return out


def response_head(text: str, i: int) -> int | str:
    """At text[i] == "{": the index after `{"response": "` (JSON whitespace allowed between
    the tokens), "partial" when the text ends before that is decided, "no" otherwise."""
    n = len(text)
    i = skip_ws(text, i + 1)
    for c in '"response"':
        if i == n:
            return "partial"
        if text[i] != c:
            return "no"
        i += 1
    for c in ':"':
        i = skip_ws(text, i)
        if i == n:
            return "partial"
        if text[i] != c:
            return "no"
        i += 1
    return i


# ------------------------------------------------------------------- non-streamed parse

Item = tuple  # ("text", s) | ("call", name, arguments)


def parse(text: str, fmt: Format, tools: Sequence[Tool] | None = None,
          new_id: Callable[[], str] = new_call_id) -> Parsed:
    """The content and calls of a whole output (see the module doc for the formats). A reply
    that is a custom tool's raw block is that call, whatever the format (imp.tools.custom)."""
    block = parse_block(text, custom_names(tools))
    if block is not None:
        return assemble([("call", block[0], custom_arguments(block[1]))], new_id)
    if fmt == "hermes":
        items = _hermes(text)
    elif fmt == "json":
        items = _bare(text, tool_names(tools))
    elif fmt == "generic":
        items = _generic(text)
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {FORMATS}")
    return assemble(items, new_id)


def assemble(items: list[Item], new_id: Callable[[], str]) -> Parsed:
    """Join text items (trimming whitespace that touches a call) and number the calls."""
    parts, calls = [], []
    for k, it in enumerate(items):
        if it[0] == "call":
            calls.append(ToolCall(new_id(), it[1], it[2]))
            continue
        s = it[1]
        if k > 0 and items[k - 1][0] == "call":
            s = s.lstrip(WS)
        if k + 1 < len(items) and items[k + 1][0] == "call":
            s = s.rstrip(WS)
        parts.append(s)
    return Parsed("".join(parts), tuple(calls))


def _hermes(text: str) -> list[Item]:
    items: list[Item] = []
    seg = pos = 0  # seg: where the current text segment began
    while (i := text.find(HERMES_OPEN, pos)) >= 0:
        found = _hermes_call_at(text, i)
        if found is None:
            pos = i + len(HERMES_OPEN)  # the tag is text; look for the next one after it
            continue
        name, args, end = found
        items += [("text", text[seg:i]), ("call", name, args)]
        seg = pos = end
    items.append(("text", text[seg:]))
    return items


def _hermes_call_at(text: str, i: int) -> tuple[str, str, int] | None:
    j = skip_ws(text, i + len(HERMES_OPEN))
    if j == len(text) or text[j] != "{":
        return None
    try:
        _, e = raw_decode(text, j)
    except ValueError:
        return None
    call = call_in_object(text, j, e)
    if call is None:
        return None
    k = skip_ws(text, e)
    if text.startswith(HERMES_CLOSE, k):
        return (*call, k + len(HERMES_CLOSE))
    if k == len(text):
        return (*call, k)
    return None


def array_calls(text: str, start: int, names: frozenset[str] | None
                ) -> tuple[list[tuple[str, str]], int] | None:
    """A JSON array at `start` whose every element is a bare call object -> its (name,
    arguments) calls and the array's end; None if it is not one (empty, or any other element).
    The non-streamed parse and the streaming parser read arrays of calls with this one rule."""
    try:
        value, e = raw_decode(text, start)
    except ValueError:
        return None
    if not value:
        return None
    calls = []
    for s, t in elements(text, start):
        call = call_in_object(text, s, t, bare=True, names=names) if text[s] == "{" else None
        if call is None:
            return None
        calls.append(call)
    return calls, e


def _bare(text: str, names: frozenset[str] | None) -> list[Item]:
    whole = [("text", text)]
    j = skip_ws(text, 0)
    if j == len(text) or text[j] not in "{[":
        return whole
    if text[j] == "[":
        got = array_calls(text, j, names)
        if got is None:
            return whole
        calls, e = got
        return [("text", ""), *(("call", *c) for c in calls), ("text", text[e:])]
    calls, last = [], j
    k = j
    while True:
        try:
            _, e = raw_decode(text, k)
        except ValueError:
            break
        call = call_in_object(text, k, e, bare=True, names=names)
        if call is None:
            break
        calls.append(("call", *call))
        last = e
        k = skip_ws(text, e)
        if k < len(text) and text[k] == ";":
            k = skip_ws(text, k + 1)
        if k == len(text) or text[k] != "{":
            break
    if not calls:
        return whole
    return [("text", ""), *calls, ("text", text[last:])]


def _generic(text: str) -> list[Item]:
    whole = [("text", text)]
    j = skip_ws(text, 0)
    if j == len(text) or text[j] != "{":
        return whole
    head = response_head(text, j)
    if isinstance(head, int):
        body, used, closed = decode_string_body(text[head:], final=True)
        items = [("text", body)]
        tail = text[head + used:]
        if closed and tail.strip(WS) != "}":
            items.append(("text", tail))  # not the expected `}`: the model's text is kept
        return items
    try:
        _, e = raw_decode(text, j)
    except ValueError:
        return whole
    calls = calls_in_envelope(text, j, e)
    if calls is None:
        return whole
    return [("text", ""), *(("call", *c) for c in calls), ("text", text[e:])]
