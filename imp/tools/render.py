"""Tools as prompt text, for chat templates that do not take `tools` (SmolLM2, Gemma 3).

A template without tool support sees three things from here, all in one shape (the same
shape the grammar forces and the parser reads, so the model always sees its own format):

- `tools_system_prompt(tools, choice, shape)`: a block to append to (or use as) the system
  message: the tools as JSON (name, description, parameters) and the exact reply format.
- `call_message_text(calls, shape, content)`: an earlier assistant turn that made calls,
  as the text the model would have written (what the grammar produces, so
  `parse(call_message_text(calls, shape), shape)` gives the same calls back).
- `result_text(name, content, shape, call_id, is_error)`: a tool result, as the text of the
  message that carries it (a user turn for templates without a `tool` role).

Shapes: "hermes" follows Qwen 2.5's own system text (`<tools>` / `<tool_call>` /
`<tool_response>`); "generic" follows llama.cpp's generic handler (`tool_call(s)` /
`response` JSON envelopes, `{"tool_response": {...}}` results); "json" follows Llama 3.1's
JSON tool prompt (`{"name": ..., "parameters": ...}`).
"""

from __future__ import annotations

import json
from typing import Sequence

from imp.tools.custom import block
from imp.tools.grammar import SHAPES, Shape
from imp.tools.parse import ToolCall
from imp.tools.spec import Tool, ToolChoice


def _dumps(v) -> str:
    # the spacing the grammar forces (", " and ": "), non-ASCII kept readable
    return json.dumps(v, ensure_ascii=False)


def _tool_json(t: Tool) -> dict:
    return {"name": t.name, "description": t.description, "parameters": t.parameters}


def _check(shape: str) -> None:
    if shape not in SHAPES:
        raise ValueError(f"unknown tool-call shape {shape!r}; known: {SHAPES}")


def _choice_line(choice: ToolChoice, how: str) -> str:
    if choice.mode == "required":
        return f"You must call at least one tool now, {how}."
    if choice.mode == "named":
        return f"You must call the tool `{choice.name}` now, {how}."
    return ""


def tools_system_prompt(tools: Sequence[Tool], choice: ToolChoice, shape: Shape) -> str:
    """The system-prompt block listing the tools and the call format; "" for mode "none"
    (the tools are hidden). Deterministic: the same request renders the same text, so the
    prompt prefix cache keeps working across an agent's turns."""
    _check(shape)
    if choice.mode == "none" or not tools:
        return ""
    shown = [t for t in tools if choice.mode != "named" or t.name == choice.name]
    customs = [t for t in shown if t.custom]
    if customs:
        fns = [t for t in shown if not t.custom]
        head = tools_system_prompt(fns, choice, shape) if fns else ""
        if not fns and choice.mode == "auto" and shape == "generic":
            head = 'Reply to the user in JSON format: {"response": "<your reply>"}; or call a tool.'
        return "\n\n".join(x for x in (head, custom_tools_prompt(customs, choice)) if x)
    if shape == "hermes":
        listing = "\n".join(_dumps({"type": "function", "function": _tool_json(t)}) for t in shown)
        text = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listing}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
        line = _choice_line(choice, "in a <tool_call></tool_call> block")
        return text + ("\n\n" + line if line else "")
    listing = "\n".join(_dumps(_tool_json(t)) for t in shown)
    if shape == "json":
        text = ("You have access to the following functions:\n\n"
                f"{listing}\n\n"
                "To call a function, respond with only a JSON object of the form "
                '{"name": function name, "parameters": dictionary of argument name and its value}'
                + ('; to call several, separate the objects with "; "' if choice.parallel else "")
                + ". Do not use variables.")
        line = _choice_line(choice, "with that JSON object")
        if choice.mode == "auto":
            line = "If no function is needed, answer in plain text instead."
        return text + "\n\n" + line
    call = '{"name": "<tool name>", "arguments": {<arguments as JSON>}}'
    calls = (f'{{"tool_calls": [{call}, ...]}}' if choice.parallel else f'{{"tool_call": {call}}}')
    text = ("You can call these tools (JSON, with the JSON Schema of each tool's arguments):\n"
            f"{listing}\n\n")
    if choice.mode == "auto":
        text += ("Respond in JSON format, either with `" + ("tool_calls" if choice.parallel else "tool_call")
                 + "` (a request to call tools) or with `response` (a reply to the user's request):\n"
                 f"{calls}\nor\n" + '{"response": "<your reply>"}'
                 + "\n\nA `tool_response` is the result of a call you made: when it answers the request, "
                   "reply to the user with `response` instead of calling the tool again.")
        return text
    return text + f"Respond in JSON format with a tool call:\n{calls}\n\n" + _choice_line(choice, "in that format")


