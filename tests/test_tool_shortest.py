"""imp.tools.shortest: the shortest input a custom tool's grammar allows, and the fewest tokens
that spell it (the estimate behind the 400 for a call that cannot fit the output limit)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import lark
import pytest

from imp.tools.shortest import _regex_shortest, fewest_tokens, shortest_input

APPLY_PATCH = json.loads((Path(__file__).parent / "data" / "codex_apply_patch_tool.json").read_text())["tool"]


@pytest.mark.parametrize("grammar, want", [
    ('start: "hello " NUM\nNUM: /[0-9]+/\n', "hello 0"),
    ('start: a\na: "x" a | "yz"\n', "yz"),  # recursion: the base case wins
    ('start: "a"+ "b"? ("cc" | "d")\n', "ad"),
    ('start: WORD ("," WORD)*\n%import common.WORD\n', "A"),  # any one letter would do
])
def test_shortest_of_lark_grammars_parses_under_lark_itself(grammar, want):
    got = shortest_input(grammar)
    assert len(got) == len(want)
    lark.Lark(grammar, parser="earley").parse(got)  # an independent parser accepts it


def test_codex_apply_patch_shortest_is_a_patch_lark_accepts():
    g = APPLY_PATCH["format"]["definition"]
    got = shortest_input(g)
    assert got.startswith("*** Begin Patch\n") and got.rstrip("\n").endswith("*** End Patch")
    lark.Lark(g, parser="earley").parse(got)


@pytest.mark.parametrize("pattern", [r"[0-9]{3}", r"(ab|c)+x?", r"[^\n]+\n", r"\d{2}-\w\s", r"(?:foo|ba)r*$"])
def test_shortest_of_regexes_is_a_shortest_match(pattern):
    got = _regex_shortest(pattern)
    assert re.fullmatch(pattern, got)
    assert all(not re.fullmatch(pattern, got[:k]) for k in range(len(got)))


def test_llguidance_extensions_get_no_estimate():
    assert shortest_input('start: %json {"type": "object"}\n') is None
    assert shortest_input("start: nothing_defined\n") is None


class _Vocab:  # the two calls fewest_tokens makes of an llguidance tokenizer
    def __init__(self, pieces):
        self.pieces = [p.encode() for p in pieces]
        self.vocab_size = len(pieces) + 1

    def is_special_token(self, i):
        return i == len(self.pieces)

    def decode_bytes(self, ids):
        return b"".join(self.pieces[i] for i in ids) if ids[0] < len(self.pieces) else b"<eos>"


def test_fewest_tokens_is_the_shortest_spelling():
    v = _Vocab(["a", "b", "c", "ab", "bc", "abc", "***", " "])
    assert fewest_tokens(v, "abc") == 1
    assert fewest_tokens(v, "abca") == 2
    assert fewest_tokens(v, "ababc") == 2  # ab + abc
    assert fewest_tokens(v, "*** a") == 3
    assert fewest_tokens(v, "z") is None  # no piece spells it
