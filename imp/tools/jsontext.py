"""JSON as text: the small pieces the tool-call parsers share.

- `JsonScanner`: an incremental syntax check of one JSON object or array, fed chunk by chunk,
  that says as early as possible whether the value is complete, still open, or can no longer
  become valid JSON (so a streaming parser can release held-back text at the first bad char
  instead of at the end of the generation).
- `loads` / `DECODER`: Python's json, made strict (no NaN / Infinity, deep nesting is an error,
  not a crash).
- `members` / `elements`: where each member / element of a valid object / array lies in the
  text, so a call's arguments can be returned in the model's own spelling.
- `compact`: drop insignificant whitespace (arguments are returned as compact JSON text; the
  model's escapes and number spellings are kept, so nothing is re-encoded: `1e999` stays valid
  JSON text, an escaped lone surrogate stays an escape).
- `decode_string_body`: decode a JSON string's body as far as it is decided (the generic form's
  `{"response": "..."}` streams its text this way).

JSON whitespace is exactly the four characters of RFC 8259 (`WS`), never Python's str.isspace.
"""

from __future__ import annotations

import json
import re
from typing import Any

WS = " \t\n\r"

OPEN, DONE, BAD = 0, 1, 2  # JsonScanner.feed statuses


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def loads(text: str) -> Any:
    """Strict json.loads: ValueError for anything that is not one JSON value (NaN, Infinity,
    trailing text, nesting deeper than the interpreter's recursion limit)."""
    try:
        return DECODER.decode(text)
    except RecursionError as e:
        raise ValueError("JSON nested too deeply") from e


def raw_decode(text: str, start: int) -> tuple[Any, int]:
    """(value, end) of the JSON value at text[start] (no leading whitespace skipped)."""
    try:
        return DECODER.raw_decode(text, start)
    except RecursionError as e:
        raise ValueError("JSON nested too deeply") from e


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in WS:
        i += 1
    return i


_COMPACT_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[ \t\n\r]+|[^" \t\n\r]+', re.S)


def compact(text: str) -> str:
    """Valid JSON text without its insignificant whitespace."""
    return "".join(t for t in _COMPACT_TOKEN.findall(text) if t[0] not in WS)


def members(text: str, start: int) -> dict[str, tuple[int, int]]:
    """Spans (start, end) of the member values of the valid JSON object at text[start];
    a repeated key keeps its last value, as json.loads does."""
    out: dict[str, tuple[int, int]] = {}
    i = skip_ws(text, start + 1)
    if text[i] == "}":
        return out
    while True:
        key, i = raw_decode(text, i)
        i = skip_ws(text, skip_ws(text, i) + 1)  # past ':'
        _, j = raw_decode(text, i)
        out[key] = (i, j)
        i = skip_ws(text, j)
        if text[i] == "}":
            return out
        i = skip_ws(text, i + 1)  # past ','


def elements(text: str, start: int) -> list[tuple[int, int]]:
    """Spans of the elements of the valid JSON array at text[start]."""
    out: list[tuple[int, int]] = []
    i = skip_ws(text, start + 1)
    if text[i] == "]":
        return out
    while True:
        _, j = raw_decode(text, i)
        out.append((i, j))
        i = skip_ws(text, j)
        if text[i] == "]":
            return out
        i = skip_ws(text, i + 1)


# ----------------------------------------------------------------- incremental syntax check

# states of JsonScanner
_VALUE, _OBJ_FIRST, _OBJ_KEY, _COLON, _AFTER, _STR, _ESC, _HEX, _NUM, _LIT, _ARR_FIRST = range(11)
# number sub-states: which part of -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? we are in
_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_N_COMPLETE = frozenset((_N_ZERO, _N_INT, _N_FRAC, _N_EXP))
_DIGITS = "0123456789"
_HEXDIGITS = "0123456789abcdefABCDEF"
_PLAIN = re.compile(r'[^"\\\x00-\x1f]*')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}


