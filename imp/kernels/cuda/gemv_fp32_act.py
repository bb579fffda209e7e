"""Quantized GEMV (decode matmul) y[b] = W @ x[b], dequantizing in registers, every format
of `imp.kernels.cuda.quant_weight` (which also holds the layouts and the references).

Kernel shape: one warp per output row, 4 warps a block; lanes stride over the
row's chunks (32 elements of a block, 64 of a Q4_K sub-block pair, 8 of bf16)
so a warp reads one contiguous stretch per iteration. Activations x are fp32
[B, K] (row stride ldx) read through the read-only cache; a launch handles a
tile of BT <= 8 activation rows (grid.y tiles larger batches). Accumulation in
fp32, one warp reduction per activation row at the end.

Roofline (decode, batch 1): bytes = weight bytes (bits/8 * rows * cols) +
x; arithmetic is negligible, so time >= bytes / copy-rate.

The BF16 family with two rows a warp and fused epilogues is `imp.kernels.cuda.gemv_bf16_fused`;
its names are re-exported here, the one GEMV entry point the GPU linear layer uses.
"""

from __future__ import annotations

import torch

from imp.kernels.cuda import runtime as cu
from imp.kernels.cuda.quant_weight import (BITS, BLOCK, FORMATS, Q4K_SCALE_MIN_SRC, TILES, QWeight, cat_rows,
                                           check_parts, check_x, gemv_reference, out_for, reference, repack, tile_for)

WARPS = 4

# ------------------------------------------------------------------ CUDA

