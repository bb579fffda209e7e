"""Quantized GEMV on int8 activations: y[b] = W @ x[b] with dp4a dot products (llama.cpp's mmvq).

Why: the fp32-activation GEMV (`imp.kernels.cuda.gemv_fp32_act`) reads 8 x values (32 bytes) per 8
weights through L1 and spends 8 FMAs and a dequantization on them; at 4.5 bits a weight
that is 7x the weight bytes and the tuner preferred cuBLAS over an fp16 copy (3.3x the
bytes) for every Q4_K shape. Here x is first quantized per block of 32 as llama.cpp's
Q8_1 (`imp.kernels.cuda.quantize_act_int8`: alone, or fused into the norm / activation that produces x;
the CPU kernels do the same with the same rounding), so a lane reads 1 byte of x per
weight and one `dp4a` does 4 multiply-adds in exact int32; the float work is one scale
product per 16-32 weights.

    xq [B, K] int8, xds [B, K/32] float2 (xd = max|x| / 127, xs = xd * sum(xq))
    block contribution = d_w * xd * isum (+ m_w * xs for the formats with a min)

Kernel shape: 4 warps a block, each warp R output rows (R = 1, 2, 4: each x load then feeds
R rows and R weight loads are in flight per lane) or the block's 4 warps splitting the K of R
rows (`split`: 4x the warps for the short matrices, O and down, whose few rows leave the SMs
with too few loads in flight), lanes stride over a row's 16-byte chunks
(one Q4_0/Q4_1/Q8_0 block, half of a Q4_K sub-block pair, 32 elements of Q6_K). A launch
handles a tile of BT <= 8 activation rows; tiles of one row range are adjacent block ids,
so at batch > 8 the re-reads of the weights come from L2, not DRAM. Per output row the
sum runs in chunk order per lane, then one warp reduction, every step an explicit fmaf /
__fmul_rn (no contraction left to the compiler, which chose differently per template
instance): the same bits for any batch size (batch invariance) and any R; a split adds its
warps' sums in warp order (other bits than no split, the same every launch).

Formats: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K in `imp.kernels.cuda.quant_weight`'s repacked layout.
`reference_quantize` / `reference` are the torch references the tests compare against.
"""

from __future__ import annotations

import torch

from imp.kernels.cuda import runtime as cu
from imp.kernels.cuda.quantize_act_int8 import Q8Act, dequant as dequant_act, quantize, reference as reference_quantize
from imp.kernels.cuda.quant_weight import Q4K_SCALE_MIN_SRC, QWeight, TILES, check_parts, out_for, reference as dequant_reference, tile_for

WARPS = 4
FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
ROWS = (1, 2, 4)  # output rows a warp (KS = 1) or a block (KS = WARPS)
SPLITS = (1, WARPS)  # warps that split one row group's K
# the tuner's names (imp.gpu.linear): q8r<R> a warp per R rows, q8s<R> a block's 4 warps per R rows
VARIANTS = {**{f"q8r{r}": (r, 1) for r in ROWS}, **{f"q8s{r}": (r, WARPS) for r in ROWS}}

