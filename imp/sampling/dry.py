"""DRY ("don't repeat yourself", p-e-w's sampler, as llama.cpp and KoboldCpp run it).

A token that would extend a sequence already seen in the context gets its logit lowered by
multiplier * base ^ (length - allowed_length), length being how many tokens before it repeat an
earlier run that this token followed. The context is the sequence's last `last_n` tokens, prompt
and output (llama-server feeds the prompt to its sampler chain too). Sequence breakers (strings;
default newline, colon, double quote, asterisk) cut the match: no repeat reaches back across the
latest one, and a token that is a whole breaker by itself is never penalized.

This is llama.cpp's `llama_sampler_dry_apply` step for step (its Z-algorithm over the reversed
window, the repeat lengths clipped by the breaker limit inside the Z-box as there, the exponent
clamp, float32 logits), so the same context and logits give the same penalized logits
(tests/test_dry.py holds it to llama.cpp's own output). Which tokens start a breaker, and with
which tails, is the vocabulary's fact: imp.text.dry_breakers.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

_FLOAT_MAX_LOG = 88.7228391


def penalties(ctx: Sequence[int], multiplier: float, base: float, allowed: int,
              breakers: dict[int, list[tuple[int, ...]]]) -> dict[int, float]:
    """token -> the amount its logit is lowered by, for the context window ctx (oldest first)."""
    n = len(ctx)
    if multiplier == 0.0 or base < 1.0 or n <= allowed:
        return {}

    def rat(i: int) -> int:  # the i-th token from the end
        return ctx[n - 1 - i]

    # the latest breaker limits how far back a repeat may reach
    rep_limit = n
    for i in range(n):
        tails = breakers.get(rat(i))
        if tails is None:
            continue
        longest = -1
        for tail in tails:
            L = len(tail)
            if longest < L <= i and all(tail[o] == rat(i - o - 1) for o in range(L)):
                longest = L
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return {}
    # repeat[j]: how many tokens ending at window position j equal the window's last ones (Z-algorithm
    # on the reversed window, clipped at rep_limit, the clipped values reused inside the Z-box)
    repeat = [0] * n
    last, lt, rt = n - 1, 0, 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            repeat[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            p = k - lt
            if repeat[last - p] < rt - k + 1:
                repeat[last - k] = min(repeat[last - p], rep_limit)
            else:
                i = rt + 1
                while i < n and rat(i) == rat(i - k):
                    i += 1
                repeat[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    longest_after: dict[int, int] = {}  # the token that followed a repeat -> the longest such repeat
    for i in range(n - 1):
        r = repeat[i]
        if r >= allowed:
            t = rat(n - 2 - i)
            if longest_after.get(t, -1) < r:
                longest_after[t] = r
    # int(88.7228391f / std::log(float)): float32 arithmetic, truncated
    max_exp = int(np.float32(_FLOAT_MAX_LOG) / np.log(np.float32(base))) if np.float32(base) > np.float32(1.000001) else 0
    out = {}
    for t, r in longest_after.items():
        if () in breakers.get(t, ()):  # a whole breaker by itself: never penalized
            continue
        e = r - allowed
        if max_exp > 0 and e > max_exp:
            e = max_exp
        # float * std::pow(float, int) in C++: the power and product in double, stored as a float
        out[t] = float(np.float32(float(np.float32(multiplier)) * float(np.float32(base)) ** e))
    return out


def apply(row: np.ndarray, dry, history: Sequence[int], own: bool = False) -> np.ndarray:
    """The row (float32 logits [V]) with DRY's penalties for the sequence's context: dry.prefix (the prompt's
    last tokens) + history (the generated ones), its last dry.last_n (all when last_n < 0)."""
    ctx = tuple(dry.prefix) + tuple(history)
    if dry.last_n >= 0:
        ctx = ctx[len(ctx) - dry.last_n:] if len(ctx) > dry.last_n else ctx
    table: dict[int, list[tuple[int, ...]]] = {}
    for head, tail in dry.breakers:
        table.setdefault(head, []).append(tuple(tail))
    pen = penalties(ctx, dry.multiplier, dry.base, dry.allowed_length, table)
    if not pen:
        return row
    ids = np.fromiter(pen, np.int64, len(pen))
    keep = ids < row.shape[-1]
    out = row if own else row.copy()
    out[ids[keep]] -= np.fromiter(pen.values(), np.float32, len(pen))[keep]
    return out