def custom_tools_prompt(customs: Sequence[Tool], choice: ToolChoice) -> str:
    """The custom tools (raw text input, imp.tools.custom) and how to call one."""
    lines = ["These tools take raw text as their input, not JSON:"]
    for t in customs:
        lines.append(f"- {t.name}: {t.description}".rstrip(": "))
        if t.grammar is not None:
            lines.append(f"  Its input must follow this {t.grammar[0]} grammar:\n{t.grammar[1]}")
    how = "reply with only this block, the input written as is (no JSON, no quotes):\n" + block("<tool name>", "<input>")
    if choice.mode == "named":
        lines.append(f"Call `{choice.name}` now: {how}")
    else:
        lines.append(f"To call one of them, {how}")
        if choice.mode == "required":
            lines.append("You must call a tool now.")
    return "\n".join(lines)


def _args(arguments: str) -> str:
    """A call's arguments JSON text in the forced spacing; text that is not JSON (a client's
    history may hold anything) is shown as a JSON string rather than dropped."""
    try:
        return _dumps(json.loads(arguments)) if arguments.strip() else "{}"
    except ValueError:
        return _dumps(arguments)


def _call_obj(name: str, args: str, key: str = "arguments") -> str:
    return "{" + f'"name": {_dumps(name)}, "{key}": {args}' + "}"


def call_message_text(calls: Sequence[ToolCall], shape: Shape, content: str = "",
                      parallel: bool = True, custom: frozenset[str] = frozenset()) -> str:
    """An assistant turn's text content and calls, as the model writes them in `shape`
    (generic: the calls' envelope, or `{"response": content}` for a turn without calls; the
    envelope has no room for text beside calls, so the calls are what is shown). A call of a
    custom tool (`custom`: their names) is its raw block, as the model writes it."""
    _check(shape)
    for c in calls:
        if c.name in custom:
            return block(c.name, _custom_input(c.arguments))
    if shape == "hermes":
        tags = [f"<tool_call>\n{_call_obj(c.name, _args(c.arguments))}\n</tool_call>" for c in calls]
        return "\n".join(([content] if content else []) + tags)
    if shape == "json":
        text = "; ".join(_call_obj(c.name, _args(c.arguments), "parameters") for c in calls)
        return content + "\n\n" + text if content and text else content or text
    if not calls:
        return _dumps({"response": content})
    items = [_call_obj(c.name, _args(c.arguments)) for c in calls]
    if len(items) == 1 and not parallel:
        return '{"tool_call": ' + items[0] + "}"
    return '{"tool_calls": [' + ", ".join(items) + "]}"


def _custom_input(arguments: str) -> str:
    try:
        v = json.loads(arguments).get("input", "")
    except (ValueError, AttributeError):
        return arguments
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def result_text(name: str | None, content: str, shape: Shape, call_id: str | None = None,
                is_error: bool = False) -> str:
    """A tool result as message text. `content` is the tool's output as text (the dialect
    flattens Anthropic's blocks first); `is_error` marks a failed call (Anthropic
    `is_error`), shown to the model as such."""
    _check(shape)
    if shape == "generic":
        body: dict = {"tool": name, "content": content}
        if call_id is not None:
            body["tool_call_id"] = call_id
        if is_error:
            body["is_error"] = True
        return _dumps({"tool_response": body})
    text = f"Error: {content}" if is_error else content
    if shape == "hermes":
        return f"<tool_response>\n{text}\n</tool_response>"
    return text  # Llama 3's ipython turn carries the output as is