SRC = Q4K_SCALE_MIN_SRC + r"""
#define WARPS 4
typedef signed char i8;
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d; asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}
// bytes in [0, 63] minus 32 each, as signed bytes (no borrow crosses a byte: each is >= 96 after the or)
__device__ __forceinline__ int sub32(unsigned v) { return (int)(((v | 0x80808080u) - 0x20202020u) ^ 0x80808080u); }

// KS warps split one row group's chunks (KS = 1: a warp per group of R rows; KS = WARPS: the block's four
// warps share R rows, 4x the loads in flight for short matrices). Only 1 and WARPS: with one group a block
// the early return below is taken by the whole block, never by part of it before the __syncthreads.
#define PROLOGUE                                                                   \
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;                    \
    const int tiles = (B + BT - 1) / BT;                                           \
    const int tile = blockIdx.x % tiles, rblk = blockIdx.x / tiles;                \
    const int row0 = (rblk * (WARPS / KS) + warp / KS) * R;                        \
    if (row0 >= N) return;                                                         \
    const int c0 = (warp % KS) * 32 + lane, cstep = 32 * KS;                       \
    const int b0 = tile * BT, nact = min(BT, B - b0);                              \
    const int nx = K >> 5;                                                         \
    int rw[R];                                                                     \
    _Pragma("unroll") for (int r = 0; r < R; ++r) rw[r] = min(row0 + r, N - 1);    \
    float acc[R][BT];                                                              \
    _Pragma("unroll") for (int r = 0; r < R; ++r)                                  \
    _Pragma("unroll") for (int b = 0; b < BT; ++b) acc[r][b] = 0.f;

// rows past N were clamped to N - 1 (no branch around the loads); only real rows are written.
// KS > 1: the KS warps' sums added in warp order (fixed: the same bits every launch)
#define EPILOGUE                                                                   \
    __shared__ float red_[WARPS][R][BT];                                           \
    _Pragma("unroll") for (int r = 0; r < R; ++r)                                  \
    _Pragma("unroll") for (int b = 0; b < BT; ++b) {                               \
        const float v = warp_sum(acc[r][b]);                                       \
        if (KS == 1) {                                                             \
            if (lane == 0 && b < nact && row0 + r < N) y[(size_t)(b0 + b) * ldy + row0 + r] = v; \
        } else if (lane == 0) red_[warp][r][b] = v;                                \
    }                                                                              \
    if (KS > 1) {                                                                  \
        __syncthreads();                                                           \
        if (threadIdx.x < R * BT) {                                                \
            const int r = threadIdx.x / BT, b = threadIdx.x % BT;                  \
            float v = red_[0][r][b];                                               \
            _Pragma("unroll") for (int k = 1; k < KS; ++k) v += red_[k][r][b];     \
            if (b < nact && row0 + r < N) y[(size_t)(b0 + b) * ldy + row0 + r] = v; \
        }                                                                          \
    }

// activation row b of the tile: tile rows past the batch re-read the last row (no branch)
#define XROW(b) (b0 + min(b, nact - 1))
#define ARGS const i8* __restrict__ xq, const float2* __restrict__ xds, float* __restrict__ y, int ldy, int N, int K, int B

__device__ __forceinline__ int dot16_lo(const uint4& q, const uint4& x) {  // low nibbles . 16 int8
    int s = dp4a(q.x & 0x0f0f0f0f, x.x, 0);
    s = dp4a(q.y & 0x0f0f0f0f, x.y, s);
    s = dp4a(q.z & 0x0f0f0f0f, x.z, s);
    return dp4a(q.w & 0x0f0f0f0f, x.w, s);
}
__device__ __forceinline__ int dot16_hi(const uint4& q, const uint4& x) {  // high nibbles . 16 int8
    int s = dp4a((q.x >> 4) & 0x0f0f0f0f, x.x, 0);
    s = dp4a((q.y >> 4) & 0x0f0f0f0f, x.y, s);
    s = dp4a((q.z >> 4) & 0x0f0f0f0f, x.z, s);
    return dp4a((q.w >> 4) & 0x0f0f0f0f, x.w, s);
}
__device__ __forceinline__ int dot16(const uint4& q, const uint4& x) {
    int s = dp4a((int)q.x, x.x, 0);
    s = dp4a((int)q.y, x.y, s);
    s = dp4a((int)q.z, x.z, s);
    return dp4a((int)q.w, x.w, s);
}

// Q4_0 / Q4_1: chunk = one block of 32 (qs 16 bytes: low nibbles elements 0..15, high 16..31)
template <int BT, int R, int KS, bool MIN>
__device__ __forceinline__ void q4_01(const u8* __restrict__ qs, const u16* __restrict__ d, const u16* __restrict__ m, ARGS) {
    PROLOGUE
    #pragma unroll 2
    for (int c = c0; c < nx; c += cstep) {
        uint4 q[R]; float dw[R], mw[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            q[r] = __ldg((const uint4*)(qs + ((size_t)rw[r] * nx + c) * 16));
            dw[r] = h2f(__ldg(d + (size_t)rw[r] * nx + c));
            mw[r] = MIN ? h2f(__ldg(m + (size_t)rw[r] * nx + c)) : -8.f * dw[r];
        }
        #pragma unroll
        for (int b = 0; b < BT; ++b) {
            const i8* xb = xq + (size_t)XROW(b) * K + c * 32;
            const uint4 xl = __ldg((const uint4*)xb), xh = __ldg((const uint4*)(xb + 16));
            const float2 ds = __ldg(xds + (size_t)XROW(b) * nx + c);
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const int s = dot16_lo(q[r], xl) + dot16_hi(q[r], xh);
                acc[r][b] = fmaf(__fmul_rn(dw[r], ds.x), (float)s, fmaf(mw[r], ds.y, acc[r][b]));
            }
        }
    }
    EPILOGUE
}
template <int BT, int R, int KS>
__global__ void __launch_bounds__(128) q8_q4_0(const u8* __restrict__ qs, const u16* __restrict__ d, ARGS) {
    q4_01<BT, R, KS, false>(qs, d, d, xq, xds, y, ldy, N, K, B);
}
template <int BT, int R, int KS>
__global__ void __launch_bounds__(128) q8_q4_1(const u8* __restrict__ qs, const u16* __restrict__ d, const u16* __restrict__ m, ARGS) {
    q4_01<BT, R, KS, true>(qs, d, m, xq, xds, y, ldy, N, K, B);
}

// Q8_0: chunk = one block of 32 (two 16-byte loads)
template <int BT, int R, int KS>
__global__ void __launch_bounds__(128) q8_q8_0(const u8* __restrict__ qs, const u16* __restrict__ d, ARGS) {
    PROLOGUE
    #pragma unroll 2
    for (int c = c0; c < nx; c += cstep) {
        uint4 q0[R], q1[R]; float dw[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            const u8* p = qs + ((size_t)rw[r] * nx + c) * 32;
            q0[r] = __ldg((const uint4*)p); q1[r] = __ldg((const uint4*)(p + 16));
            dw[r] = h2f(__ldg(d + (size_t)rw[r] * nx + c));
        }
        #pragma unroll
        for (int b = 0; b < BT; ++b) {
            const i8* xb = xq + (size_t)XROW(b) * K + c * 32;
            const uint4 xl = __ldg((const uint4*)xb), xh = __ldg((const uint4*)(xb + 16));
            const float xd = __ldg(&xds[(size_t)XROW(b) * nx + c].x);
            #pragma unroll
            for (int r = 0; r < R; ++r)
                acc[r][b] = fmaf(__fmul_rn(dw[r], xd), (float)(dot16(q0[r], xl) + dot16(q1[r], xh)), acc[r][b]);
        }
    }
    EPILOGUE
}

// Q4_K super-block (144 bytes): d, dmin (f16), scales[12] (6-bit scale and min per sub-block of 32),
// qs[128]: pair p's 32 bytes hold sub-block 2p in the low nibbles and 2p+1 in the high ones.
// Chunk j = 2p + h (8 a super-block): qs bytes 32p + 16h .. +16 = elements 16h.. of both sub-blocks.
template <int BT, int R, int KS>
__global__ void __launch_bounds__(128) q8_q4_k(const u8* __restrict__ blocks, ARGS) {
    PROLOGUE
    const int ns = K >> 8, nc = ns * 8;
    #pragma unroll 2
    for (int c = c0; c < nc; c += cstep) {
        const int sb = c >> 3, p = (c >> 1) & 3, h = c & 1;
        uint4 q[R]; float s0[R], s1[R], m0[R], m1[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            const u8* blk = blocks + ((size_t)rw[r] * ns + sb) * 144;
            const uint4 hd = __ldg((const uint4*)blk);
            q[r] = __ldg((const uint4*)(blk + 16 + 32 * p + 16 * h));
            const float dd = h2f((u16)(hd.x & 0xffffu)), dmin = h2f((u16)(hd.x >> 16));
            float a, b, e, f;
            q4k_scale_min(2 * p, hd, a, b); q4k_scale_min(2 * p + 1, hd, e, f);
            s0[r] = dd * a; s1[r] = dd * e;
            m0[r] = h ? 0.f : dmin * b; m1[r] = h ? 0.f : dmin * f;  // the min term once per sub-block
        }
        #pragma unroll
        for (int b = 0; b < BT; ++b) {
            const int xo = sb * 256 + 64 * p + 16 * h;
            const i8* xb = xq + (size_t)XROW(b) * K + xo;
            const uint4 xl = __ldg((const uint4*)xb), xh = __ldg((const uint4*)(xb + 32));
            const float2* dp = xds + (size_t)XROW(b) * nx + sb * 8 + 2 * p;
            const float2 dl = __ldg(dp), dh = __ldg(dp + 1);
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                float a = fmaf(-m0[r], dl.y, acc[r][b]);
                a = fmaf(-m1[r], dh.y, a);
                a = fmaf(__fmul_rn(s0[r], dl.x), (float)dot16_lo(q[r], xl), a);
                acc[r][b] = fmaf(__fmul_rn(s1[r], dh.x), (float)dot16_hi(q[r], xh), a);
            }
        }
    }
    EPILOGUE
}

// Q6_K super-block: body (ql[128], qh[64], scales[16] int8) and d. Chunk (sb, half hf, group g):
// l = 8g .. 8g+8 of the half's 32, four quarters k = 0..3 -> elements 128 hf + 32 k + l.
template <int BT, int R, int KS>
__global__ void __launch_bounds__(128) q8_q6_k(const u8* __restrict__ body, const u16* __restrict__ d, ARGS) {
    PROLOGUE
    const int ns = K >> 8, nc = ns * 8;
    #pragma unroll 2
    for (int c = c0; c < nc; c += cstep) {
        const int sb = c >> 3, hf = (c >> 2) & 1, g = c & 3, l0 = 8 * g;
        int v[R][4][2]; float ds[R][4];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            const u8* blk = body + ((size_t)rw[r] * ns + sb) * 208;
            const uint2 qa = __ldg((const uint2*)(blk + 64 * hf + l0));
            const uint2 qb = __ldg((const uint2*)(blk + 64 * hf + 32 + l0));
            const uint2 qh = __ldg((const uint2*)(blk + 128 + 32 * hf + l0));
            const float dd = h2f(__ldg(d + (size_t)rw[r] * ns + sb));
            const i8* scp = (const i8*)(blk + 192 + 8 * hf + (g >> 1));
            #pragma unroll
            for (int k = 0; k < 4; ++k) ds[r][k] = dd * (float)__ldg(scp + 2 * k);
            const unsigned A[2] = {qa.x, qa.y}, Bq[2] = {qb.x, qb.y}, Hh[2] = {qh.x, qh.y};
            #pragma unroll
            for (int w = 0; w < 2; ++w) {
                v[r][0][w] = sub32((A[w] & 0x0f0f0f0fu) | ((Hh[w] << 4) & 0x30303030u));
                v[r][1][w] = sub32((Bq[w] & 0x0f0f0f0fu) | ((Hh[w] << 2) & 0x30303030u));
                v[r][2][w] = sub32(((A[w] >> 4) & 0x0f0f0f0fu) | (Hh[w] & 0x30303030u));
                v[r][3][w] = sub32(((Bq[w] >> 4) & 0x0f0f0f0fu) | ((Hh[w] >> 2) & 0x30303030u));
            }
        }
        #pragma unroll
        for (int b = 0; b < BT; ++b) {
            const i8* xb = xq + (size_t)XROW(b) * K + sb * 256 + 128 * hf + l0;
            const float2* dp = xds + (size_t)XROW(b) * nx + sb * 8 + 4 * hf;
            #pragma unroll
            for (int k = 0; k < 4; ++k) {
                const uint2 xv = __ldg((const uint2*)(xb + 32 * k));
                const float xd = __ldg(&dp[k].x);
                #pragma unroll
                for (int r = 0; r < R; ++r)
                    acc[r][b] = fmaf(__fmul_rn(ds[r][k], xd),
                                     (float)dp4a(v[r][k][1], (int)xv.y, dp4a(v[r][k][0], (int)xv.x, 0)), acc[r][b]);
            }
        }
    }
    EPILOGUE
}
"""

