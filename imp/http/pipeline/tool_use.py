"""Tool calling for every dialect: how the model is shown its tools, forced to call, and read back.

A dialect maps its `tools` / `tool_choice` into `imp.tools` values (Tool,
ToolChoice); `plan` decides, once per request, everything that follows:

- the shape of a call: "hermes" (`<tool_call>{...}</tool_call>`) when the chat
  template speaks it natively (Qwen, Hermes fine-tunes), else the "generic"
  JSON envelope of llama.cpp's generic handler (`{"tool_calls": [...]}` /
  `{"response": "..."}`) for models with no format of their own (SmolLM2,
  Gemma 3);
- how the tools reach the prompt: to the template's `tools` when it renders
  them, else as a system-prompt block (`imp.tools.render`) — and earlier turns'
  calls and results are rewritten in the same shape, so the model always sees
  its own format;
- the grammar (`Constraint`): a forced choice (required / named / Anthropic
  any / tool) always gets one, built from the tools' parameter schemas, so a
  forced call parses and its arguments validate; "auto" in the generic shape
  too (the envelope is the only way that model can call), and "auto" whenever a custom
  tool is offered (its raw-text input is held to its own grammar whenever it is called,
  `imp.tools.custom`); "none" hides the tools;
- the parser that turns the model's text back into calls, streamed or not.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from imp.http.errors import ApiError, bad
from imp.http.pipeline.request import Message
from imp.messages import Constraint
from imp.tools import (
    ArgsDelta, CallEnd, CallStart, Parsed, Text, Tool, ToolCall, ToolChoice, ToolStreamParser, call_message_text,
    new_call_id, parse, result_text, stream_parser, tools_grammar, tools_system_prompt,
)
from imp.tools.render import custom_tools_prompt


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[Tool, ...]
    choice: ToolChoice
    shape: str  # "hermes" | "generic"
    native: bool  # the chat template renders the tools itself
    constraint: Constraint | None

    @property
    def active(self) -> bool:
        """Calls may come back (and are parsed)."""
        return self.choice.mode != "none" and bool(self.tools)

    def template_tools(self) -> tuple[dict, ...]:
        """What the template's `tools` variable gets (OpenAI function shape), if it renders them."""
        if not (self.native and self.active):
            return ()
        return tuple({"type": "function", "function": {"name": t.name, "description": t.description,
                                                       "parameters": t.parameters}} for t in self.tools if not t.custom)

    @property
    def custom(self) -> frozenset[str]:
        """The names of the custom tools (raw-text input)."""
        return frozenset(t.name for t in self.tools if t.custom)

    def stream_parser(self) -> ToolStreamParser:
        return stream_parser(self.shape, list(self.tools), new_id=new_call_id)

    def parse(self, text: str, cut: bool = False) -> Parsed:
        """The calls and text of a whole reply. cut: max_tokens ended it (see `salvage`)."""
        got = parse(text, self.shape, list(self.tools), new_id=new_call_id)
        if cut and not got.calls and self.shape == "generic" and cut_in_envelope(text):
            return Parsed("", tuple(salvage(text)))
        return got

    def finish(self, parser: ToolStreamParser, cut: bool) -> list:
        """A stream parser's last events; a reply max_tokens cut inside a generic envelope gives
        the calls it completed (as `parse(..., cut=True)` does), never the envelope as text."""
        events = parser.finish()
        if cut and self.shape == "generic" and not parser_called(parser):
            held = "".join(ev.text for ev in events if isinstance(ev, Text))
            if cut_in_envelope(held):
                out = []
                for k, c in enumerate(salvage(held)):
                    out += [CallStart(k, c.id, c.name), ArgsDelta(k, c.arguments), CallEnd(k)]
                return out
        return events


_ENVELOPE = '{"tool_calls": ['
_ONE_CALL = '{"tool_call": '
_CALL_KEY = re.compile(r'\{\s*"tool_calls?"')


def cut_in_envelope(text: str) -> bool:
    """max_tokens ended the reply inside a generic call envelope (or inside its opening key):
    such a reply is the calls it completed and no text. Its JSON is the model's call markup,
    not an answer: shown as content it becomes the agent's message (Codex printed it)."""
    s = text.lstrip()
    return bool(s) and (bool(_CALL_KEY.match(s)) or '{"tool_call'.startswith(re.sub(r"\s+", "", s)))


def salvage(text: str) -> list[ToolCall]:
    """The complete calls of a generic envelope that max_tokens cut: `{"tool_calls": [{...},
    {...}, {"na` -> the first two (`{"tool_call": {...}` cut before its last brace -> that one).
    The model asked for them; the cut only lost the rest."""
    s = text.lstrip()
    dec = json.JSONDecoder()
    if s.startswith(_ONE_CALL):
        try:
            obj, _ = dec.raw_decode(s, len(_ONE_CALL))
        except ValueError:
            return []
        ok = isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)
        return [ToolCall(new_call_id(), obj["name"], json.dumps(obj["arguments"], ensure_ascii=False,
                                                                separators=(",", ":")))] if ok else []
    if not s.startswith(_ENVELOPE):
        return []
    i, calls = len(_ENVELOPE), []
    while i < len(s):
        try:
            obj, i = dec.raw_decode(s, i)
        except ValueError:
            break
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
            break
        calls.append(ToolCall(new_call_id(), obj["name"], json.dumps(obj["arguments"], ensure_ascii=False,
                                                                      separators=(",", ":"))))
        while i < len(s) and s[i] in ", \n":
            i += 1
    return calls