SRC = Q4K_SCALE_MIN_SRC + r"""
#define WARPS 4
__device__ __forceinline__ void unpack_nib(unsigned a, unsigned b, float (&lo)[8], float (&hi)[8]) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned ba = (a >> (8 * i)) & 0xffu, bb = (b >> (8 * i)) & 0xffu;
        lo[i] = (float)(ba & 15u); hi[i] = (float)(ba >> 4);
        lo[4 + i] = (float)(bb & 15u); hi[4 + i] = (float)(bb >> 4);
    }
}
__device__ __forceinline__ void unpack_i8(unsigned a, unsigned b, float s, float (&w)[8]) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[i] = s * (float)(signed char)((a >> (8 * i)) & 0xffu);
        w[4 + i] = s * (float)(signed char)((b >> (8 * i)) & 0xffu);
    }
}
template <int BT>
__device__ __forceinline__ void fma8(float (&acc)[BT], const float* __restrict__ x, int ldx, int nact, int col, const float (&w)[8]) {
    #pragma unroll
    for (int b = 0; b < BT; ++b) {
        if (b < nact) {
            const float4 a = __ldg((const float4*)(x + (size_t)b * ldx + col));
            const float4 c = __ldg((const float4*)(x + (size_t)b * ldx + col + 4));
            float s = acc[b];
            s = fmaf(w[0], a.x, s); s = fmaf(w[1], a.y, s); s = fmaf(w[2], a.z, s); s = fmaf(w[3], a.w, s);
            s = fmaf(w[4], c.x, s); s = fmaf(w[5], c.y, s); s = fmaf(w[6], c.z, s); s = fmaf(w[7], c.w, s);
            acc[b] = s;
        }
    }
}

// A 16-byte chunk of nibbles: bytes 0-7 (q.x, q.y) give columns col.. (low nibbles, weight wl(nibble)) and
// col + hstep.. (high, wh(nibble)), bytes 8-15 the same 8 columns on; four fma8 in that order.
template <int BT, typename WL, typename WH>
__device__ __forceinline__ void fma_nib16(float (&acc)[BT], const float* __restrict__ x, int ldx, int nact, int col,
                                          int hstep, const uint4 q, WL wl, WH wh) {
    float lo[8], hi[8], w[8];
    unpack_nib(q.x, q.y, lo, hi);
    #pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = wl(lo[i]);
    fma8<BT>(acc, x, ldx, nact, col, w);
    #pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = wh(hi[i]);
    fma8<BT>(acc, x, ldx, nact, col + hstep, w);
    unpack_nib(q.z, q.w, lo, hi);
    #pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = wl(lo[i]);
    fma8<BT>(acc, x, ldx, nact, col + 8, w);
    #pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = wh(hi[i]);
    fma8<BT>(acc, x, ldx, nact, col + hstep + 8, w);
}

#define PROLOGUE                                                        \
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;         \
    const int row = blockIdx.x * WARPS + warp;                          \
    if (row >= N) return;                                               \
    const int b0 = blockIdx.y * BT;                                     \
    const int nact = min(BT, B - b0);                                   \
    x += (size_t)b0 * ldx;                                              \
    y += (size_t)b0 * ldy;                                              \
    float acc[BT];                                                      \
    _Pragma("unroll") for (int b = 0; b < BT; ++b) acc[b] = 0.f;

#define EPILOGUE                                                        \
    _Pragma("unroll") for (int b = 0; b < BT; ++b) {                    \
        const float v = warp_sum(acc[b]);                               \
        if (lane == 0 && b < nact) y[(size_t)b * ldy + row] = v;        \
    }

#define ARGS const float* __restrict__ x, int ldx, float* __restrict__ y, int ldy, int N, int K, int B

template <int BT>
__global__ void __launch_bounds__(128) gemv_q4_0(const u8* __restrict__ qs, const u16* __restrict__ d, ARGS) {
    PROLOGUE
    const int nb = K >> 5;
    const u8* qr = qs + (size_t)row * nb * 16;
    const u16* dr = d + (size_t)row * nb;
    #pragma unroll 2
    for (int c = lane; c < nb; c += 32) {
        const uint4 q = __ldg((const uint4*)(qr + (size_t)c * 16));
        const float s = h2f(__ldg(dr + c));
        const auto wq = [=](float v) { return s * (v - 8.f); };
        fma_nib16<BT>(acc, x, ldx, nact, c * 32, 16, q, wq, wq);
    }
    EPILOGUE
}

template <int BT>
__global__ void __launch_bounds__(128) gemv_q4_1(const u8* __restrict__ qs, const u16* __restrict__ d, const u16* __restrict__ m, ARGS) {
    PROLOGUE
    const int nb = K >> 5;
    const u8* qr = qs + (size_t)row * nb * 16;
    const u16* dr = d + (size_t)row * nb;
    const u16* mr = m + (size_t)row * nb;
    #pragma unroll 2
    for (int c = lane; c < nb; c += 32) {
        const uint4 q = __ldg((const uint4*)(qr + (size_t)c * 16));
        const float s = h2f(__ldg(dr + c)), mm = h2f(__ldg(mr + c));
        const auto wq = [=](float v) { return s * v + mm; };
        fma_nib16<BT>(acc, x, ldx, nact, c * 32, 16, q, wq, wq);
    }
    EPILOGUE
}

template <int BT>
__global__ void __launch_bounds__(128) gemv_q8_0(const u8* __restrict__ qs, const u16* __restrict__ d, ARGS) {
    PROLOGUE
    const int nb = K >> 5;
    const u8* qr = qs + (size_t)row * nb * 32;
    const u16* dr = d + (size_t)row * nb;
    #pragma unroll 2
    for (int c = lane; c < nb; c += 32) {
        const uint4 q0 = __ldg((const uint4*)(qr + (size_t)c * 32));
        const uint4 q1 = __ldg((const uint4*)(qr + (size_t)c * 32 + 16));
        const float s = h2f(__ldg(dr + c));
        float w[8];
        unpack_i8(q0.x, q0.y, s, w); fma8<BT>(acc, x, ldx, nact, c * 32, w);
        unpack_i8(q0.z, q0.w, s, w); fma8<BT>(acc, x, ldx, nact, c * 32 + 8, w);
        unpack_i8(q1.x, q1.y, s, w); fma8<BT>(acc, x, ldx, nact, c * 32 + 16, w);
        unpack_i8(q1.z, q1.w, s, w); fma8<BT>(acc, x, ldx, nact, c * 32 + 24, w);
    }
    EPILOGUE
}

template <int BT>
__global__ void __launch_bounds__(128) gemv_q4_k(const u8* __restrict__ blocks, ARGS) {
    PROLOGUE
    const int ns = K >> 8;
    const u8* br = blocks + (size_t)row * ns * 144;
    const int nc = ns * 4;  // chunks: (super-block, pair of 32-element sub-blocks)
    #pragma unroll 2
    for (int c = lane; c < nc; c += 32) {
        const int sb = c >> 2, p = c & 3;
        const u8* blk = br + (size_t)sb * 144;
        const uint4 h = __ldg((const uint4*)blk);
        const uint4 qa = __ldg((const uint4*)(blk + 16 + 32 * p));
        const uint4 qb = __ldg((const uint4*)(blk + 32 + 32 * p));
        const float dd = h2f((u16)(h.x & 0xffffu)), dmin = h2f((u16)(h.x >> 16));
        float sc0, m0, sc1, m1;
        q4k_scale_min(2 * p, h, sc0, m0);
        q4k_scale_min(2 * p + 1, h, sc1, m1);
        const float ds0 = dd * sc0, dm0 = dmin * m0, ds1 = dd * sc1, dm1 = dmin * m1;
        const int col = sb * 256 + 64 * p;
        const auto w0 = [=](float v) { return ds0 * v - dm0; };  // sub-block 2p: the low nibbles
        const auto w1 = [=](float v) { return ds1 * v - dm1; };  // 2p + 1: the high ones, 32 columns on
        fma_nib16<BT>(acc, x, ldx, nact, col, 32, qa, w0, w1);
        fma_nib16<BT>(acc, x, ldx, nact, col + 16, 32, qb, w0, w1);
    }
    EPILOGUE
}

template <int BT>
__global__ void __launch_bounds__(128) gemv_q6_k(const u8* __restrict__ body, const u16* __restrict__ d, ARGS) {
    PROLOGUE
    const int ns = K >> 8;
    const u8* br = body + (size_t)row * ns * 208;
    const u16* dr = d + (size_t)row * ns;
    const int nc = ns * 8;  // chunks: (super-block, half h, group g of 8 l's) -> 32 elements
    #pragma unroll 2
    for (int c = lane; c < nc; c += 32) {
        const int sb = c >> 3, hf = (c >> 2) & 1, g = c & 3, l0 = 8 * g;
        const u8* blk = br + (size_t)sb * 208;
        const uint2 qa = __ldg((const uint2*)(blk + 64 * hf + l0));
        const uint2 qb = __ldg((const uint2*)(blk + 64 * hf + 32 + l0));
        const uint2 qh = __ldg((const uint2*)(blk + 128 + 32 * hf + l0));
        const float dd = h2f(__ldg(dr + sb));
        const signed char* scp = (const signed char*)(blk + 192 + 8 * hf + (g >> 1));
        float ds[4];
        #pragma unroll
        for (int k = 0; k < 4; ++k) ds[k] = dd * (float)__ldg(scp + 2 * k);
        const int col = sb * 256 + 128 * hf + l0;
        float w0[8], w1[8], w2[8], w3[8];
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned a = ((i < 4 ? qa.x : qa.y) >> (8 * (i & 3))) & 0xffu;
            const unsigned b = ((i < 4 ? qb.x : qb.y) >> (8 * (i & 3))) & 0xffu;
            const unsigned hh = ((i < 4 ? qh.x : qh.y) >> (8 * (i & 3))) & 0xffu;
            w0[i] = ds[0] * (float)((int)((a & 15u) | ((hh & 3u) << 4)) - 32);
            w1[i] = ds[1] * (float)((int)((b & 15u) | (((hh >> 2) & 3u) << 4)) - 32);
            w2[i] = ds[2] * (float)((int)((a >> 4) | (((hh >> 4) & 3u) << 4)) - 32);
            w3[i] = ds[3] * (float)((int)((b >> 4) | (((hh >> 6) & 3u) << 4)) - 32);
        }
        fma8<BT>(acc, x, ldx, nact, col, w0);
        fma8<BT>(acc, x, ldx, nact, col + 32, w1);
        fma8<BT>(acc, x, ldx, nact, col + 64, w2);
        fma8<BT>(acc, x, ldx, nact, col + 96, w3);
    }
    EPILOGUE
}

template <int BT>
__global__ void __launch_bounds__(128) gemv_bf16(const u16* __restrict__ wt, ARGS) {
    PROLOGUE
    const int nc = K >> 3;
    const u16* wr = wt + (size_t)row * K;
    #pragma unroll 4
    for (int c = lane; c < nc; c += 32) {
        const uint4 q = __ldg((const uint4*)(wr + (size_t)c * 8));
        float w[8];
        w[0] = __uint_as_float(q.x << 16); w[1] = __uint_as_float(q.x & 0xffff0000u);
        w[2] = __uint_as_float(q.y << 16); w[3] = __uint_as_float(q.y & 0xffff0000u);
        w[4] = __uint_as_float(q.z << 16); w[5] = __uint_as_float(q.z & 0xffff0000u);
        w[6] = __uint_as_float(q.w << 16); w[7] = __uint_as_float(q.w & 0xffff0000u);
        fma8<BT>(acc, x, ldx, nact, c * 8, w);
    }
    EPILOGUE
}
"""

