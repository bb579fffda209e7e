"""DRY (imp.sampling.dry) against llama.cpp's own sampler: tests/data/dry_reference.json holds llama.cpp's
penalized logits (tests/tools/dry_ref.cpp, linked against a llama.cpp build, on SmolLM2's vocabulary) for
fixed contexts, parameters, sequence breakers (single- and multi-token) and seeded random logits; ours must
give the same float32 logits, every one of them."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np

from imp.messages.params import Dry
from imp.sampling import dry
from imp.text import dry_breakers

REF = json.loads((Path(__file__).parent / "data" / "dry_reference.json").read_text())


def _table(tok, breakers):
    pieces = [tok.piece_bytes(i) for i in range(tok.vocab_size)]
    return dry_breakers.breaker_table(pieces, breakers, lambda b: tok.encode(b.decode("utf-8", "replace")))


def test_penalized_logits_equal_llama_cpp_s(smollm2_path):
    from imp.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_path)
    assert tok.encode(REF["text"])[:len(REF["cases"][0]["context"])] == REF["cases"][0]["context"]
    tables = {}
    for c in REF["cases"]:
        key = tuple(c["breakers"])
        if key not in tables:
            tables[key] = _table(tok, key)
        p = Dry(multiplier=c["mult"], base=c["base"], allowed_length=c["allowed"], last_n=c["last_n"],
                breakers=tables[key], prefix=tuple(c["context"]))
        logits = np.random.default_rng(c["seed"]).standard_normal(tok.vocab_size).astype(np.float32)
        got = dry.apply(logits, p, ())
        want = logits.copy()
        for i, v in c["penalized"].items():
            want[int(i)] = np.float32(v)
        changed = np.nonzero(got != logits)[0].tolist()
        assert changed == sorted(int(i) for i in c["penalized"]), c
        assert np.array_equal(got, want), c


def test_breakers_context_window_and_off_values():
    # tokens 1..9 as letters; breaker "x" is token 9 alone, "ab" is token 1 then 2
    pieces = [b"", b"a", b"b", b"c", b"d", b"e", b"f", b"g", b"h", b"x"]
    enc = {b"b": [2], b"": []}
    table = dry_breakers.breaker_table(pieces, ["x", "ab"], lambda b: enc[b])
    assert table == ((1, (2,)), (9, ()))
    p = Dry(multiplier=1.0, base=2.0, allowed_length=2, last_n=-1, breakers=())
    row = np.zeros(10, np.float32)
    # c d e f ... c d e: "c d e" repeats; the token after it (f) extends it: 1 * 2^(3-2)
    out = dry.apply(row, msgspec.structs.replace(p, prefix=(3, 4, 5, 6, 7)), (3, 4, 5))
    assert out[6] == -2.0 and np.count_nonzero(out) == 1 and row[6] == 0.0  # a copy: the row is not touched
    # a breaker inside the repeat cuts it to what follows the breaker: "9 5" repeats only (length 1 < 2)
    assert not np.any(dry.apply(row, msgspec.structs.replace(p, prefix=(3, 9, 5, 6), breakers=table), (3, 9, 5)))
    # the window: the first occurrence outside the last 4 tokens is not seen
    assert not np.any(dry.apply(row, msgspec.structs.replace(p, prefix=(3, 4, 5, 6, 7), last_n=4), (3, 4, 5)))
    # a token that is a whole breaker is never penalized: "c d" then x, later "c d" again
    out = dry.apply(row, msgspec.structs.replace(p, prefix=(3, 4, 9, 1), breakers=((9, ()),)), (3, 4))
    assert out[9] == 0.0
    assert not dry.penalties([3, 4, 3, 4], 0.0, 2.0, 1, {})  # multiplier 0: off