_KNAME = {"Q4_0": "q8_q4_0", "Q4_1": "q8_q4_1", "Q8_0": "q8_q8_0", "Q4_K": "q8_q4_k", "Q6_K": "q8_q6_k"}
_PARTS = {"Q4_0": ("qs", "d"), "Q4_1": ("qs", "d", "m"), "Q8_0": ("qs", "d"), "Q4_K": ("blocks",), "Q6_K": ("body", "d")}
_NAMES = tuple(f"{k}<{bt}, {r}, {ks}>" for k in _KNAME.values() for bt in TILES for r in ROWS for ks in SPLITS)

__all__ = ["FORMATS", "ROWS", "SPLITS", "VARIANTS", "Q8Act", "quantize", "reference_quantize", "dequant_act",
           "supports", "gemv", "reference"]


def supports(w: QWeight) -> bool:
    return w.fmt in FORMATS


def gemv(w: QWeight, xa: Q8Act, out: torch.Tensor | None = None, rows: int = 1, split: int = 1) -> torch.Tensor:
    """out[B, N] (fp32, may be a column slice of a wider buffer) = dequant(xa) @ W.T; `rows`, `split`:
    output rows a group, warps a group (see VARIANTS)."""
    if w.fmt not in FORMATS:
        raise ValueError(f"no int8-activation GEMV for {w.fmt} (have {FORMATS})")
    if rows not in ROWS or split not in SPLITS:
        raise ValueError(f"rows must be one of {ROWS}, split one of {SPLITS}")
    B, K = xa.shape
    if K != w.cols:
        raise ValueError(f"x has {K} columns, weight {w.cols}")
    out = out_for(w, B, out, xa.xq.device)
    if B == 0:
        return out
    check_parts(w, _PARTS[w.fmt], xa.xq.device)
    bt = tile_for(B)
    fn = cu.function(SRC, f"{_KNAME[w.fmt]}<{bt}, {rows}, {split}>", _NAMES)
    args = tuple(cu.ptr(w.parts[k]) for k in _PARTS[w.fmt]) + (
        cu.ptr(xa.xq), cu.ptr(xa.xds), cu.ptr(out), cu.i32(out.stride(0)), cu.i32(w.rows), cu.i32(K), cu.i32(B))
    rblocks = -(-w.rows // (WARPS // split * rows))
    cu.launch(fn, (rblocks * -(-B // bt),), (32 * WARPS,), args)
    return out


# ------------------------------------------------------------------ references (torch, any device)


def reference(w: QWeight, x: torch.Tensor) -> torch.Tensor:
    """float64 [B, N]: the dequantized weight times the q8-quantized x (what the kernel computes exactly
    up to fp32 rounding of the per-block scale products)."""
    xq, xds = reference_quantize(x)
    return dequant_act(xq, xds) @ dequant_reference(w).double().T
