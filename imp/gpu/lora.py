"""LoRA adapters on the device: the executor's adapter table as stacked factors per
(layer, matrix), and the per-row delta added after a projection.

Slot 0 is the base model (zero factors), slot s+1 the table's slot s. For a step whose
rows carry slots idx [N]:
    t = A[idx] x      [N, r]        A: [S+1, r, in], the table's A factors
    y += B[idx] t     [N, out]      B: [S+1, out, r], alpha/r already folded in
Both are products over gathered factors, so rows of different adapters (and base rows)
share one step. They run as `imp.kernels.cuda.gathered_mv` (a thread per output, the sum in
order), not bmm nor a torch sum: cuBLAS picks its algorithm by the batch count and torch's
reduction its split by the shape, so either would make a row's numbers depend on how many
rows share its step. Ranks below the largest are zero-padded. Such steps run
eagerly (no CUDA graph) and unfused, so the delta lands before RoPE and the KV write.
"""

from __future__ import annotations

import torch

from imp.kernels.cuda.gathered_mv import gathered_mv


class DeviceLoras:
    def __init__(self, device: torch.device):
        self.device = device
        self._key = None
        self.factors: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def sync(self, table, cfg) -> None:
        """Upload the table's adapters when it changed since the last step."""
        key = (table.version, len(table.adapters))
        if key == self._key:
            return
        ids = sorted(table.adapters)
        r = max((table.adapters[i].rank for i in ids), default=1)
        H, Hkv, D, d, ff = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.d_ff
        shapes = {0: (H * D, d), 1: (Hkv * D, d), 2: (Hkv * D, d), 3: (d, H * D), 4: (ff, d), 5: (ff, d), 6: (d, ff)}
        self.factors = {}
        for layer in range(cfg.n_layers):
            for m, (out, inp) in shapes.items():
                if not any((layer, m) in table.adapters[i].factors for i in ids):
                    continue
                a = torch.zeros(len(ids) + 1, r, inp)
                b = torch.zeros(len(ids) + 1, out, r)
                for s, i in enumerate(ids, start=1):
                    ad = table.adapters[i]
                    f = ad.factors.get((layer, m))
                    if f is not None:
                        a[s, : ad.rank] = torch.from_numpy(f[0])
                        b[s, :, : ad.rank] = torch.from_numpy(f[1]) * ad.scale
                self.factors[(layer, m)] = (a.to(self.device), b.to(self.device))
        self.slot = {i: s for s, i in enumerate(ids, start=1)}
        self._key = key

    def rows(self, seqs, n_rows: int) -> torch.Tensor:
        """int64 [N] device slots of the step's token rows (each seq's tokens in turn)."""
        out = []
        for w in seqs:
            lid = w.params.lora if w.params is not None else 0
            if lid and lid not in self.slot:
                raise KeyError(f"{w.seq_id}: LoRA adapter {lid} is not loaded on this executor")
            out.extend([self.slot[lid] if lid else 0] * len(w.token_ids))
        assert len(out) == n_rows, (len(out), n_rows)
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, m: int, idx: torch.Tensor) -> None:
        """y [N, out] += B[idx] (A[idx] x) for matrix m of `layer` (nothing if no adapter has it)."""
        f = self.factors.get((layer, m))
        if f is None:
            return
        a, b = f
        t = gathered_mv(a, idx, x.float())  # [N, r]
        gathered_mv(b, idx, t, y, accumulate=True)  # [N, out]