class JsonScanner:
    """Checks one JSON object or array as it arrives, without building it.

    `feed(chunk)` returns (status, used): OPEN (all of chunk used, value not finished), DONE
    (the value ended; `used` chars of chunk belong to it, the rest is after it) or BAD (the text
    can no longer be a JSON value; `used` is the offending char's index). It accepts exactly
    what `loads` accepts for a container (strict strings: no raw control characters; no NaN),
    except for limits of Python's own decoder (nesting depth, huge integers), which the caller
    meets by decoding the finished text with `loads`.
    """

    __slots__ = ("_stack", "_state", "_key", "_hex", "_num", "_lit", "_status")

    def __init__(self) -> None:
        self._stack: list[str] = []  # "}" or "]": the closer each open container expects
        self._state = _VALUE
        self._key = False  # the string being read is an object key
        self._hex = 0  # \u digits still to read
        self._num = _N_MINUS
        self._lit = ""  # the rest of true / false / null still to read
        self._status = OPEN

    def feed(self, s: str) -> tuple[int, int]:
        if self._status != OPEN:
            raise ValueError("JsonScanner: fed after the value ended")
        i, n = 0, len(s)
        stack = self._stack
        while i < n:
            st = self._state
            if st == _STR:
                i = _PLAIN.match(s, i).end()
                if i >= n:
                    break
                c = s[i]
                if c == '"':
                    self._state = _COLON if self._key else _AFTER
                elif c == "\\":
                    self._state = _ESC
                else:
                    return self._bad(i)  # a raw control character
                i += 1
                continue
            c = s[i]
            if st == _ESC:
                if c == "u":
                    self._state, self._hex = _HEX, 4
                elif c in '"\\/bfnrt':
                    self._state = _STR
                else:
                    return self._bad(i)
                i += 1
            elif st == _HEX:
                if c not in _HEXDIGITS:
                    return self._bad(i)
                self._hex -= 1
                if not self._hex:
                    self._state = _STR
                i += 1
            elif st == _NUM:
                if self._number(c):
                    i += 1
                elif self._num in _N_COMPLETE:
                    self._state = _AFTER  # the char ends the number: read it again as AFTER
                else:
                    return self._bad(i)
            elif st == _LIT:
                if c != self._lit[0]:
                    return self._bad(i)
                self._lit = self._lit[1:]
                if not self._lit:
                    self._state = _AFTER
                i += 1
            elif c in WS:
                i += 1
            elif st == _VALUE:
                if c == "{":
                    stack.append("}")
                    self._state = _OBJ_FIRST
                elif c == "[":
                    stack.append("]")
                    self._state = _ARR_FIRST
                elif not stack:
                    return self._bad(i)  # only containers at the top level
                elif c == '"':
                    self._state, self._key = _STR, False
                elif c == "-" or c in _DIGITS:
                    self._state = _NUM
                    self._num = _N_MINUS if c == "-" else (_N_ZERO if c == "0" else _N_INT)
                elif c in _LITERALS:
                    self._state, self._lit = _LIT, _LITERALS[c]
                else:
                    return self._bad(i)
                i += 1
            elif st == _ARR_FIRST:  # just after "[": a value or the end of an empty array
                if c == "]":
                    stack.pop()
                    self._state = _AFTER
                    if not stack:
                        return self._done(i + 1)
                    i += 1
                else:
                    self._state = _VALUE  # read c again as a value
            elif st == _OBJ_FIRST or st == _OBJ_KEY:
                if c == '"':
                    self._state, self._key = _STR, True
                elif c == "}" and st == _OBJ_FIRST:
                    stack.pop()
                    self._state = _AFTER
                    if not stack:
                        return self._done(i + 1)
                else:
                    return self._bad(i)
                i += 1
            elif st == _COLON:
                if c != ":":
                    return self._bad(i)
                self._state = _VALUE
                i += 1
            else:  # _AFTER a value inside a container
                if c == ",":
                    self._state = _OBJ_KEY if stack[-1] == "}" else _VALUE
                elif c == stack[-1]:
                    stack.pop()
                    if not stack:
                        return self._done(i + 1)
                else:
                    return self._bad(i)
                i += 1
        return OPEN, n

    def _number(self, c: str) -> bool:
        """Advance the number by c if c continues it."""
        k = self._num
        if c in _DIGITS:
            if k == _N_ZERO:
                return False  # no leading zeros
            self._num = {_N_MINUS: _N_ZERO if c == "0" else _N_INT, _N_INT: _N_INT, _N_DOT: _N_FRAC,
                         _N_FRAC: _N_FRAC, _N_E: _N_EXP, _N_ESIGN: _N_EXP, _N_EXP: _N_EXP}[k]
            return True
        if c == "." and k in (_N_ZERO, _N_INT):
            self._num = _N_DOT
            return True
        if c in "eE" and k in (_N_ZERO, _N_INT, _N_FRAC):
            self._num = _N_E
            return True
        if c in "+-" and k == _N_E:
            self._num = _N_ESIGN
            return True
        return False

    def _bad(self, i: int) -> tuple[int, int]:
        self._status = BAD
        return BAD, i

    def _done(self, used: int) -> tuple[int, int]:
        self._status = DONE
        return DONE, used


