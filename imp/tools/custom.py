"""Custom tools: a call whose input is raw text, held to the tool's own grammar.

A custom tool (OpenAI's `custom` type: Codex's `apply_patch`) takes free text, not a JSON
object, and may give a `format`: a Lark grammar, a regex, or plain text. JSON would hide the
input behind string escaping, where the tool's grammar cannot see it, so in every call shape
a custom call is a raw block, the whole reply:

    <custom_tool name="apply_patch">
    *** Begin Patch
    ...
    *** End Patch
    </custom_tool>

The input is the text between the opening line and the closing one, byte for byte. The
grammars (`imp.tools.grammar`) compose the tool's own grammar into the block with llguidance
(`@name` references between grammars), so whenever the model calls the tool — tool_choice
auto, required or named — its input parses under that grammar. Parsing (`parse_block`, and
`CustomFront` streaming) recognizes a block only for the request's custom tools; anything else
goes to the shape's own parser.
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

from imp.tools.spec import Tool

OPEN = '<custom_tool name="'
OPEN_END = '">\n'
CLOSE = "\n</custom_tool>"


def block(name: str, text: str) -> str:
    """A custom call as the model writes it."""
    return f"{OPEN}{name}{OPEN_END}{text}{CLOSE}"


def custom_names(tools: Sequence[Tool] | None) -> frozenset[str]:
    return frozenset(t.name for t in tools or () if t.custom)


def arguments(text: str) -> str:
    """A custom call's input as the arguments JSON every dialect's history carries."""
    return json.dumps({"input": text}, ensure_ascii=False)


def parse_block(text: str, names: frozenset[str]) -> tuple[str, str] | None:
    """The whole reply as one custom call (name, input), or None. A block that the generation
    ended inside (no closing line) still is the call: its input is what came."""
    if not names:
        return None
    s = text.lstrip()
    if not s.startswith(OPEN):
        return None
    end = s.find(OPEN_END, len(OPEN))
    if end < 0:
        return None
    name = s[len(OPEN):end]
    if name not in names:
        return None
    body = s[end + len(OPEN_END):]
    k = body.find(CLOSE)
    return name, body if k < 0 else body[:k]


# ----------------------------------------------------------------------------- grammars


def tool_lark(tool: Tool) -> str:
    """The tool's own grammar as a Lark grammar (llguidance's dialect)."""
    syntax, definition = tool.grammar or ("text", "")
    if syntax == "lark":
        return definition
    if syntax == "regex":
        return "start: INPUT\nINPUT: /" + definition.replace("/", "\\/") + "/\n"
    raise ValueError(f"unknown custom tool grammar syntax {syntax!r}")


def block_rules(tools: Sequence[Tool]) -> tuple[list[str], list[dict]]:
    """(Lark lines defining `custom` as any of the tools' blocks, the named sub-grammars). A tool
    with a grammar is a sub-grammar its block references; free text is a lazy run that ends
    at the first closing line (it cannot hold one)."""
    lines, subs, alts = [], [], []
    for i, t in enumerate(tools):
        head = json.dumps(OPEN + t.name + OPEN_END, ensure_ascii=False)
        alts.append(f"x{i}")
        if t.grammar is None:
            lines.append(f"x{i}: {head} free{i}")
            lines.append(f"free{i}[lazy]: /(?s:.*)/ {json.dumps(CLOSE)}")
            continue
        lines.append(f"x{i}: {head} @t{i} {json.dumps(CLOSE)}")
        subs.append({"name": f"t{i}", "lark_grammar": tool_lark(t)})
    lines.insert(0, "custom: " + " | ".join(alts))
    return lines, subs


def top_level(main_lark: str, subs: list[dict]) -> str:
    """llguidance's several-grammar form: the main grammar first, referencing the others."""
    return json.dumps({"grammars": [{"name": "main", "lark_grammar": main_lark}, *subs]}, ensure_ascii=False)


NOT_A_BLOCK = r"~/[ \t\r\n]*<custom_tool(?s:.*)/"  # free text may not open a block unconstrained


# ----------------------------------------------------------------------------- streaming


class CustomFront:
    """In front of a shape's stream parser: a reply that opens a custom block is that call,
    streamed as its input arrives (CallStart(custom=True), ArgsDelta with raw input text,
    CallEnd); any other reply goes to `inner` untouched. The opening is held back only while
    the reply could still be one."""

    def __init__(self, inner, names: frozenset[str], new_id: Callable[[], str], events):
        self.inner, self.names, self.new_id, self.ev = inner, names, new_id, events
        self.buf = ""
        self.state = "undecided"  # -> "inner" | "block" | "done"
        self.input = ""

    @property
    def calls_started(self) -> int:
        return 1 if self.state in ("block", "done") else self.inner.calls_started

    def push(self, text: str) -> list:
        if self.state == "inner":
            return self.inner.push(text)
        self.buf += text
        return self._step(final=False)

    def finish(self) -> list:
        if self.state == "inner":
            return self.inner.finish()
        return self._step(final=True)

    def _step(self, final: bool) -> list:
        if self.state == "undecided":
            s = self.buf.lstrip()
            rest = s[len(OPEN):] if s.startswith(OPEN) else None
            name = next((n for n in self.names if rest is not None and rest.startswith(n + OPEN_END)), None)
            if name is not None:
                self.state, self.buf = "block", rest[len(name) + len(OPEN_END):]
                out = [self.ev.CallStart(0, self.new_id(), name, custom=True)]
                return out + self._block(final)
            could = OPEN.startswith(s) if rest is None else any((n + OPEN_END).startswith(rest) for n in self.names)
            if could and not final:
                return []
            self.state = "inner"
            buf, self.buf = self.buf, ""
            return self.inner.push(buf) + (self.inner.finish() if final else [])
        if self.state == "block":
            return self._block(final)
        return []  # done: what follows a closed block is not part of the reply

    def _block(self, final: bool) -> list:
        k = self.buf.find(CLOSE)
        if k >= 0:
            out, self.buf = self.buf[:k], ""
            self.state = "done"
            return ([self.ev.ArgsDelta(0, out)] if out else []) + [self.ev.CallEnd(0)]
        hold = 0 if final else _partial(self.buf, CLOSE)
        out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        events = [self.ev.ArgsDelta(0, out)] if out else []
        if final:
            self.state = "done"
            events.append(self.ev.CallEnd(0))
        return events


def _partial(s: str, tag: str) -> int:
    """Length of the longest suffix of s that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0
