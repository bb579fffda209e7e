"""Tier loads into the paged pool, a chunk at a time: blocks read from their files into one pinned buffer go
up in one contiguous copy, then this kernel puts each where the allocator placed it.

Why: a block is L runs (one a layer) in each of K and V, so a block put straight from host memory was two
2-D DMAs and an event from Python; a restart reading 1,249 blocks of the 8B shape back spent 0.33-0.53 ms a
block queuing them (0.4-0.7 s, the restart's bound; issue 35). A chunk of up to 64 blocks is now one copy,
one small table copy and one launch.

Shapes: src [n_slots, 2 (K, V), L, row] bytes (the files' payloads side by side), k / v [L, NB, row] bytes
(the pool: row = one block's positions of one layer), pairs [n, 2] int32 (slot, block). Grid (n, 2L), 256
threads copying 16 bytes each a turn: row must be a multiple of 16 (every bs=16 pool's is).
"""

from __future__ import annotations

import numpy as np
import torch

from imp.kernels.cuda import runtime as cu

SRC = r"""
extern "C" __global__ void kv_scatter(const uint4* __restrict__ src, uint4* __restrict__ k, uint4* __restrict__ v,
                                      const int* __restrict__ pairs, int L, long long row, long long NB) {
    const int j = blockIdx.x, kv = blockIdx.y / L, l = blockIdx.y % L;
    const int slot = pairs[2 * j], b = pairs[2 * j + 1];
    const uint4* s = src + ((long long)(slot * 2 + kv) * L + l) * row;
    uint4* d = (kv ? v : k) + ((long long)l * NB + b) * row;
    for (long long i = threadIdx.x; i < row; i += blockDim.x) d[i] = s[i];
}
"""


def supports(k: torch.Tensor, v: torch.Tensor) -> bool:
    row = k[0, 0].numel() * k.element_size()
    return k.is_contiguous() and v.is_contiguous() and k.shape == v.shape and row % 16 == 0


def scatter(src: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pairs: torch.Tensor, n: int) -> None:
    """Block pairs[j, 0] of src (uint8 on the device) into pool block pairs[j, 1] of k and v, j < n."""
    if n == 0:
        return
    L, NB = k.shape[0], k.shape[1]
    row = k[0, 0].numel() * k.element_size() // 16
    fn = cu.function(SRC, "kv_scatter")
    cu.launch(fn, (n, 2 * L), (256,), (cu.ptr(src), cu.ptr(k), cu.ptr(v), cu.ptr(pairs), cu.i32(L),
                                       np.int64(row), np.int64(NB)))
