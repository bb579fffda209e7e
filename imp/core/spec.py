"""Draft-free speculation: a sequence's drafts from its own prompt + output, and how many to ask for.

Agents re-emit spans of their context (a file being edited, tool arguments quoting it, JSON
skeletons). When the last few tokens of a sequence occurred before in its prompt or output, the
tokens that followed them then are a guess at what follows now (prompt lookup / n-gram drafting,
as vLLM's ngram proposer and llama.cpp's ngram-simple). The scheduler feeds the guess after the
last token in one share; the executor samples every position as it would have one at a time and
keeps the draft up to its first disagreement (imp/sampling/verify.py), so the output is the
output without speculation, token for token, greedy or seeded.

`Drafter` is per sequence and pure (no clock, no randomness): the same tokens give the same
drafts, so a replayed log plans the same steps. It keeps two indexes of hashed n-grams (orders
LONG and SHORT) -> the latest position where one ended, over every token but the last; a draft
continues the latest earlier occurrence of the sequence's LONG-token suffix, else of its
SHORT-token one; where that continuation runs into the end of the tokens (the sequence loops), it is
repeated as the copy would go on. Hash collisions only make a bad draft: the verify step rejects it.

The draft length k adapts per sequence from what its verifies accepted (all of a draft: twice
as many next time, up to k_max; a miss at j: j + 1), and a sequence whose drafts keep missing
stops drafting for a while (twice as long each time it happens), so text with nothing to copy
pays for a few failed verifies and then nothing.

What a drafted row costs depends on the batch: at one stream a step reads every weight for one
row and a few more rows are nearly free; at 16 streams on a CPU the step is compute-bound and a
draft row costs about what a decode row does. `StepCost` fits step time = fixed + per_row x rows
from the executor times of the steps without prompt rows (on the log, so a replay decides the
same), and a draft is cut
where its next token's chance of being kept (the sequence's acceptance, `Drafter.alpha`) times
the time a token takes now no longer pays for one more row.
"""

from __future__ import annotations

import math

import numpy as np

LONG, SHORT = 6, 3  # n-gram orders looked up, longest first
K_START = 4  # a new sequence's first draft length
_M = 0x9E3779B97F4A7C15  # odd 64-bit multiplier of the polynomial hash
_MASK = (1 << 64) - 1
WINDOW = 8  # verifies judged together for the cool-down
LOW_ACCEPT = 0.25  # below this share of drafted tokens accepted over a window: stop drafting a while
COOL_FIRST, COOL_MAX = 16, 512  # decode steps without drafts, doubling while the misses go on
DECAY = 0.5  # of a sequence's acceptance counts, a verify: the last few verifies speak
COST_DECAY = 1 / 32  # of StepCost's moments, a step


class StepCost:
    """Step time ~ fixed + per_row x rows, fitted online from the executor's step times (decayed
    moments, a least-squares line); unknown until the steps' row counts vary. The scheduler feeds
    it the steps of decode and draft rows only: a prompt chunk's rows cost otherwise (a line
    through 512-row chunks says a one-row step is nearly free, which a decode step is not)."""

    __slots__ = ("n", "r", "t", "rr", "rt")

    def __init__(self):
        self.n = 0
        self.r = self.t = self.rr = self.rt = 0.0

    def observe(self, rows: int, elapsed_ns: int) -> None:
        if rows <= 0 or elapsed_ns <= 0:
            return
        w = 1.0 if self.n == 0 else COST_DECAY
        self.n += 1
        t = elapsed_ns / 1e6
        self.r += w * (rows - self.r)
        self.t += w * (t - self.t)
        self.rr += w * (rows * rows - self.rr)
        self.rt += w * (rows * t - self.rt)

    def per_row_ms(self) -> float | None:
        var = self.rr - self.r * self.r
        if self.n < 8 or var < 0.25:
            return None
        return max(0.0, (self.rt - self.r * self.t) / var)

    def worth(self, decode_rows: int, rows: int, alpha: float) -> int:
        """The longest draft whose last token still pays for its row: alpha^i x (step time / decode
        rows) > per-row cost, for a step of `rows` rows. A large number while the fit is unknown."""
        b = self.per_row_ms()
        if b is None or b <= 0.0:
            return 1 << 16
        step = max(self.t + b * (rows - self.r), b * rows)  # the line at `rows`, never below its own rows
        gain = step / max(1, decode_rows)  # what a token costs now
        if alpha <= 0.0 or gain <= b:
            return 0
        if alpha >= 1.0:
            return 1 << 16
        return int(math.log(b / gain) / math.log(alpha))


