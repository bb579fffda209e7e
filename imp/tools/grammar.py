"""Grammars that force (or, in "auto", shape) tool calls, as llguidance Lark text.

`call_grammar(tools, choice, shape)` returns the grammar text for `llguidance.grammar_from(
"lark", text)` / `LLMatcher` (None for choice "none": the caller hides the tools or simply does
not parse calls). Every call's arguments are an embedded `%json {...}` of that tool's
parameter schema, so a call made under the grammar always parses with `parse(..., shape)` and
its arguments validate against the schema.

| mode | hermes | json | generic |
|---|---|---|---|
| required | `<tool_call>\\n{call}\\n</tool_call>`, more separated by `\\n` when parallel | `{call}`, more separated by `; ` | `{"tool_call": {call}}`, or `{"tool_calls": [{call}, ...]}` when parallel |
| named | the same with that tool only | same | same |
| auto | any text without `<tool_call>`; the tag, when written, starts a forced call | text not starting with `{` / `[`, or the required form | the required form or `{"response": "text"}` |

where `{call}` is `{"name": "<tool>", "arguments": <args>}` ("json": `"parameters"`, Llama 3's
word). Framing is fixed, compact and in the spacing models are trained on (`": "`, `", "`,
no newlines inside the JSON): a small model cannot ramble in whitespace.

Schema handling, per tool (`arguments_schema`):
- objects that list `properties` but say nothing of extra ones are closed
  (`additionalProperties: false`) where that cannot reject a valid instance (no combinators
  or `$ref` beside it, every required name listed): extra keys never help a call, and an open
  object lets a weak model invent keys forever. Anything closed still validates against the
  original schema.
- forced calls compile strictly: a keyword llguidance does not implement is a compile error
  (the caller's 400 `tool_choice_unenforceable`). In "auto" a non-`strict` tool compiles
  leniently (unknown keywords ignored, warnings only): the call is best effort there, and one
  odd schema among 24 tools (Claude Code) must not refuse the whole request.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Literal, Sequence

from imp.tools.custom import NOT_A_BLOCK, block_rules, top_level
from imp.tools.spec import Tool, ToolChoice

Shape = Literal["hermes", "json", "generic"]
SHAPES: tuple[str, ...] = ("hermes", "json", "generic")

# the JSON compiler's spacing: exactly ", " and ": ", no other whitespace
_COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}

# keywords beside `properties` under which closing the object could reject valid instances
_OPEN_BESIDE = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf",
                "oneOf", "$ref", "$dynamicRef", "if", "not", "dependentSchemas", "dependencies")

# anything but the Hermes open tag (llguidance's & and ~ on terminals)
_FREE_TEXT = r"/(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/"
# text that a bare-JSON parser cannot mistake for a call: not starting with { or [
_PLAIN_TEXT = r"/[ \t\r\n]*([^ \t\r\n{\[](?s:.*))?/"


def close_objects(schema: Any) -> Any:
    """A copy of schema with objects closed where that is safe (see the module doc)."""
    if not isinstance(schema, dict):
        return schema
    s = dict(schema)
    props = s.get("properties")
    if isinstance(props, dict):
        s["properties"] = {k: close_objects(v) for k, v in props.items()}
    for k in ("items", "additionalItems", "contains"):
        if isinstance(s.get(k), dict):
            s[k] = close_objects(s[k])
        elif isinstance(s.get(k), list):
            s[k] = [close_objects(v) for v in s[k]]
    if isinstance(s.get("prefixItems"), list):
        s["prefixItems"] = [close_objects(v) for v in s["prefixItems"]]
    if isinstance(s.get("additionalProperties"), dict):
        s["additionalProperties"] = close_objects(s["additionalProperties"])
    if "properties" not in s and "required" not in s:
        # alternatives of a schema that adds no object keywords of its own stand alone
        for k in ("anyOf", "oneOf"):
            if isinstance(s.get(k), list):
                s[k] = [close_objects(v) for v in s[k]]
    required = s.get("required", [])
    if (isinstance(props, dict) and not any(k in s for k in _OPEN_BESIDE)
            and isinstance(required, list) and all(r in props for r in required)):
        s["additionalProperties"] = False
    return s


# A number with no bounds is an unbounded digit run to the grammar: a small model that starts
# one ("yield_time_ms": 1000000...) may never close it, and the call is cut at max_tokens. The
# integer part is bounded at the int32 range: what every typed client decodes such a field into
# (Codex 0.171 parses exec_command's `yield_time_ms: {"type": "number"}` as an i32 and fails the
# whole turn on 1000000000000000, "expected i32"); llguidance turns it into at most 10 digits.
# A schema's own minimum / maximum always wins. A fraction stays unbounded (no JSON Schema
# keyword bounds it) and is left to max_tokens.
_SAFE_INT = 2**31 - 1
_VALUES = ("enum", "const", "default", "examples")  # instances, not schemas: never rewritten
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bound_numbers(schema: Any) -> Any:
    """A copy of schema where every integer / number without a bound gets ±(2^31 - 1)."""
    if isinstance(schema, list):
        return [bound_numbers(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    s = {}
    for k, v in schema.items():
        if k in _MAPS and isinstance(v, dict):  # name -> schema (a property may be called "type")
            s[k] = {n: bound_numbers(sub) for n, sub in v.items()}
        else:
            s[k] = v if k in _VALUES else bound_numbers(v)
    t = s.get("type")
    types = {x for x in t if isinstance(x, str)} if isinstance(t, list) else {t} if isinstance(t, str) else set()
    if types & {"integer", "number"}:
        if "minimum" not in s and "exclusiveMinimum" not in s:
            s["minimum"] = -_SAFE_INT
        if "maximum" not in s and "exclusiveMaximum" not in s:
            s["maximum"] = _SAFE_INT
    return s


def arguments_schema(tool: Tool, lenient: bool = False) -> dict[str, Any]:
    """The schema a forced call's arguments are generated under (closed, numbers bounded,
    compact spacing)."""
    s = bound_numbers(close_objects(copy.deepcopy(tool.parameters)))
    s["x-guidance"] = {**_COMPACT, "lenient": True} if lenient else dict(_COMPACT)
    return s


# Parallel calls in one turn are capped: a small model asked for "one or more" calls tends to
# repeat the same call until max_tokens cuts it, and a cut envelope holds no call at all.
MAX_PARALLEL = 4


def _lit(s: str) -> str:
    """A Lark string literal for s."""
    return json.dumps(s, ensure_ascii=False)


def call_grammar(tools: Sequence[Tool], choice: ToolChoice, shape: Shape,
                 lenient: bool | None = None) -> str | None:
    """The Lark grammar for `choice` over `tools` in `shape`, or None for mode "none".
    `lenient`: compile unknown schema keywords as warnings; default: only in "auto", for
    tools not marked strict."""
    if shape not in SHAPES:
        raise ValueError(f"unknown tool-call shape {shape!r}; known: {SHAPES}")
    if choice.mode == "none":
        return None
    chosen = list(tools)
    if choice.mode == "named":
        chosen = [t for t in tools if t.name == choice.name]
        if not chosen:
            raise ValueError(f"tool choice names '{choice.name}', which is not among the tools")
    if not chosen:
        raise ValueError(f"tool choice '{choice.mode}' needs at least one tool")
    lines = ["%llguidance {}"]
    lines += _body(shape, choice)
    lines.append("call: " + " | ".join(f"c{i}" for i in range(len(chosen))))
    lines += _call_rules(chosen, choice, shape, lenient)
    return "\n".join(lines) + "\n"


def tools_grammar(tools: Sequence[Tool], choice: ToolChoice, shape: Shape) -> tuple[str, str] | None:
    """(constraint kind, source) for `choice` over `tools` — custom tools among them too — or
    None for mode "none". Without custom tools: `call_grammar`'s Lark. With them, a reply may
    also be one custom tool's raw block (imp.tools.custom), whose input the tool's own grammar
    holds: llguidance's several-grammar form, the main Lark referencing each tool's grammar;
    free text may not open a block, so a block is always under its grammar."""
    customs = [t for t in tools if t.custom]
    if not customs:
        g = call_grammar(tools, choice, shape)
        return ("lark", g) if g else None
    if choice.mode == "none":
        return None
    fns = [t for t in tools if not t.custom]
    if choice.mode == "named":
        hit = [t for t in customs if t.name == choice.name]
        if not hit:  # a named function tool: the custom tools are not asked for
            return tools_grammar(fns, choice, shape)
        customs, fns = hit, []
    block, subs = block_rules(customs)
    lines = ["%llguidance {}"]
    if fns:
        body = _body(shape, choice, not_block=True)
        lines += [body[0].replace("start:", "calls:", 1), *body[1:], "start: calls | custom"]
        lines.append("call: " + " | ".join(f"c{i}" for i in range(len(fns))))
        lines += _call_rules(fns, choice, shape, None)
    elif choice.mode == "auto":  # a reply, or a custom call
        if shape == "generic":
            lines += ['start: "{\\"response\\": " reply "}" | custom', 'reply: %json {"type": "string"}']
        else:
            lines += ["start: TEXT | custom", f"TEXT: {_FREE_TEXT if shape == 'hermes' else _PLAIN_TEXT} & {NOT_A_BLOCK}"]
    else:
        lines.append("start: custom")
    return "llguidance", top_level("\n".join(lines + block) + "\n", subs)


def _call_rules(chosen: Sequence[Tool], choice: ToolChoice, shape: Shape, lenient: bool | None) -> list[str]:
    key = "parameters" if shape == "json" else "arguments"
    lines = []
    for i, t in enumerate(chosen):
        soft = (choice.mode == "auto" and not t.strict) if lenient is None else lenient
        head = "{" + f'"name": {json.dumps(t.name, ensure_ascii=False)}, "{key}": '
        lines.append(f'c{i}: {_lit(head)} a{i} "}}"')
        lines.append(f"a{i}: %json {json.dumps(arguments_schema(t, soft), ensure_ascii=False)}")
    return lines


def _body(shape: Shape, choice: ToolChoice, not_block: bool = False) -> list[str]:
    """The start rule (first) and its helpers of a shape; `call` is one call object.
    not_block: free text may not open a custom tool's block."""
    many = choice.parallel
    free = f"{_FREE_TEXT} & {NOT_A_BLOCK}" if not_block else _FREE_TEXT
    plain = f"{_PLAIN_TEXT} & {NOT_A_BLOCK}" if not_block else _PLAIN_TEXT
    if shape == "hermes":
        if choice.mode == "auto":
            # lazy: the free text ends at the first open tag, which must start a real call
            return [f"start: seg{'*' if many else '?'} TEXT",
                    'seg: head "\\n" call "\\n</tool_call>"',
                    'head[lazy]: TEXT "<tool_call>"',
                    f"TEXT: {free}"]
        return [f'start: tagged ("\\n" tagged){{0,{MAX_PARALLEL - 1}}}' if many else "start: tagged",
                'tagged: "<tool_call>\\n" call "\\n</tool_call>"']
    if shape == "json":
        calls = f'call ("; " call){{0,{MAX_PARALLEL - 1}}}' if many else "call"
        if choice.mode == "auto":
            return [f"start: TEXT | {calls}", f"TEXT: {plain}"]
        return [f"start: {calls}"]
    envelope = (f'"{{\\"tool_calls\\": [" call (", " call){{0,{MAX_PARALLEL - 1}}} "]}}"' if many
                else '"{\\"tool_call\\": " call "}"')
    if choice.mode == "auto":
        return [f"start: {envelope} | " + '"{\\"response\\": " reply "}"',
                'reply: %json {"type": "string"}']
    return [f"start: {envelope}"]