_KNAME = {"Q4_0": "gemv_q4_0", "Q4_1": "gemv_q4_1", "Q8_0": "gemv_q8_0", "Q4_K": "gemv_q4_k", "Q6_K": "gemv_q6_k", "BF16": "gemv_bf16"}
_PARTS = {"Q4_0": ("qs", "d"), "Q4_1": ("qs", "d", "m"), "Q8_0": ("qs", "d"), "Q4_K": ("blocks",), "Q6_K": ("body", "d"), "BF16": ("w",)}
_NAMES = tuple(f"{k}<{bt}>" for k in _KNAME.values() for bt in TILES)


def gemv(w: QWeight, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[B, N] (fp32, may be a column slice of a wider buffer) = x[B, K] @ W.T."""
    B, K = check_x(w, x)
    out = out_for(w, B, out, x.device)
    if B == 0:
        return out
    check_parts(w, _PARTS[w.fmt], x.device)
    bt = tile_for(B)
    fn = cu.function(SRC, f"{_KNAME[w.fmt]}<{bt}>", _NAMES)
    args = tuple(cu.ptr(w.parts[k]) for k in _PARTS[w.fmt]) + (
        cu.ptr(x), cu.i32(x.stride(0)), cu.ptr(out), cu.i32(out.stride(0)), cu.i32(w.rows), cu.i32(K), cu.i32(B)
    )
    grid = ((w.rows + WARPS - 1) // WARPS, (B + bt - 1) // bt)
    cu.launch(fn, grid, (32 * WARPS,), args)
    return out



from imp.kernels.cuda.gemv_bf16_fused import XACTS, XMODES, XVARIANTS, gemv_bf16x, x_ok  # noqa: E402

__all__ = ["BITS", "BLOCK", "FORMATS", "TILES", "WARPS", "QWeight", "cat_rows", "gemv", "gemv_reference", "reference",
           "repack", "tile_for", "XACTS", "XMODES", "XVARIANTS", "gemv_bf16x", "x_ok"]
