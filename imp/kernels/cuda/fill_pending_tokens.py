"""Pipelined decode: fill in the tokens the previous step sampled, on the device.

When the scheduler plans step N+1 while step N runs, a sequence's input
token for N+1 is the one N samples (`PENDING_TOKEN` in its SeqWork). The
runner keeps N's sampled ids in a device buffer; this kernel copies them into
N+1's token rows before the embedding lookup, so step N+1 is launched
without waiting for N's tokens to reach the host:

    tokens[rows[i]] = sampled[src[i]]   for i < k with rows[i] >= 0

rows[i] < 0 skips the entry, so a CUDA graph can hold one launch over a fixed
k (its batch bucket) while the host marks which rows are pending.
"""

from __future__ import annotations

import torch

from imp.kernels.cuda import runtime as cu

SRC = r"""
extern "C" __global__ void fill_pending(int* __restrict__ tokens, const int* __restrict__ rows,
                                        const int* __restrict__ src, const int* __restrict__ sampled, int k) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= k) return;
    const int r = rows[i];
    if (r >= 0) tokens[r] = sampled[src[i]];
}
"""


def fill_pending(tokens: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, sampled: torch.Tensor, k: int) -> None:
    """In place on tokens [N] int32; rows, src [>= k] int32; sampled [S] int32 (all on one device)."""
    for t, name in ((tokens, "tokens"), (rows, "rows"), (src, "src"), (sampled, "sampled")):
        cu.check(t, name, torch.int32, 1)
    if k <= 0:
        return
    cu.launch(cu.function(SRC, "fill_pending"), ((k + 127) // 128,), (128,),
              (cu.ptr(tokens), cu.ptr(rows), cu.ptr(src), cu.ptr(sampled), cu.i32(k)))


def fill_pending_reference(tokens: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, sampled: torch.Tensor,
                           k: int) -> None:
    """The same in torch (any device)."""
    r, s = rows[:k].long(), src[:k].long()
    keep = r >= 0
    tokens[r[keep]] = sampled[s[keep]]
