"""Our own bounds on JSON Schemas, checked before llguidance sees one.

llguidance bounds its own work (grammar size, lexer fuel, Earley items per
step: see `compile.default_parser_limits`), and the compile deadline is the
backstop for the rest. Two shapes stay cheap for llguidance yet are not
worth compiling, so we refuse them up front, with a reason that names them:

  * numeric bounds beyond any context window (`maxLength: 10**9`,
    `minItems: 10**9`): no output can reach them, a `min*` one is
    unsatisfiable, and a lexer counting to them grows one state per
    character generated;
  * many object properties: llguidance compiles an object of optional
    properties in O(n^2) (measured on the dev box: 1,000 in 0.15 s,
    2,000 in 0.7 s, 5,000 in 3.8 s, past every deadline).

The defaults follow OpenAI's structured-outputs limits in spirit (they cap
properties, nesting and enum sizes); ours are what llguidance can compile
well inside the one-second deadline on a small CPU.
"""

from __future__ import annotations

from typing import Any

import msgspec

from imp.constrain.errors import ConstraintError

# keywords whose value is a count of characters / items / properties
_BOUND_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                   "minContains", "maxContains")
# keywords whose value is one subschema / a list of them / a name -> subschema map
_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "contains",
        "propertyNames", "not", "if", "then", "else", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


class SchemaLimits(msgspec.Struct, frozen=True):
    """What a spec may ask for: its size, and for JSON Schemas (counted over every subschema)
    the bounds and counts below."""

    max_source_chars: int = 1_000_000  # the spec text itself (any kind): decoding 3.6 MB of
    # schema alone took 0.7 s on the loaded dev box, most of the deadline
    max_bound: int = 100_000  # largest minLength/maxLength/minItems/... value
    max_properties: int = 1_000  # object properties over the whole schema
    max_depth: int = 64  # nesting of subschemas (a recursion guard for our own walk)
    max_enum: int = 10_000  # values in all enums together


def subschemas(node: dict) -> list[Any]:
    """The direct subschemas of a schema object (the keywords that hold schemas)."""
    out: list[Any] = []
    for k in _ONE:
        if k in node:
            out.append(node[k])
    for k in _LIST:
        v = node.get(k)
        if isinstance(v, list):
            out.extend(v)
    if isinstance(node.get("items"), list):  # draft-04 tuple form
        out.extend(node["items"])
    for k in _MAP:
        v = node.get(k)
        if isinstance(v, dict):
            out.extend(v.values())
    return out


def check_schema(schema: Any, limits: SchemaLimits) -> None:
    """Raise ConstraintError when `schema` asks for more than `limits` allow."""
    props = 0
    enums = 0
    # iterative walk: a hostile schema must not blow Python's recursion limit
    stack: list[tuple[Any, int]] = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        if depth > limits.max_depth:
            raise ConstraintError(f"schema nests deeper than {limits.max_depth} levels")
        for k in _BOUND_KEYWORDS:
            v = node.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > limits.max_bound:
                raise ConstraintError(
                    f"{k} {v} exceeds the limit of {limits.max_bound} (no output can be that long)")
        p = node.get("properties")
        if isinstance(p, dict):
            props += len(p)
            if props > limits.max_properties:
                raise ConstraintError(
                    f"schema has more than {limits.max_properties} object properties in all")
        e = node.get("enum")
        if isinstance(e, list):
            enums += len(e)
            if enums > limits.max_enum:
                raise ConstraintError(f"schema has more than {limits.max_enum} enum values in all")
        stack.extend((s, depth + 1) for s in subschemas(node))
