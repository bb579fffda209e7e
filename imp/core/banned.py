"""Banned strings and regexes over a sequence's generated text: which phrase a new token completes
(the scheduler then rewinds the sequence to the token the phrase starts in and bans that token
there), and how many of its tokens no phrase can reach any more (the scheduler holds the rest back).

Pure: the token texts come from a `TokenTexts` message (the vocabulary's bytes, special tokens
empty, the text the client sees), never from a tokenizer here, so a replay needs no model.

Matching, as the API reference defines it:
- banned_strings: bytes, ASCII case-insensitive (TabbyAPI / exllamav2 match phrases without case);
  a match counts when it ends in the new token's bytes. Held back: the longest tail of the text
  that is a proper prefix of some phrase (the phrase may still complete), at most 255 bytes.
- banned_regex (Python `re`, on the text decoded as UTF-8 with undecodable bytes kept apart): the
  leftmost match that ends in new text inside the last 256 bytes. A regex's completion cannot be
  foreseen, so the last 255 bytes are always held back.
- after MAX_REWINDS rewinds the phrases pass: a model that insists is not looped forever.
"""

from __future__ import annotations

import bisect
import re

import numpy as np

MAX_REWINDS = 64  # per sequence; then the phrases pass
WINDOW = 256  # bytes: the longest phrase or pattern, and how far back a regex match may start
HOLD = WINDOW - 1  # the most bytes held back


class Texts:
    """The vocabulary's bytes as one blob (item i = blob[offsets[i]:offsets[i+1]]); from a TokenTexts."""

    __slots__ = ("blob", "offsets", "n")

    def __init__(self, blob: bytes, offsets: bytes):
        self.blob = blob
        self.offsets = np.frombuffer(offsets, dtype="<i8").tolist()
        self.n = len(self.offsets) - 1
        if self.n < 1 or self.offsets[0] != 0 or self.offsets[-1] != len(blob):
            raise ValueError("token texts: offsets must run from 0 to the blob's length")

    def of(self, token: int) -> bytes:
        if not 0 <= token < self.n:
            return b""
        return self.blob[self.offsets[token]:self.offsets[token + 1]]


class BanWatch:
    """One sequence's generated text, checked against its banned phrases token by token."""

    __slots__ = ("texts", "phrases", "prefixes", "longest", "regexes", "buf", "ends", "rewinds")

    def __init__(self, texts: Texts, strings: tuple[str, ...], regexes: tuple[str, ...]):
        self.texts = texts
        self.phrases = tuple(dict.fromkeys(s.encode("utf-8").lower() for s in strings if s))
        # every proper prefix of a phrase: a text tail among them may still complete one
        self.prefixes = frozenset(p[:k] for p in self.phrases for k in range(1, len(p)))
        self.longest = max((len(p) for p in self.phrases), default=0)
        self.regexes = tuple(re.compile(r) for r in regexes)
        self.buf = bytearray()  # the generated tokens' text
        self.ends: list[int] = []  # byte end of each generated token in buf
        self.rewinds = 0

    @property
    def spent(self) -> bool:
        """The rewinds are used up: the phrases pass from now on."""
        return self.rewinds >= MAX_REWINDS

    def push(self, token: int) -> int | None:
        """Append a generated token; the index of the generated token a phrase it completes starts
        in (the leftmost such phrase), else None."""
        before = len(self.buf)
        self.buf += self.texts.of(token)
        self.ends.append(len(self.buf))
        if len(self.buf) == before or self.spent:
            return None
        start = self._phrase(before)
        r = self._regex(before)
        if r is not None and (start is None or r < start):
            start = r
        return None if start is None else bisect.bisect_right(self.ends, start)

    def _phrase(self, before: int) -> int | None:
        if not self.phrases:
            return None
        lo = max(0, before - self.longest + 1)
        low = bytes(self.buf[lo:]).lower()
        best = None
        for p in self.phrases:  # a match that ends in the new bytes starts after before - len(p)
            j = low.find(p, max(0, before - len(p) + 1 - lo))
            if j >= 0 and (best is None or lo + j < best):
                best = lo + j
        return best

    def _regex(self, before: int) -> int | None:
        if not self.regexes:
            return None
        lo = max(0, len(self.buf) - WINDOW)
        text = bytes(self.buf[lo:]).decode("utf-8", "surrogateescape")
        best = None
        for rx in self.regexes:
            pos = 0
            while pos <= len(text):
                m = rx.search(text, pos)
                if m is None:
                    break
                a = lo + _nbytes(text, m.start())
                if best is not None and a >= best:
                    break
                if lo + _nbytes(text, m.end()) > before:  # ends in the new text
                    best = a
                    break
                pos = m.start() + 1  # it ended in text checked already: a later start may reach the new text
        return best

    def safe(self) -> int:
        """How many generated tokens no phrase can reach any more (the rest are held back)."""
        n = len(self.buf)
        if self.spent:
            return len(self.ends)
        hold = n
        if self.regexes:
            hold = max(0, n - HOLD)
        elif self.phrases:
            hold = n
            for k in range(min(n, self.longest - 1), 0, -1):  # the longest tail that starts a phrase
                if bytes(self.buf[n - k:]).lower() in self.prefixes:
                    hold = n - k
                    break
        return bisect.bisect_right(self.ends, hold)

    def rewind(self, keep: int) -> None:
        """Keep the first `keep` generated tokens (a rewind to the token a phrase started in)."""
        self.rewinds += 1
        self.truncate(keep)

    def truncate(self, keep: int) -> None:
        del self.ends[keep:]
        del self.buf[self.ends[-1] if self.ends else 0:]


def _nbytes(text: str, i: int) -> int:
    """UTF-8 bytes of text[:i] (an undecodable byte, kept as a lone surrogate, counts as one)."""
    return len(text[:i].encode("utf-8", "surrogateescape"))