def _hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """h[i] = the hash of tokens[i .. i+n-1] (uint64, wrapping), for every i with a whole n-gram."""
    t = tokens.astype(np.uint64)
    h = np.zeros(len(t) - n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * np.uint64(_M) + t[j:len(t) - n + 1 + j]
    return h


def _hash(tokens: list[int], end: int, n: int) -> int:
    """The hash of tokens[end-n .. end-1], as `_hashes` computes it."""
    h = 0
    for t in tokens[end - n:end]:
        h = (h * _M + t) & _MASK
    return h


class Drafter:
    """One sequence's n-gram indexes and draft-length policy."""

    __slots__ = ("index", "indexed", "k", "cool", "cool_len", "window_drafted", "window_accepted", "window_n",
                 "_looked", "kept", "trials", "last", "min_kept")

    def __init__(self, min_kept: float = 0.0):
        self.index: tuple[dict[int, int], dict[int, int]] = ({}, {})  # LONG, SHORT: hash -> end position
        self.indexed = 0  # n-grams ending before this position are in the indexes
        self.k = K_START
        self.cool = 0  # decode steps left without drafting
        self.cool_len = COOL_FIRST
        self.window_drafted = self.window_accepted = self.window_n = 0
        self._looked: tuple[int, int, int] = (-1, 0, 0)  # the last lookup's suffix end and its two hashes
        self.kept = self.trials = 0.0  # decayed counts: draft tokens kept, and kept + first misses
        # the last verify alone, without a prior: kept / (kept + its miss); 1 before the first, so that a
        # sequence always gets one draft to show what it copies (a prior of 1/2 in a priced batch could
        # keep it from ever drafting)
        self.last = 1.0
        # draft tokens a verify must keep on average over a window, or the sequence cools down (besides
        # LOW_ACCEPT): 1 where steps are pipelined (depth 2), since there a verify costs its sequence a step
        # (it waits for its token in flight before drafting and sits out the step after the verify), so a
        # verify that keeps less than one token gives fewer tokens than decoding would have
        self.min_kept = min_kept

    def _extend(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams tokens[e-n .. e-1] for e = indexed .. upto-1 (e: where what followed starts)."""
        start = self.indexed
        if upto <= start:
            return
        if upto - start > 64:  # a prompt: hashed in numpy at once
            for d, n in zip(self.index, (LONG, SHORT)):
                lo = max(start, n)
                if upto > lo:
                    h = _hashes(np.asarray(tokens[lo - n:upto - 1], dtype=np.int64), n)  # ends lo .. upto-1
                    d.update(zip(h.tolist(), range(lo, upto)))
        else:  # a token or a few since the last lookup, whose suffix hashes are the first keys here
            looked, *hashes = self._looked
            for d, n, h in zip(self.index, (LONG, SHORT), hashes):
                for end in range(max(start, n), upto):
                    d[h if end == looked else _hash(tokens, end, n)] = end
        self.indexed = upto

    def propose(self, tokens: list[int], k_cap: int) -> tuple[int, ...]:
        """Up to min(self.k, k_cap) tokens to follow `tokens`, or () (nothing matched, or cooling)."""
        k = min(self.k, k_cap)
        if k <= 0:
            return ()
        if self.cool > 0:
            self.cool -= 1
            return ()
        end = self._lookup(tokens)
        if end is None:
            return ()
        run = tokens[end:end + k]
        # where what followed reaches the end of the tokens (a loop: the latest occurrence is the last period
        # of it), it goes on as it went: the copy overlaps itself (LZ77's overlapping match), so a loop of
        # period p drafts k tokens, not p
        return tuple(run[i % len(run)] for i in range(k)) if len(run) < k else tuple(run)

    def _lookup(self, tokens: list[int]) -> int | None:
        """Where what followed the latest earlier occurrence of the longest suffix found starts."""
        L = len(tokens)
        self._extend(tokens, L)  # every n-gram that ends before the last token (the suffix itself ends at L)
        hl, hs = (_hash(tokens, L, LONG) if L >= LONG else 0), (_hash(tokens, L, SHORT) if L >= SHORT else 0)
        self._looked = (L, hl, hs)
        for d, n, h in zip(self.index, (LONG, SHORT), (hl, hs)):
            end = d.get(h) if L >= n else None
            if end is not None and tokens[end - n:end] == tokens[L - n:L]:  # not a hash collision
                return end
        return None

    def matches(self, tokens: list[int]) -> bool:
        """Would a draft be asked for after these tokens (the same lookup as `propose`, nothing
        changed but the index)? A pipelined sequence whose next token is in flight asks this of its
        known tokens to decide whether to wait a step for that token and then draft."""
        return self.cool == 0 and self._lookup(tokens) is not None

    @property
    def alpha(self) -> float:
        """The chance that the next draft token is kept, from the recent verifies (a prior of 1/2), or
        from the last one where that says more: a copy comes in runs (a whole stretch of the file, then
        the change), so inside a run the next token is likelier than the average says."""
        return max((self.kept + 1.0) / (self.trials + 2.0), self.last)

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify of `drafted` tokens kept `accepted`: the next draft length, and the cool-down."""
        self.kept = DECAY * self.kept + accepted
        self.trials = DECAY * self.trials + accepted + (accepted < drafted)
        self.last = accepted / (accepted + (accepted < drafted)) if accepted else 0.0  # a whole draft kept: 1
        self.k = min(self.k * 2, 1 << 16) if accepted == drafted else accepted + 1
        self.window_drafted += drafted
        self.window_accepted += accepted
        self.window_n += 1
        if self.window_n == WINDOW:
            if self.window_accepted < max(LOW_ACCEPT * self.window_drafted, self.min_kept * WINDOW):
                self.cool, self.cool_len = self.cool_len, min(self.cool_len * 2, COOL_MAX)
                self.k = K_START
            else:
                self.cool_len = COOL_FIRST
            self.window_drafted = self.window_accepted = self.window_n = 0
