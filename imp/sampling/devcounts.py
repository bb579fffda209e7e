"""Penalty counts on the device, kept across steps: the GPU sampler's penalties without per-row host work.

Why: the contract's default repetition_penalty is 1.05, so every request through HTTP is penalized, and the
segment path (`imp.sampling.counts.HistoryCounts` + `imp.sampling.gpu.penalty_segments`) does Python work per
penalized row per step: on an H100 at 256 streams the executor's step thread spent half its samples there and,
with the event loop, held the GIL more than the wall (issue 33: HTTP at 0.74 of the engine, whose bench rows
were plain greedy). Here each penalized sequence owns a row of V int32 counts on the device; the ids a step
samples are added on the device right after the draw (`record`), so the next step's penalties (one launch,
`imp.kernels.cuda.sampling.penalize_dense`) need from the host only each row's table slot and parameters.

In sync: a table row holds `n[row]` generated tokens (an array by row: no dict work a row a step); a share
sampling its token number `gen_index` finds its row in sync when n == gen_index (the token in flight, pipelined, was added on the device by the step before,
which the device runs first). Anything else (a first share, a recompute after preemption, a verify step, a
forced token, a row sampled on the host) is counted afresh from the share's history (+ its in-flight token, read
on the device), once. A table of `max_bytes` at most (rows grow by doubling): sequences past it take the segment
path, so memory stays bounded whatever the vocabulary.

The GPU runner's counts since 7e2f935. Its first H100 run, with torch's sort-based index_put_(accumulate=True)
for the adds, was 13-29 % slower than the segment path at 16-64 streams; with one atomic kernel for them
(`count_add`) it equals the segment path at 16-64 and is 4-9 % faster at 256 (PERFORMANCE.md "The default
penalty on the device"). The kernels are checked bit for bit against the CPU reference in the GPU lane
(tests/test_devcounts.py).
"""

from __future__ import annotations

import numpy as np
import torch

from imp.kernels.cuda import sampling as k
from imp.kernels.cuda.runtime import to_device
from imp.messages import SeqWork
from imp.sampling.counts import HistoryCounts
from imp.sampling.rowparams import F_FREQ, F_REP

MAX_BYTES = 256 << 20  # the table's bound: 256 MB (Gemma's 262k vocabulary: 256 rows)


