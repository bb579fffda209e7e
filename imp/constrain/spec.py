"""What a request constrains its output to, and the llguidance grammar for it.

A `Constraint` is plain data (it rides in messages and the event log); the
grammar text is derived from it on demand, deterministically, so replay
rebuilds the same grammar from the same Constraint.

Kinds (the request fields that produce them, in HTTP's words):
    json_schema  source = a JSON Schema as JSON text (response_format json_schema,
                 Responses text.format, vLLM guided_json / structured_outputs.json)
    json_object  any JSON object; source is ignored (response_format json_object)
    regex        source = a regex, Rust `regex` syntax, matched against the whole output
    lark         source = a Lark grammar, llguidance's dialect (docs/syntax.md upstream)
    gbnf         source = a llama.cpp GBNF grammar (the `grammar` field)

`strict` (json_schema only) follows OpenAI's structured outputs: the root
must be an object schema, and every object schema that does not say
otherwise gets `additionalProperties: false` (OpenAI requires the keyword;
we supply it). Without `strict`, JSON Schema's own defaults hold (extra
properties allowed). In both modes every keyword is enforced or refused:
llguidance runs non-lenient, so an unsupported keyword is a ConstraintError
naming it, never a constraint silently dropped.
"""

from __future__ import annotations

from typing import Any

import llguidance
import msgspec
from llguidance.gbnf_to_lark import any_to_lark

from imp.constrain.errors import ConstraintError
from imp.messages import Constraint  # the catalogue's value; re-exported here for the constraint layer
from imp.constrain.limits import SchemaLimits, check_schema, subschemas

# llguidance: its several-grammar JSON form ({"grammars": [{"name", "lark_grammar"}, ...]}), which
# the tool layer builds to hold a custom tool's input to its own grammar (imp.tools.custom)
KINDS = ("json_schema", "json_object", "regex", "lark", "gbnf", "llguidance")

# Options for llguidance's JSON compiler, overridable by a schema's own top-level
# "x-guidance". Whitespace is bounded (at most 16 characters between tokens of the
# JSON text): with llguidance's default (any run of whitespace) a small model can
# loop on newlines forever and still "match" the schema.
JSON_DEFAULTS: dict[str, Any] = {
    "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}",
    "lenient": False,
    "coerce_one_of": False,
}


def grammar_text(c: Constraint, limits: SchemaLimits | None = None) -> str:
    """The llguidance top-level grammar (Lark text or a JSON grammar list) for `c`.

    Raises ConstraintError for what can be judged without compiling: an
    unknown kind, a schema that is not JSON or not an object, one over
    `limits`, a GBNF grammar that does not convert. Whether llguidance
    accepts the result is for `compile` to find out."""
    limits = limits or SchemaLimits()
    if len(c.source) > limits.max_source_chars:
        raise ConstraintError(f"{c.kind} is {len(c.source)} characters long, over the limit of "
                              f"{limits.max_source_chars}")
    if c.kind == "json_schema":
        return _json_schema(c.source, c.strict, limits)
    if c.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if c.kind == "regex":
        if not c.source:
            raise ConstraintError("regex is empty")
        return llguidance.LLMatcher.grammar_from_regex(c.source)
    if c.kind == "lark":
        if not c.source.strip():
            raise ConstraintError("lark grammar is empty")
        return llguidance.LLMatcher.grammar_from_lark(c.source)
    if c.kind == "gbnf":
        if not c.source.strip():
            raise ConstraintError("gbnf grammar is empty")
        try:
            lark = any_to_lark(c.source)
        except Exception as e:  # noqa: BLE001 - the converter raises bare Exception too
            raise ConstraintError(f"invalid GBNF grammar: {e}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    if c.kind == "llguidance":
        try:
            return llguidance.grammar_from("llguidance", c.source)
        except ValueError as e:
            raise ConstraintError(f"invalid grammar: {e}") from None
    raise ConstraintError(f"unknown constraint kind {c.kind!r} (known: {', '.join(KINDS)})")


def _json_schema(source: str, strict: bool, limits: SchemaLimits) -> str:
    try:
        schema = msgspec.json.decode(source)  # several times faster than json.loads on big schemas
    except RecursionError:
        raise ConstraintError("json_schema nests too deep to decode") from None
    except msgspec.DecodeError as e:
        raise ConstraintError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        # JSON Schema allows `true`/`false` as schemas; no API sends them and llguidance's
        # option merging needs an object, so anything but an object is refused.
        raise ConstraintError(f"json_schema must be a JSON object, got {type(schema).__name__}")
    check_schema(schema, limits)
    if strict:
        if schema.get("type") != "object":
            raise ConstraintError("strict json_schema: the root schema must have type \"object\"")
        schema = _close_objects(schema)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    except (ValueError, TypeError) as e:
        raise ConstraintError(f"json_schema rejected: {e}") from None


def _is_object_schema(node: dict) -> bool:
    t = node.get("type")
    return t == "object" or (isinstance(t, list) and "object" in t) or "properties" in node


def _close_objects(schema: dict) -> dict:
    """A copy of `schema` with `additionalProperties: false` on every object schema that
    sets neither it nor `patternProperties` (OpenAI strict mode's rule)."""
    root = msgspec.json.decode(msgspec.json.encode(schema))  # deep copy: the caller's dict is not ours to edit
    stack = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if _is_object_schema(node) and "additionalProperties" not in node and "patternProperties" not in node:
            node["additionalProperties"] = False
        stack.extend(subschemas(node))
    return root
