"""Structured-output fields of every dialect -> one Constraint, compiled before anything runs.

The spellings clients send:
    OpenAI        response_format: {"type": "text" | "json_object" | "json_schema",
                                    "json_schema": {"name", "schema", "strict"}}
    llama.cpp     grammar (GBNF), json_schema (a schema object), response_format
                  {"type": "json_object", "schema": {...}}
    vLLM          structured_outputs: {"json" | "regex" | "grammar" | "choice"},
                  guided_json / guided_regex / guided_grammar / guided_choice
    Anthropic     output_format: {"type": "json_schema", "schema": {...}}
    Responses     text.format: {"type": "text" | "json_object" | "json_schema", "schema", "strict"}
At most one may be given (two are a 400 naming both). `compile` runs the grammar
compiler off the loop under a deadline: a schema that cannot be enforced is a 400
naming the field and the reason, never a quietly ignored field.
"""

from __future__ import annotations

import json
import re

from imp.constrain.compile import GrammarCache
from imp.constrain.errors import ConstraintError
from imp.http.errors import bad
from imp.messages import Constraint

COMPILE_TIMEOUT_S = 1.0


def _schema_text(v, where: str) -> str:
    """A JSON Schema given as an object (or as JSON text, as vLLM also allows)."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as exc:
            raise bad(f"'{where}' is not valid JSON: {exc}", where) from None
    if not isinstance(v, dict):
        raise bad(f"'{where}' must be a JSON Schema object", where)
    return json.dumps(v, ensure_ascii=False, sort_keys=False)


def _string(v, where: str) -> str:
    if not isinstance(v, str) or not v:
        raise bad(f"'{where}' must be a non-empty string", where)
    return v


def _choice(v, where: str) -> Constraint:
    """vLLM's guided_choice: the output is exactly one of the strings."""
    if not isinstance(v, list) or not v or not all(isinstance(s, str) and s for s in v):
        raise bad(f"'{where}' must be a non-empty array of non-empty strings", where)
    return Constraint("regex", "|".join(f"(?:{re.escape(s)})" for s in v))


def _openai_format(rf, where: str) -> Constraint | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad(f"'{where}' must be an object with a 'type'", where)
    t = rf["type"]
    if t == "text":
        return None
    if t == "json_object":
        if rf.get("schema") is not None:  # llama.cpp's spelling: json_object with a schema
            return Constraint("json_schema", _schema_text(rf["schema"], f"{where}.schema"))
        return Constraint("json_object")
    if t == "json_schema":
        js = rf.get("json_schema", rf)  # Responses' text.format puts name/schema/strict at the top
        if not isinstance(js, dict):
            raise bad(f"'{where}.json_schema' must be an object", f"{where}.json_schema")
        inner = f"{where}.json_schema" if "json_schema" in rf else where
        if js.get("schema") is None:
            raise bad(f"'{inner}.schema' is required", f"{inner}.schema")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"'{inner}.strict' must be a boolean", f"{inner}.strict")
        return Constraint("json_schema", _schema_text(js["schema"], f"{inner}.schema"), bool(strict))
    raise bad(f"'{where}.type' must be text, json_object or json_schema, got {t!r}", f"{where}.type")


def _structured_outputs(so) -> Constraint:
    if not isinstance(so, dict):
        raise bad("'structured_outputs' must be an object", "structured_outputs")
    given = [k for k in ("json", "regex", "grammar", "choice", "json_object") if so.get(k) is not None]
    unknown = [k for k in so if k not in ("json", "regex", "grammar", "choice", "json_object", "disable_fallback",
                                          "disable_additional_properties", "whitespace_pattern")]
    if unknown:
        raise bad(f"'structured_outputs.{unknown[0]}' is not supported (imp enforces json, regex, grammar, choice)",
                  f"structured_outputs.{unknown[0]}")
    if len(given) != 1:
        raise bad("'structured_outputs' needs exactly one of json, regex, grammar, choice", "structured_outputs")
    k = given[0]
    where = f"structured_outputs.{k}"
    if k == "json":
        return Constraint("json_schema", _schema_text(so[k], where))
    if k == "json_object":
        return Constraint("json_object")
    if k == "regex":
        return Constraint("regex", _string(so[k], where))
    if k == "grammar":
        return Constraint(_grammar_kind(so[k]), _string(so[k], where))
    return _choice(so[k], where)


def _grammar_kind(src) -> str:
    """A `grammar` string is GBNF (llama.cpp's `root ::= ...`) or llguidance's Lark."""
    return "gbnf" if isinstance(src, str) and "::=" in src else "lark"


# the body fields each dialect's constraint is read from (its request schema lists them)
FIELDS = {
    "openai": ("response_format", "grammar", "json_schema", "structured_outputs", "guided_json", "guided_regex",
               "guided_grammar", "guided_choice"),
    "anthropic": ("output_format",),
    "responses": ("text",),
}


def parse(body: dict, *, dialect: str) -> tuple[Constraint | None, str | None]:
    """(the request's constraint, the field that set it), or (None, None). dialect:
    "openai" (chat, completions), "anthropic", "responses"."""
    found: list[tuple[str, Constraint | None]] = []
    if dialect == "openai":
        if body.get("response_format") is not None:
            found.append(("response_format", _openai_format(body["response_format"], "response_format")))
        if body.get("grammar") is not None:
            found.append(("grammar", Constraint(_grammar_kind(body["grammar"]), _string(body["grammar"], "grammar"))))
        if body.get("json_schema") is not None:
            found.append(("json_schema", Constraint("json_schema", _schema_text(body["json_schema"], "json_schema"))))
        if body.get("structured_outputs") is not None:
            found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
        for k, make in (("guided_json", lambda v: Constraint("json_schema", _schema_text(v, "guided_json"))),
                        ("guided_regex", lambda v: Constraint("regex", _string(v, "guided_regex"))),
                        ("guided_grammar", lambda v: Constraint(_grammar_kind(v), _string(v, "guided_grammar"))),
                        ("guided_choice", lambda v: _choice(v, "guided_choice"))):
            if body.get(k) is not None:
                found.append((k, make(body[k])))
    elif dialect == "anthropic":
        of = body.get("output_format")
        if of is not None:
            if not isinstance(of, dict) or of.get("type") != "json_schema" or of.get("schema") is None:
                raise bad("'output_format' must be {\"type\": \"json_schema\", \"schema\": {...}}", "output_format")
            found.append(("output_format", Constraint("json_schema", _schema_text(of["schema"], "output_format.schema"),
                                                      True)))
    elif dialect == "responses":
        text = body.get("text")
        if isinstance(text, dict) and text.get("format") is not None:
            found.append(("text.format", _openai_format(text["format"], "text.format")))
    found = [(k, c) for k, c in found if c is not None]
    if len(found) > 1:
        raise bad(f"'{found[0][0]}' and '{found[1][0]}' both constrain the output: send one", found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


async def compile_checked(cache: GrammarCache, c: Constraint, field: str, *, code: str = "invalid_constraint"):
    """Compile (or find) c under the deadline; a ConstraintError is a 400 naming the field."""
    try:
        return await cache.compile(c, COMPILE_TIMEOUT_S)
    except ConstraintError as exc:
        raise bad(f"'{field}' cannot be enforced: {exc.reason}", field, code) from None
