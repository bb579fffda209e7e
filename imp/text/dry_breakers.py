"""DRY's sequence breakers in a vocabulary: llama.cpp's `get_overlapping_token_sequences`.

A breaker is a string (llama.cpp's default: newline, colon, double quote, asterisk). The DRY sampler
(imp.sampling.dry) needs it as tokens: a token whose text holds the whole string breaks a repeat by
itself; a token whose text ends with the string's first bytes starts one, completed by the tokens of
the rest (its "tail"). Made once per breaker set in the API process, which holds the tokenizer.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

MAX_CHAR_LEN = 40  # a breaker string is cut to this many bytes (llama.cpp)
MAX_SEQ_LEN = 20  # a breaker's tail is cut to this many tokens (llama.cpp)
DEFAULT_BREAKERS = ("\n", ":", "\"", "*")


def breaker_table(token_bytes: Sequence[bytes], breakers: Iterable[str],
                  tokenize: Callable[[bytes], list[int]]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """(head token, tail tokens) pairs, sorted: a head whose bytes hold a whole breaker has the empty tail; one
    whose bytes end with the start of a breaker (its first k bytes, 0 < k < len) has the tokens of the
    breaker's rest as its tail. token_bytes: every token's text as bytes (specials as their text), a list or
    a PackedBytes (imp.formats.packed: searched as one blob, so Gemma's 262k tokens take milliseconds);
    tokenize(bytes): the tokenizer without specials (a tail's tokens, at most MAX_SEQ_LEN)."""
    blob = getattr(token_bytes, "blob", None)
    if blob is None:
        blob = b"".join(token_bytes)
        offsets = np.zeros(len(token_bytes) + 1, np.int64)
        np.cumsum([len(b) for b in token_bytes], out=offsets[1:])
    else:
        offsets = np.asarray(token_bytes.offsets, np.int64)
    arr = np.frombuffer(blob, np.uint8)
    starts, ends = offsets[:-1], offsets[1:]
    lens = ends - starts
    out: dict[int, list[tuple[int, ...]]] = {}
    for s in breakers:
        b = s.encode()[:MAX_CHAR_LEN]
        if not b:
            continue
        whole = set()
        pos = blob.find(b)
        while pos >= 0:  # every occurrence in the blob that lies inside one token
            t = int(np.searchsorted(ends, pos, side="right"))
            if pos + len(b) <= ends[t]:
                whole.add(t)
            pos = blob.find(b, pos + 1)
        for t in whole:
            tails = out.setdefault(t, [])
            if () not in tails:
                tails.append(())
        for k in range(len(b) - 1, 0, -1):  # tokens ending with b[:k] (the longest first, as llama.cpp walks)
            m = lens >= k
            idx = np.nonzero(m)[0]
            e = ends[idx]
            hit = np.ones(idx.size, bool)
            for j in range(k):
                hit &= arr[e - k + j] == b[j]
            heads = [int(t) for t in idx[hit] if int(t) not in whole]
            if not heads:
                continue
            tail = tuple(tokenize(b[k:]))[:MAX_SEQ_LEN]
            for t in heads:
                tails = out.setdefault(t, [])
                if tail not in tails:
                    tails.append(tail)
    return tuple((t, tail) for t in sorted(out) for tail in out[t])