class DeviceCounts:
    def __init__(self, vocab: int, device, max_bytes: int = MAX_BYTES):
        self.V, self.device = vocab, torch.device(device)
        self.cap_max = max(1, max_bytes // (4 * vocab))
        self.table: torch.Tensor | None = None  # [cap, V] int32
        self.slot: dict[str, int] = {}  # seq id -> its table row
        self.n = np.zeros(0, np.int64)  # by table row: the generated tokens it counts (-1: to count afresh)
        self.free: list[int] = []
        self.host = HistoryCounts()  # the rows past the table: the segment path's counts
        self._taken: tuple[torch.Tensor, torch.Tensor, np.ndarray] | None = None  # the last penalize's rows, for record

    def drop_taken(self) -> None:
        """A step begins: no rows of an earlier penalize wait for their ids (that step failed before its draw)."""
        self._taken = None

    def forget(self, seq_ids) -> None:
        for s in seq_ids:
            r = self.slot.pop(s, None)
            if r is not None:
                self.free.append(r)
                self.n[r] = -1
        self.host.forget(seq_ids)

    def _assign(self, sid: str) -> int | None:
        r = self.slot.get(sid)
        if r is not None:
            return r
        if not self.free:
            cap = 0 if self.table is None else self.table.shape[0]
            if cap >= self.cap_max:
                return None
            new = min(self.cap_max, max(16, 2 * cap))
            t = torch.zeros(new, self.V, dtype=torch.int32, device=self.device)
            if self.table is not None:
                t[:cap].copy_(self.table)
            self.table = t
            self.n = np.concatenate([self.n, np.full(new - cap, -1, np.int64)])
            self.free.extend(range(new - 1, cap - 1, -1))
        r = self.slot[sid] = self.free.pop()
        self.n[r] = -1  # counted afresh at once
        return r

    def penalize(self, logits: torch.Tensor, works: list[SeqWork], rows: list[int], pending=None, step=None
                 ) -> list[int]:
        """In place on logits [R, V] fp32: the penalties of works[r] for r in rows (penalized rows, one share per
        sequence), from the table; returns the rows it could not take (the table is full): the segment path's.
        pending: `imp.sampling.gpu.draw_ids`'s (rows, ids on the device, slots): a row out of sync counts its
        token in flight from there. step (`imp.sampling.rowparams.Step`): the rows' params gathered on the
        device instead of read from each row."""
        self._taken = None
        get = self.slot.get
        # (the rows' seq ids and gen_index from the step's columns where given: a decode row is no SeqWork)
        all_sids = step.sids if step is not None else [w.seq_id for w in works]
        slots = [get(all_sids[r]) for r in rows]
        if None in slots:  # a first share: a row in the table if it has room, else the segment path
            for j, r in enumerate(rows):
                if slots[j] is None:
                    slots[j] = self._assign(all_sids[r])
        take = [r for r, sl in zip(rows, slots) if sl is not None]
        if not take:
            return list(rows)
        rest = [r for r, sl in zip(rows, slots) if sl is None]
        slots = [sl for sl in slots if sl is not None]
        sl_np = np.asarray(slots, np.int64)
        gens = step.gen[take] if step is not None else np.array([works[r].gen_index for r in take], np.int64)
        st = np.flatnonzero(self.n[sl_np] != gens)
        if len(st):
            self._recount(works, [(take[i], slots[i]) for i in st.tolist()], pending)
        dev = self.device
        rs = to_device(np.array([take, slots], np.int64), torch.int64, dev)  # one copy up: rows, slots
        rows_t, slots_t = rs[0], rs[1]
        if step is not None:
            prm = step.f[:, F_REP:F_FREQ + 1].index_select(0, rows_t)
        else:
            prm = to_device(np.array([(works[r].params.repetition_penalty, works[r].params.presence_penalty,
                                       works[r].params.frequency_penalty) for r in take], np.float32),
                            torch.float32, dev)
        k.penalize_dense(logits, self.table, rows_t, slots_t, prm)
        self._taken = (rows_t, slots_t, sl_np)
        return rest

    def _recount(self, works: list[SeqWork], stale: list[tuple[int, int]], pending) -> None:
        """The stale rows zeroed and counted from their shares' histories (and their in-flight tokens)."""
        dev, V = self.device, self.V
        self.table.index_fill_(0, to_device([s for _, s in stale], torch.int64, dev), 0)
        srow, sid_, cnt = [], [], []
        for r, s in stale:
            h = np.fromiter(works[r].history, np.int64, len(works[r].history))
            h = h[(h >= 0) & (h < V)]
            if h.size:
                u, c = np.unique(h, return_counts=True)
                srow.append(np.full(u.size, s, np.int64))
                sid_.append(u)
                cnt.append(c.astype(np.int32))
            self.n[s] = len(works[r].history)
        if srow:  # the rows were zeroed and each (row, id) comes once: a plain scatter (accumulating would sort)
            self.table.index_put_((to_device(torch.from_numpy(np.concatenate(srow)), torch.int64, dev),
                                   to_device(torch.from_numpy(np.concatenate(sid_)), torch.int64, dev)),
                                  to_device(torch.from_numpy(np.concatenate(cnt)), torch.int32, dev), accumulate=False)
        if pending is not None:
            at = dict(zip(pending[0], pending[2] if len(pending) > 2 else range(len(pending[0]))))
            fly = [(r, s, at[r]) for r, s in stale if r in at]  # (row, table slot, its in-flight id's index)
            if fly:
                # sampled ids are in 0..V-1 (an argmax over V): no mask, which would cost a sync
                ids = pending[1].index_select(0, to_device([j for _, _, j in fly], torch.int64, dev)).to(torch.int64)
                k.count_add(self.table, to_device([s for _, s, _ in fly], torch.int64, dev), ids)
                for _, s, _ in fly:
                    self.n[s] += 1

    def record(self, ids: torch.Tensor) -> None:
        """After the draw: the ids the last `penalize`'s rows sampled (ids [R] on the device, by row) added to their
        rows, on the device, so the next step finds them counted without the host."""
        if self._taken is None:
            return
        rows_t, slots_t, sl = self._taken
        self._taken = None
        t = ids.index_select(0, rows_t).to(torch.int64)  # in 0..V-1 (an argmax): no mask (a mask syncs)
        k.count_add(self.table, slots_t, t)
        self.n[sl] += 1  # (a sequence has one share a step: its row once)
