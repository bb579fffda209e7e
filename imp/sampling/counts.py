"""Penalty counts kept per sequence across steps (the GPU sampler's host side).

Penalties need, per penalized row, the distinct token ids of its generated history and how often
each occurs. Counting the whole history every step (np.unique over every row's tokens) made a step
O(tokens generated): 5 ms at 64 rows x 1,000 tokens, 24 ms at 4,000, against a ~1.5 ms device step.
A sequence's history only grows (the scheduler's tokens are append-only: a dropped in-flight sample
was never among them, a recompute after preemption re-sends the same ones, forced tokens are
appended), so each step adds just the tokens new since the last one: O(new tokens) a row, plus a
copy of the row's distinct ids when one is new. A history shorter than what was counted, or whose
last counted position holds another token (a sequence id reused without a `forget`: benchmarks,
tests), is counted afresh.
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.zeros(0, np.int32)


class HistoryCounts:
    """seq_id -> (tokens counted, distinct ids, their counts): int32 buffers with room to grow, the first
    m entries in use, ids sorted (a new id moves the tail by one, in place)."""

    def __init__(self):
        # seq_id -> [n counted, m distinct, ids buffer, counts buffer, the last token counted]
        self._by: dict[str, list] = {}

    def get(self, seq_id: str, history, V: int) -> tuple[np.ndarray, np.ndarray]:
        """The (ids, counts) of `history`'s tokens in 0..V-1, updated from the last call's. Views into the
        kept buffers: valid until the next call for this sequence (the sampler copies them at once)."""
        e = self._by.get(seq_id)
        L = len(history)
        if e is None or L < e[0] or (e[0] and history[e[0] - 1] != e[4]):  # not a growth of what was counted
            e = self._by[seq_id] = [0, 0, np.empty(16, np.int32), np.empty(16, np.int32), -1]
        n, m, ids, cnt, _ = e
        if L - n == 1:  # the usual step: one token more
            t = history[n]
            if 0 <= t < V:
                i = int(np.searchsorted(ids[:m], t))
                if i < m and ids[i] == t:
                    cnt[i] += 1
                else:
                    if m == ids.size:
                        ids, cnt = e[2], e[3] = np.resize(ids, 2 * m), np.resize(cnt, 2 * m)
                    ids[i + 1:m + 1] = ids[i:m].copy()
                    cnt[i + 1:m + 1] = cnt[i:m].copy()
                    ids[i], cnt[i] = t, 1
                    m += 1
        elif L > n:
            new = np.asarray(history[n:], dtype=np.int64)
            new = new[(new >= 0) & (new < V)]
            if new.size:
                u, inv = np.unique(np.concatenate([ids[:m].astype(np.int64), new]), return_inverse=True)
                c = np.bincount(inv, weights=np.concatenate([cnt[:m], np.ones(new.size, np.int32)]))
                m = u.size
                ids, cnt = np.empty(max(16, 2 * m), np.int32), np.empty(max(16, 2 * m), np.int32)
                ids[:m], cnt[:m] = u, c
        e[:] = [L, m, ids, cnt, history[L - 1] if L else -1]
        return ids[:m], cnt[:m]

    def forget(self, seq_ids) -> None:
        for s in seq_ids:
            self._by.pop(s, None)

    def __len__(self) -> int:
        return len(self._by)


class DraftCounts:
    """`penalty_segments`' counts for a verify step's drafted positions (`GpuModelRunner._draft_works`):
    position j of a share samples after its history and the draft's first j tokens, so the share's history is
    counted once, by `shares` (a HistoryCounts kept across steps: only what it gained since its last verify),
    and position j's counts are those plus j tokens. Counting every position's whole history anew (one np.unique
    over draft + 1 copies of each) cost ~26 ms a step at 16 streams of 3k-token histories, more than the
    step's device time."""

    def __init__(self, shares: HistoryCounts):
        self.shares = shares
        self._at: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}  # (seq_id, history length) -> counts

    def add(self, seq_id: str, history, draft, V: int) -> None:
        """Count a share whose history is `history` and whose drafted tokens are `draft`."""
        ids, cnt = self.shares.get(seq_id, history, V)
        ids, cnt = ids.copy(), cnt.copy()  # (views into the kept buffers)
        n = len(history)
        self._at[(seq_id, n)] = (ids, cnt)
        for j, t in enumerate(draft, 1):
            if 0 <= t < V:
                i = int(np.searchsorted(ids, t))
                if i < ids.size and ids[i] == t:
                    cnt = cnt.copy()
                    cnt[i] += 1
                else:
                    ids, cnt = np.insert(ids, i, t), np.insert(cnt, i, 1)
            self._at[(seq_id, n + j)] = (ids, cnt)

    def get(self, seq_id: str, history, V: int) -> tuple[np.ndarray, np.ndarray]:
        """The counts of a drafted position of a share `add` was told of (by its history's length)."""
        return self._at[(seq_id, len(history))]