# ------------------------------------------------------------------ string body decoding

_SIMPLE_ESC = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_UESC = re.compile(r"\\u([0-9a-fA-F]{4})")
_STR_PLAIN = re.compile(r'[^"\\]+')


def decode_string_body(s: str, final: bool) -> tuple[str, int, bool]:
    """Decode the body of a JSON string (the text after its opening quote) as far as it is
    decided: (text, used, closed). `closed` means the closing quote was reached (`used`
    includes it). Lenient where a model may be sloppy, and deterministic so that any split of
    the input decodes to the same text: raw control characters are kept; an unknown escape
    `\\x` keeps its backslash; an unpaired surrogate escape becomes U+FFFD. Without `final` an
    escape that the text so far does not decide (`\\`, `\\u12`, a high surrogate whose pair
    may follow) is left unused; with `final` (the generation ended) it is dropped or, for a
    lone high surrogate, U+FFFD.
    """
    out: list[str] = []
    i, n = 0, len(s)
    while i < n:
        m = _STR_PLAIN.match(s, i)
        if m:
            out.append(m.group())
            i = m.end()
            continue
        c = s[i]
        if c == '"':
            return "".join(out), i + 1, True
        # a backslash
        if i + 1 >= n:
            return "".join(out), (n if final else i), False
        e = s[i + 1]
        if e in _SIMPLE_ESC:
            out.append(_SIMPLE_ESC[e])
            i += 2
            continue
        if e != "u":
            out.append("\\")  # unknown escape: keep the backslash, read e as text
            i += 1
            continue
        m = _UESC.match(s, i)
        if not m:
            if _could_be_uesc(s[i : i + 6]):  # the text ends inside this escape
                return "".join(out), (n if final else i), False
            out.append("\\")  # a broken \u escape: keep the backslash, read "u..." as text
            i += 1
            continue
        cp = int(m.group(1), 16)
        if 0xD800 <= cp < 0xDC00:  # a high surrogate: only a low one may follow
            m2 = _UESC.match(s, i + 6)
            if m2 and 0xDC00 <= int(m2.group(1), 16) < 0xE000:
                low = int(m2.group(1), 16)
                out.append(chr(0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)))
                i += 12
                continue
            if not final and _could_be_uesc(s[i + 6 : i + 12]):
                return "".join(out), i, False  # its low half may still come
            out.append("\ufffd")
            i += 6
            continue
        out.append("\ufffd" if 0xDC00 <= cp < 0xE000 else chr(cp))
        i += 6
    return "".join(out), n, False


def _could_be_uesc(s: str) -> bool:
    """s is a proper prefix of some \\uXXXX escape (the empty string is)."""
    return (len(s) < 6 and s[:1] in ("", "\\") and s[1:2] in ("", "u")
            and all(ch in _HEXDIGITS for ch in s[2:]))
