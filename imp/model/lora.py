"""The adapters one executor holds, packed for the fused CPU forward.

Each adapter gets a slot; a step's rows carry their sequence's slot (-1: the base
model), so requests of different adapters share one step (imp.kernels.cpu.fused_forward's
`_lora_add`). Packed layout, S slots, L layers, the seven matrices:
    lo     int64 [S, L, 7, 3]  (offset of A in la, offset of B in lb, rank; 0 = absent)
    la     float32 [*]         A factors, row-major [r, in]
    lb     float32 [*]         B factors, row-major [out, r]
    scale  float32 [S]         alpha / r
Adapters live here, not in the runner, so a suspend that drops the runner keeps them.
"""

from __future__ import annotations

import numpy as np

from imp.formats.lora import Adapter


class LoraTable:
    def __init__(self):
        self.adapters: dict[int, Adapter] = {}  # adapter id -> its factors (ids from admission order)
        self._packed = None
        self._n_layers = 0
        self.version = 0  # bumped by every change (the GPU copy re-uploads on it)

    def add(self, lora_id: int, adapter: Adapter, n_layers: int) -> None:
        self.adapters[lora_id] = adapter
        self._n_layers = n_layers
        self._packed = None
        self.version += 1

    def remove(self, lora_id: int) -> bool:
        self._packed = None
        self.version += 1
        return self.adapters.pop(lora_id, None) is not None

    def __bool__(self) -> bool:
        return bool(self.adapters)

    def packed(self):
        """(lo, la, lb, scale, slot of each adapter id)"""
        if self._packed is None:
            ids = sorted(self.adapters)
            L = self._n_layers
            lo = np.zeros((len(ids), L, 7, 3), np.int64)
            la_parts, lb_parts, na, nb = [], [], 0, 0
            for s, i in enumerate(ids):
                for (layer, m), (a, b) in sorted(self.adapters[i].factors.items()):
                    lo[s, layer, m] = (na, nb, a.shape[0])
                    la_parts.append(a.reshape(-1))
                    lb_parts.append(b.reshape(-1))
                    na += a.size
                    nb += b.size
            la = np.concatenate(la_parts) if la_parts else np.zeros(0, np.float32)
            lb = np.concatenate(lb_parts) if lb_parts else np.zeros(0, np.float32)
            scale = np.array([self.adapters[i].scale for i in ids], np.float32)
            self._packed = (lo, la, lb, scale, {i: s for s, i in enumerate(ids)})
        return self._packed

    def row_slots(self, seqs) -> np.ndarray:
        """int64 [N]: each token row's slot, rows in the step's order (each seq's tokens in turn)."""
        slot_of = self.packed()[4]
        out = []
        for w in seqs:
            lid = w.params.lora if w.params is not None else 0
            s = slot_of.get(lid, -1) if lid else -1
            if lid and s < 0:
                raise KeyError(f"{w.seq_id}: LoRA adapter {lid} is not loaded on this executor")
            out.extend([s] * len(w.token_ids))
        return np.array(out, np.int64)


EMPTY = (np.zeros((0, 1, 7, 3), np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32),
         np.zeros(0, np.float32))
