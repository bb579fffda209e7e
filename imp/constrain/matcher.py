"""One sequence's place in its grammar: masks for the next token, and advancing.

A SeqMatcher wraps a private llguidance.LLMatcher (a deep copy of the
compiled template, so the grammar is compiled once per spec, not once per
sequence) and the list of tokens it has consumed. That list is the state
the engine can check against: after a preemption or a recompute the
executor calls `sync(generated)` with the sequence's output tokens and the
matcher rolls back / replays to match.

EOS: the mask allows the EOS ids exactly where the grammar may end
(`accepting()`); once the grammar can go no further (`done()`) the mask is
EOS only. llguidance does not count an EOS taken after it stopped; we keep
such EOS tokens in our list as "virtual" ones (always at the tail) so that
rollback counts stay right.

Not thread-safe: one owner at a time (llguidance raises "Already borrowed"
if two threads touch one matcher at once). Different SeqMatchers may run on
different threads; `fill_masks` computes a batch in parallel in Rust.
"""

from __future__ import annotations

from typing import Sequence

import llguidance
import numpy as np

from imp.constrain.errors import ConstraintError


def mask_words(vocab_size: int) -> int:
    """int32 words in one bitmask row (32 tokens per word, bit t % 32 of word t // 32)."""
    return (vocab_size + 31) // 32


class SeqMatcher:
    """Grammar state of one sequence; see the module doc."""

    __slots__ = ("_m", "_tokens", "_virtual", "_eos", "_words", "key")

    def __init__(self, m: llguidance.LLMatcher, eos_ids: frozenset[int], vocab_size: int, key: str = ""):
        self._m = m
        self._tokens: list[int] = []
        self._virtual = 0  # trailing EOS tokens taken after the grammar stopped (llguidance ignores them)
        self._eos = eos_ids
        self._words = mask_words(vocab_size)
        self.key = key  # the compiled grammar's cache key (for logs and replay checks)

    # ------------------------------------------------------------------ state

    @property
    def tokens(self) -> list[int]:
        """The tokens consumed so far (read only: do not mutate)."""
        return self._tokens

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a step over llguidance's limits), else None. A failed
        matcher's mask is EOS only; the engine should end the sequence with this reason."""
        if not self._m.is_error():
            return None
        return self._m.get_error() or "unknown llguidance error"

    def accepting(self) -> bool:
        """The output so far is a complete match: stopping (EOS) is allowed here."""
        return self._m.is_accepting()

    def done(self) -> bool:
        """Nothing but EOS can follow (the grammar is complete, or the matcher failed:
        see `error`). The engine may finish the sequence without sampling."""
        return self._m.is_stopped()

    # ------------------------------------------------------------------ masks

    def fill_mask(self, row) -> None:
        """Write the allowed-next-token bitmap into `row`: a contiguous int32 array (numpy, or a
        CPU torch tensor) of ceil(V / 32) words (one row of `mask.alloc_bitmask`). Releases the
        GIL while llguidance computes (~20 us to ~1 ms a row, by grammar; bounded by its step fuel)."""
        self._m.unsafe_compute_mask_ptr(_check_rows(row, self._words, 1).ctypes.data, self._words * 4)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (fast-forward), without consuming them; [] when
        the next token is a real choice. Feeding them through `advance` is optional."""
        return self._m.compute_ff_tokens()

    # ------------------------------------------------------------------ advancing

    def advance(self, token_id: int) -> None:
        """Consume the sampled token. Raises ConstraintError (and stays unchanged) when the
        grammar does not allow it here."""
        m = self._m
        if m.is_error():
            raise ConstraintError(f"grammar matcher failed: {m.get_error()}")
        if token_id in self._eos and m.is_stopped():
            self._tokens.append(token_id)
            self._virtual += 1
            return
        # try_consume_tokens leaves the matcher as it was on a refused token; consume_token
        # would put it in a permanent error state.
        if m.try_consume_tokens([token_id]) != 1:
            if m.is_error():
                raise ConstraintError(f"grammar matcher failed: {m.get_error()}")
            raise ConstraintError(f"token {token_id} is not allowed by the grammar here")
        self._tokens.append(token_id)

    def rollback(self, n: int) -> None:
        """Forget the last n consumed tokens."""
        if not 0 <= n <= len(self._tokens):
            raise ValueError(f"rollback {n} of {len(self._tokens)} tokens")
        if n == 0:
            return
        virtual = min(n, self._virtual)
        self._virtual -= virtual
        real = n - virtual
        if real and not self._m.rollback(real):
            raise ConstraintError(f"grammar rollback failed: {self._m.get_error()}")
        del self._tokens[len(self._tokens) - n:]

    def fork(self) -> "SeqMatcher":
        """An independent copy in the same state (a sequence forked mid-generation)."""
        twin = SeqMatcher(self._m.deep_copy(), self._eos, self._words * 32, self.key)  # same word count
        twin._tokens = list(self._tokens)
        twin._virtual = self._virtual
        return twin

    def reset(self) -> None:
        """Back to the start of the grammar."""
        if not self._m.reset():
            raise ConstraintError(f"grammar reset failed: {self._m.get_error()}")
        self._tokens.clear()
        self._virtual = 0

    def sync(self, generated: Sequence[int]) -> None:
        """Make the consumed tokens equal `generated` (the sequence's output so far): a
        no-op when they already are (one list compare), else roll back to the common
        prefix and replay the rest. Raises ConstraintError if `generated` does not fit
        the grammar (the matcher is then left at the longest prefix that does)."""
        g = generated if isinstance(generated, list) else list(generated)
        t = self._tokens
        if t == g:
            return
        p = 0
        for a, b in zip(t, g):
            if a != b:
                break
            p += 1
        self.rollback(len(t) - p)
        for tok in g[p:]:
            self.advance(tok)


def fill_masks(rows: Sequence[tuple[SeqMatcher, int]], bitmask, executor: llguidance.LLExecutor | None = None) -> None:
    """Fill bitmask[i] for every (matcher, i) in `rows`; bitmask is a contiguous int32
    [R, ceil(V / 32)] array (numpy, or a CPU torch tensor). With an executor
    (GrammarCache.executor) the rows are computed in parallel on llguidance's Rust thread
    pool, without the GIL."""
    if not rows:
        return
    words = rows[0][0]._words
    arr = _check_rows(bitmask, words, 2)
    if executor is None or len(rows) == 1:
        for m, i in rows:
            m.fill_mask(arr[i])
        return
    executor.unsafe_compute_mask_ptr([(m._m, i) for m, i in rows], arr.ctypes.data, words * 4, arr.shape[0])


def _check_rows(t, words: int, ndim: int) -> np.ndarray:
    """t as a numpy array sharing its memory, after the checks: llguidance writes through a raw
    pointer, so a wrong shape here is memory corruption."""
    if getattr(t, "is_cuda", False):
        raise ValueError("bitmask must be in host memory, not on the GPU")
    a = np.asarray(t)  # a CPU torch tensor shares its memory
    if a.dtype != np.int32 or a.ndim != ndim or not a.flags.c_contiguous or not a.flags.writeable:
        raise ValueError(f"bitmask must be a contiguous, writable int32 array of rank {ndim}, got "
                         f"{a.dtype} rank {a.ndim} contiguous={a.flags.c_contiguous}")
    if a.shape[-1] != words:
        raise ValueError(f"bitmask rows have {a.shape[-1]} words, the vocabulary needs {words}")
    return a
