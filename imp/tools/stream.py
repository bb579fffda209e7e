"""Streaming tool-call parsing: text chunks in, content and call events out.

`ToolStreamParser(fmt, tools).push(chunk) -> [Event]`, then `finish() -> [Event]`. Events:

- `Text(text)`: content, safe to show: it can no longer be part of a call.
- `CallStart(index, id, name)`: call `index` (0, 1, ... in output order) exists.
- `ArgsDelta(index, text)`: a fragment of its arguments; their concatenation is the call's
  compact arguments JSON (today one fragment: see below).
- `CallEnd(index)`.

Guarantees (what OpenAI SDK and Claude Code clients rely on):
- For any chunking of the same text, the events spell exactly `parse(text, fmt, tools)`:
  joined Text == content, the calls in order with the same names and arguments, ids drawn
  from `new_id` in the same order.
- Nothing that may still become a call is released as text: a suffix that may start
  `<tool_call>`, a JSON object that may be a call, the whitespace before a possible call.
  Held text is released the moment it cannot be a call (the incremental JSON scanner refuses
  a broken object at its first bad character, not at the end of the generation).
- A call is announced only once it is certain: its JSON is complete and valid and (hermes)
  its closing tag is there or the output ended. So CallStart, its ArgsDelta and CallEnd come
  together, and a call never has to be taken back. Arguments streamed before the call is
  complete could turn out invalid (the model may break the JSON, or max_tokens may cut it)
  and would break the equality with the non-streamed result.

Each format is a small state machine over a buffer holding the undecided text; see parse.py
for the formats themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

from imp.tools.jsontext import BAD, DONE, WS, JsonScanner, decode_string_body, skip_ws
from imp.tools.parse import (FORMATS, HERMES_CLOSE, HERMES_OPEN, array_calls, Format, Parsed, ToolCall,
                             call_in_object, calls_in_envelope, new_call_id, response_head,
                             tool_names)
from imp.tools.custom import CustomFront, custom_names
from imp.tools.custom import arguments as custom_arguments
from imp.tools.spec import Tool


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    index: int
    id: str
    name: str
    custom: bool = False  # a custom tool's call: its ArgsDelta texts are the raw input (imp.tools.custom)


@dataclass(frozen=True, slots=True)
class ArgsDelta:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class CallEnd:
    index: int


Event = Union[Text, CallStart, ArgsDelta, CallEnd]


def collect(events: Sequence[Event]) -> Parsed:
    """The Parsed that a sequence of events spells (what a client reassembles)."""
    text: list[str] = []
    calls: dict[int, list] = {}
    custom: set[int] = set()
    for ev in events:
        if isinstance(ev, Text):
            text.append(ev.text)
        elif isinstance(ev, CallStart):
            calls[ev.index] = [ev.id, ev.name, ""]
            if ev.custom:
                custom.add(ev.index)
        elif isinstance(ev, ArgsDelta):
            calls[ev.index][2] += ev.text
    for k in custom:
        calls[k][2] = custom_arguments(calls[k][2])
    return Parsed("".join(text), tuple(ToolCall(*calls[k]) for k in sorted(calls)))


def _partial_suffix(s: str, tag: str) -> int:
    """Length of the longest suffix of s that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(s)), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


# machine states
_TEXT, _CALL, _START, _CAND, _AFTER, _ARRAY, _ALL, _HEAD, _RESP, _TAIL, _OBJ = range(11)


