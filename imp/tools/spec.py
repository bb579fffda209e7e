"""Neutral tool definitions and tool choice, and the dialects' spellings mapped onto them.

`Tool` and `ToolChoice` are what the rest of imp.tools (parse, grammar, render) takes; each
dialect maps its own request fields with one pure function here:

| dialect | tools | choice | parallel |
|---|---|---|---|
| OpenAI chat (`from_openai`) | `[{"type": "function", "function": {name, description, parameters, strict}}]` | `"auto"`, `"none"`, `"required"`, `{"type": "function", "function": {"name"}}` | `parallel_tool_calls` |
| OpenAI Responses (`from_responses`) | `[{"type": "function", name, description, parameters, strict}]` | `"auto"`, `"none"`, `"required"`, `{"type": "function", "name"}` | `parallel_tool_calls` |
| Anthropic Messages (`from_anthropic`) | `[{name, description, input_schema}]` | `{"type": "auto" \\| "any" \\| "tool" \\| "none", "name"?, "disable_parallel_tool_use"?}` | `not disable_parallel_tool_use` |

A bad field raises `ToolSpecError(message, param)` naming it (`tools[2].function.name`), for
the dialect to turn into its 400. Omitted choice: "auto" with tools, "none" without. A choice
that asks for a call (required / named) without tools, or names an unknown tool, is an error,
never a silent "auto".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

Mode = Literal["auto", "none", "required", "named"]
MODES: tuple[str, ...] = ("auto", "none", "required", "named")

_OPENAI_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_ANTHROPIC_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")


class ToolSpecError(ValueError):
    """A tools / tool_choice field that cannot be honoured; `param` names it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message, param)
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message


