"""Grammar token masks applied to logits in place: disallowed tokens -> -inf.

The constraint layer (imp/constrain) computes, per constrained sequence, a
bitmap of the tokens its grammar allows next: int32 words, 32 tokens per
word, token t allowed iff bit (t % 32) of word (t // 32) is set (llguidance's
layout). This kernel applies k such rows to the logits:

    for i < k, r = rows[i] (or i without rows), 0 <= r < R, t < V:
        if not bit(bitmask[i], t): logits[r, t] = -inf

so a batch with unconstrained neighbours passes only its constrained rows
(rows[i] < 0 skips an entry: a CUDA graph can hold one launch over a fixed
k while the host marks which entries are live, as fill_pending_tokens.py does).

One thread per token: the 32 lanes of a warp read the same mask word (one
broadcast load) and store only the masked logits (coalesced). Roofline is
the masked stores, k * V * 4 bytes at worst: ~2 us at k = 32, V = 49k on an
H200; launch-bound. It reads nothing from the host and launches on torch's
current stream, so it is CUDA-graph capturable once the bitmask (copied
from the host each step) and rows live in fixed device buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from imp.kernels.cuda import runtime as cu

THREADS = 256

SRC = r"""
extern "C" __global__ void token_mask(float* __restrict__ logits, long long ld, int n_rows, int V,
                                      const int* __restrict__ mask, long long ldm,
                                      const int* __restrict__ rows) {
    const int i = blockIdx.y;                            // bitmask row
    const int r = rows ? rows[i] : i;                    // logits row it applies to
    if (r < 0 || r >= n_rows) return;                    // skipped entry / never write out of bounds
    const int t = blockIdx.x * blockDim.x + threadIdx.x; // token id
    if (t >= V) return;
    const unsigned w = (unsigned)__ldg(mask + (size_t)i * ldm + (t >> 5));
    if (!((w >> (t & 31)) & 1u)) logits[(size_t)r * ld + t] = NEG_INF;
}
"""


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError("logits [R, V] and bitmask [k, ceil(V/32)] must be 2-D")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"bitmask has {bitmask.shape[1]} words per row, V={logits.shape[1]} needs "
                         f"{(logits.shape[1] + 31) // 32}")
    if rows is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows, logits {logits.shape[0]} (pass rows=)")
    elif rows.dim() != 1 or rows.shape[0] != bitmask.shape[0]:
        raise ValueError(f"rows must be 1-D with one entry per bitmask row ({bitmask.shape[0]})")


def apply_token_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place on logits [R, V] fp32 (CUDA, unit stride in V); bitmask [k, >= ceil(V/32)] int32
    on the same device; rows [k] int32 (logits row of each bitmask row, < 0 = skip) or None
    (k == R, row i -> row i)."""
    cu.check(logits, "logits", torch.float32, 2)
    cu.check(bitmask, "bitmask", torch.int32, 2)
    if rows is not None:
        cu.check(rows, "rows", torch.int32, 1)
    _check(logits, bitmask, rows)
    if bitmask.device != logits.device or (rows is not None and rows.device != logits.device):
        raise ValueError("logits, bitmask and rows must be on one device")
    k, (R, V) = bitmask.shape[0], logits.shape
    if k == 0 or V == 0 or R == 0:
        return
    if k > 65535:
        raise ValueError("at most 65535 bitmask rows per launch (grid y)")
    fn = cu.function(SRC, "token_mask")
    cu.launch(fn, ((V + THREADS - 1) // THREADS, k), (THREADS,), (
        cu.ptr(logits), np.int64(logits.stride(0)), cu.i32(R), cu.i32(V),
        cu.ptr(bitmask), np.int64(bitmask.stride(0)), cu.ptr(rows)))


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The masked logits as a new tensor, in plain torch (any device)."""
    _check(logits, bitmask, rows)
    out = logits.clone()
    V = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :V].bool()
    targets = range(bitmask.shape[0]) if rows is None else rows.tolist()
    for i, r in enumerate(targets):
        if 0 <= r < logits.shape[0]:
            out[r] = out[r].masked_fill(~allowed[i].to(out.device), float("-inf"))
    return out
