"""The shortest input a custom tool's grammar allows, and the fewest tokens that spell it.

Why: a custom tool call whose grammar cannot be finished inside the request's output limit is
cut mid-input, and the client gets an `incomplete` call it cannot parse (Codex's apply_patch
needs "*** Begin Patch" ... "*** End Patch" around any hunk). Such a request is refused up
front, naming the tool (issue 31), rather than run into a certain failure.

How: the grammar (Lark, or a regex wrapped as one: imp.tools.custom.tool_lark) is read with the
`lark` package's own grammar loader; every terminal gets its shortest string (a literal, or the
shortest match of its regex, built from Python's regex parse tree); every rule the shortest
concatenation over its alternatives (a fixpoint, so recursion is fine). Grammars in
llguidance's extensions that `lark` cannot read (%json, token ranges, lazy) get no estimate
and are never refused for length. The tokens: the fewest vocabulary pieces that spell the
whole call block, by dynamic programming over the block's bytes (the model could not spell
that string in fewer). A longer input that tokenizes shorter is possible in principle; the
estimate is of the shortest input, which for literal-framed grammars like apply_patch's is the
one that counts.
"""

from __future__ import annotations

import re._parser as sre  # Python's own regex parser (3.11+: re._parser)
import threading
from functools import lru_cache

_MAX_REPEAT_BUILD = 4096  # a regex asking for more than this many repeats gets no estimate


class _NoEstimate(Exception):
    pass


def _regex_shortest(pattern: str, flags: str = "") -> str:
    """The shortest string the regex matches (a representative one)."""
    try:
        tree = sre.parse(f"(?{flags}){pattern}" if flags else pattern)
    except Exception as exc:  # noqa: BLE001 - any parse error: no estimate
        raise _NoEstimate(str(exc)) from None
    return _walk(tree)


def _walk(items) -> str:
    out = []
    for op, av in items:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(av))
        elif name == "NOT_LITERAL":
            out.append("a" if av != ord("a") else "b")
        elif name == "ANY":
            out.append("a")
        elif name == "IN":
            out.append(_class_member(av))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            lo, _hi, sub = av
            if lo > _MAX_REPEAT_BUILD:
                raise _NoEstimate("repeat too large")
            out.append(_walk(sub) * lo)
        elif name == "SUBPATTERN":
            out.append(_walk(av[-1]))
        elif name == "BRANCH":
            out.append(min((_walk(b) for b in av[1]), key=len))
        elif name in ("AT", "ASSERT", "ASSERT_NOT"):
            continue  # anchors and look-arounds take no characters
        elif name == "ATOMIC_GROUP":
            out.append(_walk(av))
        else:  # GROUPREF, CATEGORY alone, ...: rare in tool grammars
            raise _NoEstimate(f"regex element {name}")
    return "".join(out)


def _class_member(av) -> str:
    negate = False
    for op, v in av:
        name = str(op)
        if name == "NEGATE":
            negate = True
        elif negate:
            continue
        elif name == "LITERAL":
            return chr(v)
        elif name == "RANGE":
            return chr(v[0])
        elif name == "CATEGORY":
            return {"CATEGORY_DIGIT": "0", "CATEGORY_SPACE": " ", "CATEGORY_WORD": "a"}.get(str(v), "a")
    if negate:  # [^...]: a letter the class does not exclude (good enough for an estimate)
        banned = {chr(v) for op, v in av if str(op) == "LITERAL"}
        return next(c for c in "aZ0 _" if c not in banned)
    raise _NoEstimate("empty class")


def shortest_input(lark_text: str) -> str | None:
    """The shortest string the Lark grammar's `start` accepts, or None when it cannot be read
    here (llguidance's own extensions) or has none."""
    try:
        return _shortest(lark_text)
    except _NoEstimate:
        return None


@lru_cache(maxsize=64)
def _shortest(lark_text: str) -> str | None:
    try:
        from lark.load_grammar import load_grammar
        from lark.lexer import PatternStr

        grammar, _ = load_grammar(lark_text, "<tool>", None, False)
        terminals, rules, _ignore = grammar.compile(["start"], "*")
    except Exception as exc:  # noqa: BLE001 - lark could not read it: no estimate
        raise _NoEstimate(str(exc)) from None
    term = {}
    for t in terminals:
        p = t.pattern
        term[t.name] = p.value if isinstance(p, PatternStr) else _regex_shortest(p.value, "".join(p.flags))
    best: dict[str, str] = {}
    changed = True
    while changed:  # Bellman-Ford over rules: a rule's best only shrinks
        changed = False
        for r in rules:
            parts = []
            for sym in r.expansion:
                s = term.get(sym.name) if sym.is_term else best.get(sym.name)
                if s is None:
                    break
                parts.append(s)
            else:
                cand = "".join(parts)
                name = r.origin.name
                if name not in best or len(cand) < len(best[name]):
                    best[name] = cand
                    changed = True
    return best.get("start")


# ----------------------------------------------------------------------------- tokens

_pieces_lock = threading.Lock()
_pieces: dict[int, tuple[frozenset[bytes], int]] = {}


def _vocab(tokenizer) -> tuple[frozenset[bytes], int]:
    """Every non-special piece of the llguidance tokenizer's vocabulary (built once per
    tokenizer: ~0.1 s for 49k tokens)."""
    key = id(tokenizer)
    with _pieces_lock:
        if key not in _pieces:
            pieces = set()
            for i in range(tokenizer.vocab_size):
                if tokenizer.is_special_token(i):
                    continue
                b = tokenizer.decode_bytes([i])
                if b:
                    pieces.add(b)
            _pieces[key] = (frozenset(pieces), max(map(len, pieces), default=1))
        return _pieces[key]


def fewest_tokens(tokenizer, text: str) -> int | None:
    """The fewest vocabulary pieces whose bytes concatenate to text (None: it cannot be spelt)."""
    pieces, longest = _vocab(tokenizer)
    data = text.encode()
    n = len(data)
    inf = n + 1
    best = [0] + [inf] * n
    for i in range(n):
        if best[i] == inf:
            continue
        for j in range(i + 1, min(n, i + longest) + 1):
            if best[i] + 1 < best[j] and data[i:j] in pieces:
                best[j] = best[i] + 1
    return None if best[n] == inf else best[n]