def _empty_object() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    """One callable function. `parameters` is the JSON Schema of its arguments object;
    `strict` is the client's request that arguments follow it exactly (OpenAI `strict`). A
    custom tool has no parameters: its input is raw text under its `grammar`."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=_empty_object)
    strict: bool = False
    # a custom tool (OpenAI's `custom` type) takes raw text, not JSON arguments; its `format`:
    # ("lark" | "regex", definition), or None for free text (imp.tools.custom)
    custom: bool = False
    grammar: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c < " " for c in self.name):
            raise ValueError(f"tool name must be a non-empty string without control characters: {self.name!r}")
        if not isinstance(self.parameters, dict):
            raise ValueError("tool parameters must be a JSON Schema object")


@dataclass(frozen=True)
class ToolChoice:
    """auto: text or calls; none: no calls; required: at least one call to any tool;
    named: a call to `name`. `parallel`: several calls in one turn allowed."""

    mode: Mode = "auto"
    name: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"tool choice mode must be one of {MODES}, not {self.mode!r}")
        if (self.mode == "named") != (self.name is not None):
            raise ValueError("a named tool choice needs a name, and only it has one")

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "named")


# ------------------------------------------------------------------------- shared checks

def _list(tools: Any, param: str) -> list:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ToolSpecError(f"'{param}' must be an array", param)
    return tools


def _description(d: dict, key: str, where: str) -> str:
    v = d.get(key)
    if v is not None and not isinstance(v, str):
        raise ToolSpecError(f"'{where}.{key}' must be a string", f"{where}.{key}")
    return v or ""


def _schema(d: dict, key: str, where: str, required: bool) -> dict[str, Any]:
    v = d.get(key)
    if v is None:
        if required:
            raise ToolSpecError(f"'{where}.{key}' is required", f"{where}.{key}")
        return _empty_object()
    if not isinstance(v, dict):
        raise ToolSpecError(f"'{where}.{key}' must be a JSON Schema object", f"{where}.{key}")
    if v.get("type", "object") != "object":
        # the arguments are always one JSON object: a schema of another type cannot be met
        raise ToolSpecError(f"'{where}.{key}.type' must be 'object'", f"{where}.{key}.type")
    return v


def _strict(d: dict, where: str) -> bool:
    v = d.get("strict")
    if v is not None and not isinstance(v, bool):
        raise ToolSpecError(f"'{where}.strict' must be a boolean", f"{where}.strict")
    return bool(v)


def _name(d: dict, key: str, where: str, pattern: re.Pattern) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise ToolSpecError(f"'{where}.{key}' must be a string matching ^{pattern.pattern}$", f"{where}.{key}")
    return v


def _unique(tools: list[Tool], params: list[str]) -> None:
    seen: set[str] = set()
    for t, p in zip(tools, params):
        if t.name in seen:
            raise ToolSpecError(f"'{p}': tool name '{t.name}' is defined twice", p)
        seen.add(t.name)


def _parallel(value: Any, param: str) -> bool:
    # Unset means one call per turn, as llama.cpp's server defaults it: a small model allowed
    # "one or more" calls repeats the same call until max_tokens cuts the reply. A client that
    # wants several sends parallel_tool_calls: true.
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ToolSpecError(f"'{param}' must be a boolean", param)
    return value


def _choice(mode: str, name: str | None, tools: list[Tool], parallel: bool,
            param: str, name_param: str) -> ToolChoice:
    if mode in ("required", "named") and not tools:
        raise ToolSpecError(f"'{param}' asks for a tool call but no tools are given", param)
    if mode == "named" and name not in {t.name for t in tools}:
        raise ToolSpecError(f"'{name_param}': no tool named '{name}' is given", name_param)
    if mode == "auto" and not tools:
        mode = "none"  # nothing to call: no call can be made, nothing is ignored
    return ToolChoice(mode, name if mode == "named" else None, parallel)


# ----------------------------------------------------------------------------- dialects

def from_openai(tools: Any, tool_choice: Any = None,
                parallel_tool_calls: Any = None) -> tuple[list[Tool], ToolChoice]:
    """OpenAI chat completions `tools` / `tool_choice` / `parallel_tool_calls`."""
    out: list[Tool] = []
    params: list[str] = []
    for i, t in enumerate(_list(tools, "tools")):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ToolSpecError(f"'{w}' must be an object", w)
        if t.get("type") == "custom":  # raw-text input under its format (imp.tools.custom)
            c = t.get("custom")
            if not isinstance(c, dict):
                raise ToolSpecError(f"'{w}.custom' must be an object", f"{w}.custom")
            out.append(custom_tool(c, f"{w}.custom", c.get("format"), nested=True))
            params.append(f"{w}.custom.name")
            continue
        if t.get("type", "function") != "function":
            raise ToolSpecError(f"'{w}.type': only 'function' and 'custom' tools are supported, not "
                                f"{t.get('type')!r}", f"{w}.type")
        f = t.get("function")
        if not isinstance(f, dict):
            raise ToolSpecError(f"'{w}.function' must be an object", f"{w}.function")
        fw = f"{w}.function"
        out.append(_function_tool(f, fw))
        params.append(f"{fw}.name")
    _unique(out, params)
    parallel = _parallel(parallel_tool_calls, "parallel_tool_calls")
    mode, name = _openai_choice(tool_choice, nested=True)
    return out, _choice(mode, name, out, parallel, "tool_choice", "tool_choice.function.name")


def from_responses(tools: Any, tool_choice: Any = None,
                   parallel_tool_calls: Any = None) -> tuple[list[Tool], ToolChoice]:
    """OpenAI Responses `tools` (flat function tools) / `tool_choice` / `parallel_tool_calls`.
    Other tool types (custom, web_search, ...) are refused here, by name: the dialect decides
    what to do with them before calling this."""
    out: list[Tool] = []
    params: list[str] = []
    for i, t in enumerate(_list(tools, "tools")):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ToolSpecError(f"'{w}' must be an object", w)
        if t.get("type") != "function":
            raise ToolSpecError(f"'{w}.type': only 'function' tools are supported, not {t.get('type')!r}", f"{w}.type")
        out.append(_function_tool(t, w))
        params.append(f"{w}.name")
    _unique(out, params)
    parallel = _parallel(parallel_tool_calls, "parallel_tool_calls")
    mode, name = _openai_choice(tool_choice, nested=False)
    return out, _choice(mode, name, out, parallel, "tool_choice", "tool_choice.name")


def _function_tool(d: dict, where: str) -> Tool:
    """An OpenAI function definition (chat's `function` object, or a flat Responses tool)."""
    return Tool(_name(d, "name", where, _OPENAI_NAME), _description(d, "description", where),
                _schema(d, "parameters", where, required=False), _strict(d, where))


def custom_tool(d: dict, where: str, fmt: Any, *, nested: bool) -> Tool:
    """A custom tool: name, description, and `format` — text, or a grammar: chat's
    `{"type": "grammar", "grammar": {"syntax", "definition"}}` (nested), Responses'
    `{"type": "grammar", "syntax", "definition"}`."""
    name = _name(d, "name", where, _OPENAI_NAME)
    fw = f"{where}.format"
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return Tool(name, _description(d, "description", where), custom=True)
    if not isinstance(fmt, dict) or fmt.get("type") != "grammar":
        raise ToolSpecError(f"'{fw}.type' must be text or grammar", fw)
    g = fmt.get("grammar") if nested else fmt
    if not isinstance(g, dict) or g.get("syntax") not in ("lark", "regex") \
            or not isinstance(g.get("definition"), str) or not g["definition"].strip():
        raise ToolSpecError(f"'{fw}' must be a grammar with syntax lark or regex and a definition", fw)
    return Tool(name, _description(d, "description", where), custom=True, grammar=(g["syntax"], g["definition"]))


def _openai_choice(choice: Any, nested: bool) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, dict) and choice.get("type") == "custom" and nested:
        c = choice.get("custom")
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            raise ToolSpecError("'tool_choice.custom.name' must be a string", "tool_choice.custom.name")
        return "named", c["name"]
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ToolSpecError("'tool_choice' must be 'auto', 'none', 'required' or a function object", "tool_choice")
        return choice, None
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise ToolSpecError("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", ...}",
                            "tool_choice")
    if nested:
        f = choice.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ToolSpecError("'tool_choice.function.name' must be a string", "tool_choice.function.name")
        return "named", f["name"]
    if not isinstance(choice.get("name"), str):
        raise ToolSpecError("'tool_choice.name' must be a string", "tool_choice.name")
    return "named", choice["name"]