def parser_called(parser: ToolStreamParser) -> bool:
    return parser.calls_started > 0


def shape_for(template_source: str) -> tuple[str, bool]:
    """(shape, native): Hermes when the template itself writes `<tool_call>` tags."""
    if "<tool_call>" in template_source and "tools" in template_source:
        return "hermes", True
    return "generic", False


# In the generic shape (models with no tool format of their own: SmolLM2, Gemma 3), after this
# many tool rounds since the user last spoke, "auto" must answer: such a model, shown its call
# and the result, calls the same tool again and again (an agent loop that never ends). A
# model that speaks a native format (hermes) is never held to it. Forced choices are unchanged.
GENERIC_TOOL_ROUNDS = 1
_ANSWER_ONLY = '%llguidance {}\nstart: "{\\"response\\": " reply "}"\nreply: %json {"type": "string"}\n'


def tool_rounds(messages) -> int:
    """Assistant turns that called tools since the last user message (tool results are `tool`
    turns, whatever the dialect's spelling)."""
    n = 0
    for m in reversed(messages):
        if m.role == "user":
            break
        if m.role == "assistant" and m.tool_calls:
            n += 1
    return n


def plan(tools: list[Tool], choice: ToolChoice, template_source: str, messages=()) -> ToolPlan | None:
    """None when the request has no tools (nothing to show, parse or force). messages: the
    conversation so far (for GENERIC_TOOL_ROUNDS)."""
    if not tools:
        return None
    shape, native = shape_for(template_source)
    constraint = None
    custom = any(t.custom for t in tools)
    if choice.mode != "none" and (choice.forces_call or shape == "generic" or custom):
        if choice.mode == "auto" and shape == "generic" and tool_rounds(messages) >= GENERIC_TOOL_ROUNDS:
            return ToolPlan(tuple(tools), choice, shape, native, Constraint("lark", _ANSWER_ONLY))
        try:
            grammar = tools_grammar(tools, choice, shape)
        except ValueError as exc:
            raise ApiError(400, f"tool_choice cannot be enforced: {exc}", param="tool_choice",
                           code="tool_choice_unenforceable") from None
        constraint = Constraint(*grammar) if grammar else None
    return ToolPlan(tuple(tools), choice, shape, native, constraint)


def apply_to_messages(p: ToolPlan | None, messages: tuple[Message, ...]) -> tuple[Message, ...]:
    """The conversation as the template should see it. A native template gets the messages
    as they are (it renders tool_calls and tool turns itself); otherwise the tools go into
    the system prompt and earlier calls / results become text in the plan's shape."""
    if p is None:
        return messages
    if p.native:  # the template shows the function tools; the custom ones are a system note
        customs = [t for t in p.tools if t.custom]
        if not (customs and p.active):
            return messages
        return _with_system(list(messages), custom_tools_prompt(customs, p.choice))
    out: list[Message] = []
    block = tools_system_prompt(list(p.tools), p.choice, p.shape) if p.active else ""
    names: dict[str, str] = {}
    for m in messages:
        if m.role == "assistant" and (m.tool_calls or (p.active and p.shape == "generic")):
            calls = []
            for c in m.tool_calls or ():
                fn = c.get("function") or {}
                args = fn.get("arguments", "{}")
                if not isinstance(args, str):
                    args = json.dumps(args, ensure_ascii=False)
                cid = c.get("id") or ""
                names[cid] = fn.get("name", "")
                calls.append(ToolCall(cid, fn.get("name", ""), args))
            # a text-only assistant turn in the generic shape is a {"response": ...} envelope
            out.append(Message(role="assistant", content=call_message_text(calls, p.shape, m.content,
                                                                           p.choice.parallel, p.custom)))
        elif m.role == "tool":
            name = m.name or names.get(m.tool_call_id or "")
            is_error = m.content.startswith("Error: ") and False
            text = result_text(name, m.content, p.shape, m.tool_call_id, is_error)
            if out and out[-1].role == "user":  # several results of one turn: one user message
                out[-1] = Message(role="user", content=out[-1].content + "\n" + text)
            else:
                out.append(Message(role="user", content=text))
        else:
            out.append(m)
    return _with_system(out, block) if block else tuple(out)


def _with_system(out: list[Message], block: str) -> tuple[Message, ...]:
    if out and out[0].role == "system":
        out[0] = Message(role="system", content=(out[0].content + "\n\n" + block).strip())
    else:
        out.insert(0, Message(role="system", content=block))
    return tuple(out)


def check_compatible(p: ToolPlan | None, other: Constraint | None, other_field: str | None) -> None:
    """A forced call and a response_format both constrain the same output: refuse, naming both."""
    if p is not None and p.constraint is not None and other is not None:
        raise bad(f"'tool_choice' and '{other_field}' both constrain the output: send one", "tool_choice",
                  "tool_choice_unenforceable")
