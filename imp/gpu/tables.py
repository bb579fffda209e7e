"""The block tables of the sequences a GPU runner holds, as one int32 array by slot; and the plan's check (issue 33,
deliverable 3).

Why: a decode step laid its rows' tables out one Python element at a time (a flat list of every row's blocks,
each step) and checked each share's table against the pool in a loop: ~0.4 of the GPU executor's host time at
256 streams, for tables that change once a block (16 tokens). The scheduler hands a KvReply's table tuple on
unchanged until the sequence's next grow, so a table is copied here when its tuple object changes (and its
entries checked then, once), and a step's tables are a gather of rows.

The check's rule (a bad plan is a ValueError: the step fails and its requests end, never a device fault): every
share feeds a token, ends within the context, and its table covers its last position with block ids inside
the pool. Host only: no clock, no device.
"""

from __future__ import annotations

import numpy as np

from imp.sampling.slots import Slots
from imp.sampling.works import Works


class Rows:
    """A step's shares as the tables see them: their slots, start positions, token counts and first tokens
    (int64 [R] each)."""

    __slots__ = ("cols", "slots", "pos", "ntok", "tok0")

    def __init__(self, cols: np.ndarray):
        self.cols = cols
        self.slots, self.pos, self.ntok, self.tok0 = (np.ascontiguousarray(c) for c in cols.T)

    def subset(self, idx) -> Rows:
        return Rows(self.cols[np.asarray(idx, np.int64)])


class Tables:
    def __init__(self, context_length: int, block_size: int, num_blocks: int, max_blocks: int, cap: int = 64):
        self.ctx, self.bs, self.num_blocks, self.MB = context_length, block_size, num_blocks, max_blocks
        self.slots = Slots(cap)
        self.tab = np.zeros((cap, max_blocks), np.int32)
        self.n = np.zeros(cap, np.int64)  # the table's length
        self.good = np.zeros(cap, np.int64)  # how many of its first entries are block ids inside the pool
        self.obj: list = [None] * cap  # the tuple each row was copied from

    def _grow(self, cap: int) -> None:
        old = len(self.obj)
        self.tab = np.concatenate([self.tab, np.zeros((cap - old, self.MB), np.int32)])
        self.n = np.concatenate([self.n, np.zeros(cap - old, np.int64)])
        self.good = np.concatenate([self.good, np.zeros(cap - old, np.int64)])
        self.obj += [None] * (cap - old)

    def check(self, works) -> Rows:
        """The shares as `Rows`, their changed tables copied in, every share checked: a bad one is a ValueError
        naming it."""
        get = self.slots.of.get
        general = works.general if isinstance(works, Works) else works
        cols = np.array([(get(w.seq_id, -1), w.start_pos, len(w.token_ids), w.token_ids[0] if w.token_ids else 0)
                         for w in general], np.int64).reshape(-1, 4)
        slots, obj = cols[:, 0], self.obj
        for r in [r for r, (j, w) in enumerate(zip(slots.tolist(), general)) if j < 0 or obj[j] is not w.block_table]:
            slots[r] = self._copy(general[r].seq_id, general[r].block_table)
        if isinstance(works, Works):  # the decode rows (first) from the plan's columns: no SeqWork a row
            rb = works.rows
            rs = [get(sid, -1) for sid in rb.seq_ids]
            tabs = rb.tables
            for r in [r for r, (j, t) in enumerate(zip(rs, tabs)) if j < 0 or obj[j] is not t]:
                rs[r] = self._copy(rb.seq_ids[r], tabs[r])
            rc = np.stack([np.asarray(rs, np.int64), rb.pos, np.ones(len(rs), np.int64), rb.tok], axis=1)
            cols = np.concatenate([rc, cols]) if len(cols) else rc
        rows = Rows(cols)
        end = rows.pos + rows.ntok
        nb = (end - 1) // self.bs + 1
        bad = (rows.ntok < 1) | (end > self.ctx) | (nb > self.good[rows.slots])
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            w, j = works[r], rows.slots[r]
            if rows.ntok[r] < 1:
                raise ValueError(f"{w.seq_id}: no tokens")
            if end[r] > self.ctx:
                raise ValueError(f"{w.seq_id}: position {end[r] - 1} beyond context length {self.ctx}")
            if nb[r] > self.n[j]:
                raise ValueError(f"{w.seq_id}: block table too short for position {end[r] - 1}")
            raise ValueError(f"{w.seq_id}: block id out of range (num_blocks={self.num_blocks})")
        return rows

    def _copy(self, sid: str, table: tuple[int, ...]) -> int:
        j = self.slots.assign(sid)
        if j >= len(self.obj):
            self._grow(self.slots.cap)
        n = min(len(table), self.MB)
        old = self.obj[j]
        if old is not None:  # a grow appends to the table this row holds: only the new entries are checked and copied
            k = len(old)
            if k < n and self.good[j] == k and table[:k] == old:
                tail, nb = table[k:n], self.num_blocks
                if all(0 <= b < nb for b in tail):
                    self.tab[j, k:n] = tail
                    self.good[j] = n
                    self.n[j] = len(table)
                    self.obj[j] = table
                    return j
        a = np.asarray(table[:n], np.int64)
        out = (a < 0) | (a >= self.num_blocks)
        self.good[j] = int(np.argmax(out)) if out.any() else n
        self.tab[j, :n] = np.where(out, 0, a)
        self.n[j] = len(table)
        self.obj[j] = table
        return j

    def forget(self, seq_ids) -> None:
        for j in self.slots.forget(seq_ids):
            self.obj[j] = None

    def rows(self, slots: np.ndarray, width: int) -> np.ndarray:
        """[R, width] int32: the first `width` blocks of each slot's table (entries past a table's length: stale)."""
        return self.tab[slots, :width]
