"""KV write into paged blocks (Numba CUDA): cache[slot[n]] = k[n], v[n].

The cache of one layer is viewed flat as [num_blocks * block_size, Hkv * D];
slot = block * block_size + offset (as `imp.model.llama.make_plan` builds it),
slot < 0 skips the row (padding rows of a captured batch bucket). One thread
per element; the bf16 cache stores round-to-nearest-even of the fp32 input
(bit arithmetic, since Numba has no bf16 type: the tensors travel as int32 /
int16 views). Numba is the simpler tool here: a scatter with no tiling.
"""

from __future__ import annotations

import functools

import numpy as np

import torch

from imp.kernels.cuda import runtime as cu

cuda = None  # numba.cuda, bound on first use
THREADS = 256


@functools.lru_cache(maxsize=None)
def _kernels():

    global cuda  # a module global, so the CUDA simulator can swap it in tests
    cuda = cu.numba_cuda()

    @cuda.jit(device=True, inline=True)
    def to_bf16(bits):
        u = np.int64(bits) & 0xFFFFFFFF
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
        if r >= 0x8000:
            r -= 0x10000
        return np.int16(r)

    @cuda.jit(device=True, inline=True)
    def same(x):
        return x

    def scatter(convert):
        """The scatter, the cache element made by `convert` (a device function, inlined)."""

        @cuda.jit
        def write(k, v, kc, vc, slots):
            idx = cuda.grid(1)
            n_rows, width = k.shape
            if idx >= n_rows * width:
                return
            n = idx // width
            c = idx - n * width
            s = slots[n]
            if s < 0:
                return
            kc[s, c] = convert(k[n, c])
            vc[s, c] = convert(v[n, c])

        return write

    # fp32 cache: the values as they are; bf16: k, v int32 bits of fp32 -> kc, vc int16 bits of bf16
    return scatter(same), scatter(to_bf16)


def kv_write(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [N, W] fp32 (row-strided views are fine); kc, vc [num_slots, W] fp32 or bf16; slots [N] int32."""
    for name, t in (("k", k), ("v", v)):
        cu.check(t, name, torch.float32, 2)
    for name, t in (("kc", kc), ("vc", vc)):
        cu.check(t, name, (torch.float32, torch.bfloat16), 2)
    cu.check(slots, "slots", torch.int32, 1)
    N, W = k.shape
    if tuple(v.shape) != (N, W) or kc.shape[1] != W or vc.shape != kc.shape or kc.dtype != vc.dtype or slots.shape[0] != N:
        raise ValueError("shape mismatch")
    if N == 0:
        return
    write_f32, write_bf16 = _kernels()
    if kc.dtype == torch.float32:
        fn, args = write_f32, (k, v, kc, vc, slots)
    else:
        fn, args = write_bf16, (k.view(torch.int32), v.view(torch.int32), kc.view(torch.int16), vc.view(torch.int16), slots)
    blocks = (N * W + THREADS - 1) // THREADS
    cu.nb_launch(fn, blocks, THREADS, *args)


CUPY_SRC = r"""
extern "C" __global__ void kv_write(const float* __restrict__ k, const float* __restrict__ v, int ldk, int ldv,
                                    void* kc, void* vc, const int* __restrict__ slots, int N, int W, int bf16) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * W) return;
    const int n = (int)(idx / W), c = (int)(idx % W);
    const int s = slots[n];
    if (s < 0) return;
    const float a = k[(size_t)n * ldk + c], b = v[(size_t)n * ldv + c];
    if (bf16) { ((u16*)kc)[(size_t)s * W + c] = f2bf(a); ((u16*)vc)[(size_t)s * W + c] = f2bf(b); }
    else { ((float*)kc)[(size_t)s * W + c] = a; ((float*)vc)[(size_t)s * W + c] = b; }
}
"""


def kv_write_cupy(k, v, kc, vc, slots) -> None:
    """The same scatter as a CuPy kernel (fallback where Numba CUDA cannot compile or be captured)."""
    cu.check(slots, "slots", torch.int32, 1)
    N, W = k.shape
    if not (kc.is_contiguous() and vc.is_contiguous()) or kc.shape[1] != W:
        raise ValueError("caches must be contiguous [num_slots, W]")
    if N == 0:
        return
    cu.launch(cu.function(CUPY_SRC, "kv_write"), ((N * W + 255) // 256,), (256,), (
        cu.ptr(k), cu.ptr(v), cu.i32(k.stride(0)), cu.i32(v.stride(0)), cu.ptr(kc), cu.ptr(vc), cu.ptr(slots),
        cu.i32(N), cu.i32(W), cu.i32(1 if kc.dtype == torch.bfloat16 else 0)))


def kv_write_torch(k, v, kc, vc, slots) -> None:
    """Same effect with torch ops (fallback where Numba CUDA is unavailable)."""
    keep = slots >= 0
    idx = slots.long()
    if not bool(keep.all()):
        idx, k, v = idx[keep], k[keep], v[keep]
    kc.index_copy_(0, idx, k.to(kc.dtype))
    vc.index_copy_(0, idx, v.to(vc.dtype))


def reference(k, v, kc, vc, slots):
    """New (kc, vc) copies with the rows written."""
    kc, vc = kc.clone(), vc.clone()
    kv_write_torch(k, v, kc, vc, slots)
    return kc, vc