class ToolStreamParser:
    def __init__(self, fmt: Format, tools: Sequence[Tool] | None = None,
                 new_id: Callable[[], str] = new_call_id):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}; known: {FORMATS}")
        self._fmt = fmt
        self._names = tool_names(tools)
        self._new_id = new_id
        self._buf = ""  # the undecided text
        self._events: list[Event] = []
        self._index = 0  # the next call's index
        self._after_call = False  # drop the leading whitespace of the next text
        self._finished = False
        # per-state data
        self._state = _TEXT if fmt == "hermes" else _START
        self._scan: JsonScanner | None = None
        self._scanned = 0  # chars of _buf fed to _scan
        self._jstart = 0  # where in _buf the scanned JSON begins
        self._pending_ws = ""  # hermes: whitespace before a tag that may start a call
        self._found: tuple[str, str] | None = None  # hermes: a call whose JSON is complete
        self._step = {"hermes": self._hermes, "json": self._bare, "generic": self._generic}[fmt]

    @property
    def calls_started(self) -> int:
        """How many calls have been announced (CallStart) so far."""
        return self._index

    def push(self, text: str) -> list[Event]:
        if self._finished:
            raise ValueError("ToolStreamParser: push after finish")
        self._buf += text
        self._step(final=False)
        return self._take()

    def finish(self) -> list[Event]:
        """The generation ended: decide everything still held."""
        if not self._finished:
            self._finished = True
            self._step(final=True)
        return self._take()

    # ---------------------------------------------------------------- emitting

    def _take(self) -> list[Event]:
        out, self._events = self._events, []
        return out

    def _text(self, s: str) -> None:
        if self._after_call:
            s = s.lstrip(WS)
            if not s:
                return
            self._after_call = False
        if not s:
            return
        if self._events and isinstance(self._events[-1], Text):
            self._events[-1] = Text(self._events[-1].text + s)
        else:
            self._events.append(Text(s))

    def _call(self, name: str, args: str) -> None:
        k = self._index
        self._index += 1
        self._events += [CallStart(k, self._new_id(), name), ArgsDelta(k, args), CallEnd(k)]
        self._after_call = True

    def _feed_scan(self) -> int:
        """Feed the scanner what it has not seen: DONE (value ends at self._scanned), BAD, or
        OPEN (-1)."""
        status, used = self._scan.feed(self._buf[self._scanned:])
        self._scanned += used
        return status if status in (DONE, BAD) else -1

    def _start_scan(self, at: int) -> None:
        self._scan, self._jstart, self._scanned = JsonScanner(), at, at

    # ---------------------------------------------------------------- hermes

    def _hermes(self, final: bool) -> None:
        while True:
            if self._state == _TEXT:
                i = self._buf.find(HERMES_OPEN)
                if i < 0:
                    hold = 0 if final else _partial_suffix(self._buf, HERMES_OPEN)
                    head = self._buf[: len(self._buf) - hold]
                    # trailing whitespace may touch a call that follows: hold it too
                    body = head if final else head.rstrip(WS)
                    self._text(body)
                    self._buf = self._buf[len(body):]
                    return
                pre = self._buf[:i]
                body = pre.rstrip(WS)
                self._text(body)
                self._pending_ws = pre[len(body):]
                self._buf = self._buf[i:]
                self._state, self._scan, self._found = _CALL, None, None
                continue
            outcome = self._hermes_call(final)
            if outcome is None:
                return  # wait for more text
            if outcome is False:  # not a call: the tag is text, look again after it
                self._text(self._pending_ws + HERMES_OPEN)
                self._buf = self._buf[len(HERMES_OPEN):]
            else:
                name, args, end = outcome
                self._call(name, args)
                self._buf = self._buf[end:]
            self._pending_ws = ""
            self._state = _TEXT

    def _hermes_call(self, final: bool):
        """_buf starts with the open tag: (name, args, end), False (not a call) or None (wait)."""
        buf = self._buf
        if self._scan is None:
            j = skip_ws(buf, len(HERMES_OPEN))
            if j == len(buf):
                return False if final else None
            if buf[j] != "{":
                return False
            self._start_scan(j)
        if self._found is None:
            status = self._feed_scan()
            if status == BAD:
                return False
            if status != DONE:
                return False if final else None
            self._found = call_in_object(buf, self._jstart, self._scanned)
            if self._found is None:
                return False
        k = skip_ws(buf, self._scanned)
        rest = buf[k:]
        if rest.startswith(HERMES_CLOSE):
            return (*self._found, k + len(HERMES_CLOSE))
        if not rest:
            return (*self._found, k) if final else None
        if HERMES_CLOSE.startswith(rest) and not final:
            return None
        return False

    # ---------------------------------------------------------------- bare JSON

    def _bare(self, final: bool) -> None:
        while True:
            buf = self._buf
            if self._state == _ALL:
                self._text(buf)
                self._buf = ""
                return
            if self._state in (_START, _AFTER):
                j = skip_ws(buf, 0)
                k = j
                if self._state == _AFTER and j < len(buf) and buf[j] == ";":
                    k = skip_ws(buf, j + 1)  # a separator belongs to the call after it, if any
                if k == len(buf):
                    if final:
                        self._text(buf)  # all whitespace (dropped after a call) or a lone ";"
                        self._buf = ""
                    return
                if buf[k] == "{":
                    self._state = _CAND
                    self._start_scan(k)
                elif buf[k] == "[" and self._state == _START:
                    self._state = _ARRAY
                    self._start_scan(k)
                else:
                    self._state = _ALL
                continue
            status = self._feed_scan()
            if status == -1 and not final:
                return
            calls = None
            if status == DONE:
                if self._state == _CAND:
                    call = call_in_object(buf, self._jstart, self._scanned, bare=True, names=self._names)
                    calls = None if call is None else [call]
                else:
                    calls = self._array_calls(buf, self._jstart, self._scanned)
            if calls is None:  # not calls: this object and all after it is text
                self._state = _ALL
                continue
            for c in calls:
                self._call(*c)
            self._buf = buf[self._scanned:]
            self._state = _AFTER if self._state == _CAND else _ALL

    def _array_calls(self, buf: str, start: int, end: int) -> list[tuple[str, str]] | None:
        got = array_calls(buf, start, self._names)
        return None if got is None else got[0]

    # ---------------------------------------------------------------- generic

    def _generic(self, final: bool) -> None:
        while True:
            buf = self._buf
            st = self._state
            if st == _ALL:
                self._text(buf)
                self._buf = ""
                return
            if st == _START:
                j = skip_ws(buf, 0)
                if j == len(buf):
                    if final:
                        self._state = _ALL
                        continue
                    return
                self._jstart = j
                self._state = _HEAD if buf[j] == "{" else _ALL
                continue
            if st == _HEAD:
                head = response_head(buf, self._jstart)
                if isinstance(head, int):
                    self._buf = buf[head:]
                    self._state = _RESP
                elif head == "no" or final:
                    self._state = _OBJ
                    self._start_scan(self._jstart)
                else:
                    return
                continue
            if st == _RESP:
                text, used, closed = decode_string_body(buf, final)
                self._text(text)
                self._buf = buf[used:]
                if not closed:
                    return
                self._state = _TAIL
                continue
            if st == _TAIL:
                if final:
                    if buf.strip(WS) != "}":
                        self._text(buf)
                    self._buf = ""
                return
            # _OBJ: a JSON object that may be a call envelope
            status = self._feed_scan()
            if status == -1 and not final:
                return
            calls = calls_in_envelope(buf, self._jstart, self._scanned) if status == DONE else None
            if calls is None:
                self._state = _ALL
                continue
            for c in calls:
                self._call(*c)
            self._buf = buf[self._scanned:]
            self._state = _ALL


def stream_parser(fmt: Format, tools: Sequence[Tool] | None = None, new_id: Callable[[], str] = new_call_id):
    """The stream parser for a request's tools: the shape's own, behind a CustomFront when
    some of the tools are custom (their calls are raw blocks, imp.tools.custom)."""
    inner = ToolStreamParser(fmt, [t for t in tools or () if not t.custom] or None if tools else None, new_id)
    names = custom_names(tools)
    return CustomFront(inner, names, new_id, _EVENTS) if names else inner


class _Events:
    CallStart, ArgsDelta, CallEnd = CallStart, ArgsDelta, CallEnd


_EVENTS = _Events
