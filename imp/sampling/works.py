"""A step's shares as a runner sees them when the plan brings decode lane rows as columns (issue 33, deliverable 3).

`RowBatch` is a plan's `DecodeRows` with what the executor keeps for their sequences (params from each one's first
share, a penalized or constrained one's generated tokens): numpy columns (token, start, gen_index, pending) and
the seq ids and tables as the plan holds them. `Works` is a whole step's shares in the plan's order, the rows first
then the general `SeqWork`s, as a read-only sequence: code that reads a share (an eager or grammar path, a verify)
gets a complete SeqWork, made on first use of that row; the hot paths of a GPU runner read the columns instead
(`imp.gpu.tables.Tables.check`, `imp.sampling.rowparams.RowParams.take`, `Works.seq_ids`) and make none. Why
lazily: the SeqWork a row is the per-row Python the columns take out, and every path that has not been moved to
the columns keeps working, at today's cost, by making them.

`split_tokens` is the way back: a step's sampled ids (or SampledTokens) into the rows' id column and the general
shares' SampledTokens. No clock, no I/O.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from imp.messages import PENDING_TOKEN, DecodeRows, SampledToken, SamplingParams, SeqWork


class HistoryView(Sequence):
    """The first n tokens of a kept history list, read in place: a share's `history` without copying
    O(tokens generated) into a tuple every step. Tokens are only ever appended to the list (on the
    event loop, `record_samples`) and the view never reads past n, so a runner thread reading it while a
    later token lands sees the same n tokens (a slice of it is a tuple)."""

    __slots__ = ("_l", "_n")

    def __init__(self, tokens: list[int], n: int):
        self._l, self._n = tokens, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._l[slice(*i.indices(self._n))])
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError(i)
        return self._l[i]

    def __iter__(self):
        return itertools.islice(self._l, self._n)

    def __eq__(self, other) -> bool:
        return isinstance(other, Sequence) and len(other) == self._n and tuple(self) == tuple(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"HistoryView({self._n} tokens)"


class RowBatch:
    """A plan's DecodeRows with the executor's kept state: rows as columns, a SeqWork of one on demand."""

    __slots__ = ("seq_ids", "tables", "tok", "pos", "gen", "pending", "_kept", "_hists", "_made")

    def __init__(self, rows: DecodeRows, kept: dict[str, SamplingParams], hists: dict[str, list[int]]):
        cols = np.frombuffer(rows.cols, "<i8").reshape(-1, 3)
        if len(cols) != len(rows.seq_ids) or len(rows.tables) != len(rows.seq_ids):
            raise ValueError(f"decode rows of {len(rows.seq_ids)} ids, {len(rows.tables)} tables, {len(cols)} columns")
        self.seq_ids, self.tables = rows.seq_ids, rows.tables
        self.tok, self.pos, self.gen = cols[:, 0], cols[:, 1], cols[:, 2]
        self.pending = (self.tok == PENDING_TOKEN).astype(np.int64)
        missing = [s for s in self.seq_ids if s not in kept]
        if missing:  # the scheduler's bug: a lane row before its sequence's first share
            raise KeyError(missing[0])
        self._kept, self._hists = kept, hists
        self._made: dict[int, SeqWork] = {}

    def __len__(self) -> int:
        return len(self.seq_ids)

    def params(self, r: int) -> SamplingParams:
        return self._kept[self.seq_ids[r]]

    def work(self, r: int) -> SeqWork:
        """Row r as a complete SeqWork (as `imp.actors.executor.attach_state` completes a share)."""
        w = self._made.get(r)
        if w is None:
            sid, g, pend = self.seq_ids[r], int(self.gen[r]), int(self.pending[r])
            h = self._hists.get(sid)
            n = g - pend
            if h is not None and n > 0 and len(h) < n:
                raise KeyError(f"{sid}: {n} tokens of history needed, {len(h)} kept")
            w = self._made[r] = SeqWork(sid, (int(self.tok[r]),), int(self.pos[r]), self.tables[r], True,
                                        self._kept[sid], gen_index=g, pending=pend,
                                        history=HistoryView(h, n) if h is not None and n > 0 else ())
        return w

    def works(self) -> list[SeqWork]:
        return [self.work(r) for r in range(len(self.seq_ids))]

    @property
    def made(self) -> int:
        """How many rows were made into SeqWorks (the hot paths make none)."""
        return len(self._made)


class Works(Sequence):
    """A step's shares: `rows` (a RowBatch, first) then `general` (complete SeqWorks), in plan order."""

    def __init__(self, rows: RowBatch, general: list[SeqWork]):
        self.rows, self.general = rows, general
        self.n_rows = len(rows)
        self.seq_ids = list(rows.seq_ids) + [w.seq_id for w in general]

    def __len__(self) -> int:
        return self.n_rows + len(self.general)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if i < self.n_rows:
            if i < 0:
                raise IndexError(i)
            return self.rows.work(i)
        return self.general[i - self.n_rows]

    def __iter__(self):
        for r in range(self.n_rows):
            yield self.rows.work(r)
        yield from self.general

    def subset(self, order: list[int]):
        """The shares at these indices (ascending): a Works again where they keep every row, else a list."""
        n = self.n_rows
        if len(order) >= n and order[:n] == list(range(n)):
            return Works(self.rows, [self.general[i - n] for i in order[n:]])
        return [self[i] for i in order]


def seq_ids_of(works) -> list[str]:
    """Every share's seq id, without making a lane row's SeqWork."""
    ids = getattr(works, "seq_ids", None)
    return ids if ids is not None else [w.seq_id for w in works]


def split_tokens(row_ids: tuple[str, ...], seq_ids: list[str] | None, ids: np.ndarray | None,
                 tokens: list[SampledToken] | None) -> tuple[np.ndarray, list[SampledToken]]:
    """A step's samples split between its lane rows and its general shares: (int64 [R] ids by row, -1 where a
    row sampled nothing; the general shares' SampledTokens in their order). From (seq_ids, ids) as a runner lands a
    step (the rows first, in plan order, unless one was left out), or from SampledTokens (any order)."""
    R = len(row_ids)
    if tokens is None:
        if seq_ids[:R] == list(row_ids):  # (the usual case: a C loop over the ids)
            return np.asarray(ids[:R], np.int64), [SampledToken(seq_id=s, token_id=t)
                                                    for s, t in zip(seq_ids[R:], ids[R:].tolist())]
        tokens = [SampledToken(seq_id=s, token_id=t) for s, t in zip(seq_ids, ids.tolist())]
    by = {t.seq_id: t for t in tokens}
    out = np.fromiter((by[s].token_id if s in by else -1 for s in row_ids), np.int64, R)
    rows = set(row_ids)
    return out, [t for t in tokens if t.seq_id not in rows]
