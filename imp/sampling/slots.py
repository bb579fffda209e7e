"""Sequence ids as small ints, for state kept in arrays indexed by sequence (the GPU runner's columns:
`imp.sampling.rowparams`, `imp.gpu.tables`). A slot is a sequence's from its first `assign` until `forget`, then
reused; when every slot is taken the capacity doubles and the owner grows its arrays to `cap`. Pure."""

from __future__ import annotations


class Slots:
    def __init__(self, cap: int):
        self.of: dict[str, int] = {}
        self.cap = cap
        self._free = list(range(cap - 1, -1, -1))  # popped from the end: the lowest slot first

    def assign(self, sid: str) -> int:
        j = self.of.get(sid)
        if j is None:
            if not self._free:
                self._free = list(range(2 * self.cap - 1, self.cap - 1, -1))
                self.cap *= 2
            j = self.of[sid] = self._free.pop()
        return j

    def forget(self, seq_ids) -> list[int]:
        """The slots the sequences held, freed."""
        out = []
        for s in seq_ids:
            j = self.of.pop(s, None)
            if j is not None:
                self._free.append(j)
                out.append(j)
        return out

    def __len__(self) -> int:
        return len(self.of)
