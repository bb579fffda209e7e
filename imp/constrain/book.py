"""The executor's constraint book: one matcher per constrained sequence, masks per step.

A sequence's grammar state is a pure function of (its Constraint, the tokens it
has generated): every constrained share that samples reaches the runner with
those tokens (`SeqWork.history`, complete once any pending token is filled in:
sent by the scheduler once per admission, kept and extended by the executor,
`imp.actors.executor.attach_state`), and the book `sync`s the sequence's
matcher to them before computing its mask.
So preemption, recompute, a failed step or a replayed log need nothing special:
the next mask is always the grammar's answer for exactly that history.

`masks(works)` is called by a runner right before it samples: it returns the
rows (indices into `works`) that are constrained and their bitmask (one int32
row of ceil(V/32) words each, filled in parallel by llguidance without the GIL),
or None when no share is constrained. A sequence whose history does not fit
its grammar any more (cannot happen with the mask on; a log from another
grammar build) gets an EOS-only row, so it ends instead of drifting.

The grammar was compiled at admission time (HTTP, with its deadline); the book
finds it in the shared cache, or compiles it again with `compile_sync` (another
process, or evicted from the LRU).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence

import numpy as np

from imp.constrain.compile import GrammarCache
from imp.constrain.errors import ConstraintError
from imp.constrain.mask import apply_mask
from imp.constrain.matcher import SeqMatcher, fill_masks, mask_words
from imp.messages import SeqWork

log = logging.getLogger("imp.constrain")


class ConstraintBook:
    def __init__(self, cache: GrammarCache, compile_timeout_s: float = 5.0):
        self.cache = cache
        self.compile_timeout_s = compile_timeout_s
        self._matchers: dict[str, SeqMatcher] = {}
        self._lock = threading.Lock()  # launch and collect threads of a pipelined executor
        self._words = mask_words(cache.vocab_size)
        self._buf = np.zeros((0, self._words), dtype=np.int32)
        self.failures = 0  # sequences whose history left their grammar (EOS-only from then on)

    def forget(self, seq_ids: Iterable[str]) -> None:
        with self._lock:
            for sid in seq_ids:
                self._matchers.pop(sid, None)

    def __len__(self) -> int:
        return len(self._matchers)

    def _matcher(self, w: SeqWork) -> SeqMatcher | None:
        m = self._matchers.get(w.seq_id)  # a sequence's constraint never changes; forgotten when freed
        if m is None:
            try:
                g = self.cache.get(w.params.constraint) or self.cache.compile_sync(w.params.constraint,
                                                                                   self.compile_timeout_s)
            except ConstraintError as exc:  # admission compiled it; only a broken build gets here
                log.error("%s: constraint does not compile in the executor: %s", w.seq_id, exc)
                return None
            m = self._matchers[w.seq_id] = g.matcher()
        return m

    def masks(self, works: Sequence[SeqWork]) -> tuple[list[int], np.ndarray] | None:
        """(rows, bitmask [len(rows), words] int32, numpy) for the constrained shares of a step
        that sample, in `works` order; None when there are none. The bitmask is a view of
        a buffer reused by the next call: copy it (or its device upload) before then."""
        rows = [i for i, w in enumerate(works) if w.sample and w.params is not None and w.params.constraint is not None]
        if not rows:
            return None
        with self._lock:
            if self._buf.shape[0] < len(rows):
                self._buf = np.zeros((max(len(rows), 2 * self._buf.shape[0]), self._words), dtype=np.int32)
            bitmask = self._buf[:len(rows)]
            fill: list[tuple[SeqMatcher, int]] = []
            for j, i in enumerate(rows):
                w = works[i]
                m = self._matcher(w)
                if m is not None:
                    had = m.tokens[-4:]
                    try:
                        m.sync(w.history)
                        fill.append((m, j))
                        continue
                    except ConstraintError as exc:
                        self.failures += 1
                        # what the matcher had consumed at the last mask vs the history now: tells a
                        # mask that was not applied from a history that changed under it
                        log.warning("%s: generated tokens leave the grammar (%s); only EOS from here "
                                    "(matcher had ...%s of %d, history ...%s of %d, pending %d)", w.seq_id, exc,
                                    list(had), len(m.tokens), list(w.history[-4:]), len(w.history), w.pending)
                self._eos_only(bitmask[j], w)
            fill_masks(fill, bitmask, self.cache.executor if len(fill) > 1 else None)
        return rows, bitmask

    def apply(self, logits, works: Sequence[SeqWork]) -> bool:
        """Mask logits [len(works), V] fp32 (numpy, or a torch tensor on the CPU or a GPU) in
        place for the constrained shares: what a runner calls right before it samples. False
        when nothing was constrained."""
        got = self.masks(works)
        if got is None:
            return False
        rows, bitmask = got
        apply_mask(logits, bitmask, rows)  # to a GPU: bitmask and rows copied over, synchronously
        return True

    def _eos_only(self, row: np.ndarray, w: SeqWork) -> None:
        row[:] = 0
        u = row.view(np.uint32)  # bit 31 too, without an int32 overflow
        for t in w.params.stop_token_ids:
            if 0 <= t < self._words * 32:
                u[t // 32] |= np.uint32(1 << (t % 32))