_ANTHROPIC_CHOICES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}


def from_anthropic(tools: Any, tool_choice: Any = None) -> tuple[list[Tool], ToolChoice]:
    """Anthropic Messages `tools` / `tool_choice`. Server tools (a `type` other than
    "custom", e.g. web_search_20250305) run on Anthropic's side and have no schema for a
    local model to fill: they are left out of the result, as the template rendering does."""
    out: list[Tool] = []
    params: list[str] = []
    for i, t in enumerate(_list(tools, "tools")):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ToolSpecError(f"'{w}' must be an object", w)
        if t.get("type") not in (None, "custom"):
            if not isinstance(t.get("type"), str):
                raise ToolSpecError(f"'{w}.type' must be a string", f"{w}.type")
            continue
        out.append(Tool(_name(t, "name", w, _ANTHROPIC_NAME), _description(t, "description", w),
                        _schema(t, "input_schema", w, required=True), _strict(t, w)))
        params.append(f"{w}.name")
    _unique(out, params)
    if tool_choice is None:
        return out, _choice("auto", None, out, False, "tool_choice", "tool_choice.name")
    if not isinstance(tool_choice, dict) or tool_choice.get("type") not in _ANTHROPIC_CHOICES:
        raise ToolSpecError(f"'tool_choice.type' must be one of {sorted(_ANTHROPIC_CHOICES)}", "tool_choice.type")
    disable = tool_choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise ToolSpecError("'tool_choice.disable_parallel_tool_use' must be a boolean",
                            "tool_choice.disable_parallel_tool_use")
    mode = _ANTHROPIC_CHOICES[tool_choice["type"]]
    name = tool_choice.get("name")
    if mode == "named" and not isinstance(name, str):
        raise ToolSpecError("'tool_choice.name' must be a string when 'type' is 'tool'", "tool_choice.name")
    # disable_parallel_tool_use unset: one call per turn (see _parallel); false asks for several
    return out, _choice(mode, name if mode == "named" else None, out, disable is False,
                        "tool_choice", "tool_choice.name")
