"""Quantized GEMM on int8 activations with integer tensor cores (llama.cpp's MMQ): Y = X W^T for batches
of 9..512+ rows, where the GEMV (`qgemv_q8`, dp4a) is compute-bound and the server today falls back to
cuBLAS over a dense fp16 copy of the weights (3.3x the bytes of a Q4_K model kept in memory).

NOT WIRED IN: written in a session without device time; `tests/test_gpu_qmm.py` (GPU lane) checks it
against the float64 reference before the tuner may offer it (imp.gpu.linear).

Same numerics as the GEMV: x is q8 per block of 32 (`imp.kernels.q8act`), each weight block decoded
to int8 with its scale (and min), integer dot products exact, scaled in fp32:

    Y[m, n] = sum_g xd[m, g/2] * s16[n, g] * isum16(m, n, g) + sum_j xs[m, j] * mn32[n, j]

(s16: the weight scale of each 16 elements, the same for both halves of a 32-block except in Q6_K;
mn32: the min term of Q4_1 / Q4_K per 32.) One `mma.sync.m16n8k32.s8` per 32 elements (Q6_K: two,
each with the other half's weights zeroed, for its scale per 16).

Tiling: a block of 4 warps computes 64 tokens x 64 weight rows; per 256 columns of K the tokens'
int8 tile and the weights decoded to int8 go to shared memory (rows padded to 272 bytes: the fragment
loads hit 32 distinct banks), then each warp runs 2 x 4 m16n8 fragments over the 8 blocks of 32.
Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k32", integer types), g = lane / 4, t = lane % 4:
    A 16x32 row: a0 row g, k 4t..4t+3 | a1 row g+8 | a2 row g, k 16+4t.. | a3 row g+8, k 16+4t..
    B 32x8 col:  b0 col g, k 4t..4t+3 | b1 col g, k 16+4t..
    C 16x8 s32:  c0, c1 row g, cols 2t, 2t+1 | c2, c3 row g+8, cols 2t, 2t+1
"""

from __future__ import annotations

import torch

from imp.kernels import _cuda as cu
from imp.kernels.q8act import Q8Act
from imp.kernels.qweight import QWeight, check_parts, out_for

FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
BM, BN, KC = 64, 64, 256

SRC = r"""
typedef signed char i8;
#define BM 64
#define BN 64
#define KC 256
#define XS 272
#define F_Q4_0 0
#define F_Q4_1 1
#define F_Q8_0 2
#define F_Q4_K 3
#define F_Q6_K 4

__device__ __forceinline__ void mma_s8(int (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                       unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned kbyte(const uint4& h, int k) {
    const unsigned wd = k < 4 ? h.y : (k < 8 ? h.z : h.w);
    return (wd >> (8 * (k & 3))) & 0xffu;
}
__device__ __forceinline__ void k4_scmin(int j, const uint4& h, float& sc, float& mn) {
    if (j < 4) {
        sc = (float)(kbyte(h, j) & 63u); mn = (float)(kbyte(h, j + 4) & 63u);
    } else {
        sc = (float)((kbyte(h, j + 4) & 15u) | ((kbyte(h, j - 4) >> 6) << 4));
        mn = (float)((kbyte(h, j + 4) >> 4) | ((kbyte(h, j) >> 6) << 4));
    }
}

// Decode 128 weights of row `row` (columns chunk*256 + 128*half ..) to int8 at dst[0..128), their scales per 16
// into s16[8] and mins per 32 into mn[4]. Blocks past the row's end (K not a multiple of 256) decode to zeros.
template <int FMT>
__device__ __forceinline__ void decode_half(const u8* __restrict__ p0, const u16* __restrict__ p1,
                                            const u16* __restrict__ p2, int row, int K, int chunk, int half,
                                            i8* __restrict__ dst, float* __restrict__ s16, float* __restrict__ mn) {
    if (FMT == F_Q4_K || FMT == F_Q6_K) {
        const int ns = K >> 8, sb = chunk;
        if (FMT == F_Q4_K) {
            const u8* blk = p0 + ((size_t)row * ns + sb) * 144;
            const uint4 h = *(const uint4*)blk;
            const float d = h2f((u16)(h.x & 0xffffu)), dmin = h2f((u16)(h.x >> 16));
            #pragma unroll
            for (int pp = 0; pp < 2; ++pp) {
                const int p = 2 * half + pp;  // the pair: sub-blocks 2p (low nibbles) and 2p+1 (high)
                #pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const uint4 q = *(const uint4*)(blk + 16 + 32 * p + 16 * c);
                    const unsigned w[4] = {q.x, q.y, q.z, q.w};
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        *(unsigned*)(dst + 64 * pp + 16 * c + 4 * i) = w[i] & 0x0f0f0f0fu;
                        *(unsigned*)(dst + 64 * pp + 32 + 16 * c + 4 * i) = (w[i] >> 4) & 0x0f0f0f0fu;
                    }
                }
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float sc, m;
                    k4_scmin(2 * p + e, h, sc, m);
                    s16[4 * pp + 2 * e] = s16[4 * pp + 2 * e + 1] = d * sc;
                    mn[2 * pp + e] = -dmin * m;
                }
            }
        } else {
            const u8* blk = p0 + ((size_t)row * ns + sb) * 208;
            const float d = h2f(p1[(size_t)row * ns + sb]);
            const u8* ql = blk + 64 * half;
            const u8* qh = blk + 128 + 32 * half;
            #pragma unroll
            for (int k = 0; k < 4; ++k) {
                #pragma unroll
                for (int l4 = 0; l4 < 8; ++l4) {  // 4 elements l = 4 l4 .. 4 l4 + 3 of quarter k
                    const unsigned a = *(const unsigned*)(ql + 32 * (k & 1) + 4 * l4);
                    const unsigned hh = *(const unsigned*)(qh + 4 * l4);
                    const unsigned lo = (k >> 1) ? ((a >> 4) & 0x0f0f0f0fu) : (a & 0x0f0f0f0fu);
                    const unsigned hi = ((hh >> (2 * k)) & 0x03030303u) << 4;
                    const unsigned v = lo | hi;  // bytes 0..63
                    *(unsigned*)(dst + 32 * k + 4 * l4) = ((v | 0x80808080u) - 0x20202020u) ^ 0x80808080u;  // - 32
                }
            }
            #pragma unroll
            for (int i = 0; i < 8; ++i) s16[i] = d * (float)(signed char)blk[192 + 8 * half + i];
            #pragma unroll
            for (int j = 0; j < 4; ++j) mn[j] = 0.f;
        }
        return;
    }
    const int nb = K >> 5;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int b = chunk * 8 + half * 4 + i;
        i8* o = dst + 32 * i;
        if (b >= nb) {
            #pragma unroll
            for (int z = 0; z < 8; ++z) *(unsigned*)(o + 4 * z) = 0u;
            s16[2 * i] = s16[2 * i + 1] = 0.f;
            mn[i] = 0.f;
            continue;
        }
        const float d = h2f(p1[(size_t)row * nb + b]);
        s16[2 * i] = s16[2 * i + 1] = d;
        if (FMT == F_Q8_0) {
            const uint4 q0 = *(const uint4*)(p0 + ((size_t)row * nb + b) * 32);
            const uint4 q1 = *(const uint4*)(p0 + ((size_t)row * nb + b) * 32 + 16);
            *(uint4*)o = q0;
            *(uint4*)(o + 16) = q1;
            mn[i] = 0.f;
        } else {
            const uint4 q = *(const uint4*)(p0 + ((size_t)row * nb + b) * 16);
            const unsigned w[4] = {q.x, q.y, q.z, q.w};
            #pragma unroll
            for (int z = 0; z < 4; ++z) {
                unsigned lo = w[z] & 0x0f0f0f0fu, hi = (w[z] >> 4) & 0x0f0f0f0fu;
                if (FMT == F_Q4_0) {  // q - 8: signed bytes (each >= 8 after the or: no borrow across bytes)
                    lo = ((lo | 0x80808080u) - 0x08080808u) ^ 0x80808080u;
                    hi = ((hi | 0x80808080u) - 0x08080808u) ^ 0x80808080u;
                }
                *(unsigned*)(o + 4 * z) = lo;
                *(unsigned*)(o + 16 + 4 * z) = hi;
            }
            mn[i] = FMT == F_Q4_1 ? h2f(p2[(size_t)row * nb + b]) : 0.f;
        }
    }
}

// Y [M, N] (row stride ldy) = q8(X) [M, K] . W [N, K]^T. Grid (ceil(N / 64), ceil(M / 64)), 128 threads.
template <int FMT>
__global__ void __launch_bounds__(128) qmm_q8(const u8* __restrict__ p0, const u16* __restrict__ p1,
                                              const u16* __restrict__ p2, const i8* __restrict__ xq,
                                              const float2* __restrict__ xds, float* __restrict__ y, int ldy,
                                              int M, int N, int K) {
    __shared__ __align__(16) i8 Xs[BM * XS];
    __shared__ __align__(16) i8 Ws[BN * XS];
    __shared__ float2 Xd[BM][8];     // (xd, xs) per token and block of 32 of the chunk
    __shared__ float S16[BN][16];    // weight scale per 16
    __shared__ float MN[BN][8];      // weight min per 32 (times xs)
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;  // this warp's 32 x 32 of the tile
    const int nx = K >> 5;
    float acc[2][4][4];
    #pragma unroll
    for (int i = 0; i < 2; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j)
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
    const int nchunks = (K + KC - 1) / KC;
    for (int ch = 0; ch < nchunks; ++ch) {
        // tokens' int8 tile: 64 rows x 16 pieces of 16 bytes; past M or K: zeros
        #pragma unroll
        for (int r = 0; r < 8; ++r) {
            const int piece = tid + 128 * r, m = piece >> 4, c16 = piece & 15;
            const int col = ch * KC + 16 * c16;
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (m0 + m < M && col < K) v = *(const uint4*)(xq + (size_t)(m0 + m) * K + col);
            *(uint4*)(Xs + m * XS + 16 * c16) = v;
        }
        #pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int e = tid + 128 * r, m = e >> 3, j = e & 7, b = ch * 8 + j;
            Xd[m][j] = (m0 + m < M && b < nx) ? xds[(size_t)(m0 + m) * nx + b] : make_float2(0.f, 0.f);
        }
        // weights decoded to int8: thread = (row tid / 2, half tid % 2); rows past N decode row N - 1 (not written)
        {
            const int n = tid >> 1, half = tid & 1;
            float s16[8], mn[4];
            decode_half<FMT>(p0, p1, p2, min(n0 + n, N - 1), K, ch, half, Ws + n * XS + 128 * half, s16, mn);
            #pragma unroll
            for (int i = 0; i < 8; ++i) S16[n][8 * half + i] = s16[i];
            #pragma unroll
            for (int i = 0; i < 4; ++i) MN[n][4 * half + i] = mn[i];
        }
        __syncthreads();
        #pragma unroll
        for (int kk = 0; kk < 8; ++kk) {  // blocks of 32 in the chunk
            unsigned a[2][4], b[4][2];
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                const i8* r0 = Xs + (wm + 16 * i + g) * XS + 32 * kk + 4 * t;
                a[i][0] = *(const unsigned*)r0;
                a[i][1] = *(const unsigned*)(r0 + 8 * XS);
                a[i][2] = *(const unsigned*)(r0 + 16);
                a[i][3] = *(const unsigned*)(r0 + 8 * XS + 16);
            }
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                const i8* c0 = Ws + (wn + 8 * j + g) * XS + 32 * kk + 4 * t;
                b[j][0] = *(const unsigned*)c0;
                b[j][1] = *(const unsigned*)(c0 + 16);
            }
            float xd[2][2], xs[2][2];  // [m frag][row g | g+8]
            #pragma unroll
            for (int i = 0; i < 2; ++i)
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float2 v = Xd[wm + 16 * i + g + 8 * h][kk];
                    xd[i][h] = v.x; xs[i][h] = v.y;
                }
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                #pragma unroll
                for (int i = 0; i < 2; ++i) {
                    const int nc = wn + 8 * j + 2 * t;  // this lane's two columns: nc, nc + 1
                    if (FMT == F_Q6_K) {
                        int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
                        mma_s8(lo, a[i][0], a[i][1], a[i][2], a[i][3], b[j][0], 0u);
                        mma_s8(hi, a[i][0], a[i][1], a[i][2], a[i][3], 0u, b[j][1]);
                        #pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int n = nc + (e & 1), h = e >> 1;
                            acc[i][j][e] = fmaf(__fmul_rn(xd[i][h], S16[n][2 * kk]), (float)lo[e], acc[i][j][e]);
                            acc[i][j][e] = fmaf(__fmul_rn(xd[i][h], S16[n][2 * kk + 1]), (float)hi[e], acc[i][j][e]);
                        }
                    } else {
                        int c[4] = {0, 0, 0, 0};
                        mma_s8(c, a[i][0], a[i][1], a[i][2], a[i][3], b[j][0], b[j][1]);
                        #pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const int n = nc + (e & 1), h = e >> 1;
                            if (FMT == F_Q4_1 || FMT == F_Q4_K) acc[i][j][e] = fmaf(xs[i][h], MN[n][kk], acc[i][j][e]);
                            acc[i][j][e] = fmaf(__fmul_rn(xd[i][h], S16[n][2 * kk]), (float)c[e], acc[i][j][e]);
                        }
                    }
                }
            }
        }
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i)
        #pragma unroll
        for (int j = 0; j < 4; ++j)
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = m0 + wm + 16 * i + g + 8 * (e >> 1), n = n0 + wn + 8 * j + 2 * t + (e & 1);
                if (m < M && n < N) y[(size_t)m * ldy + n] = acc[i][j][e];
            }
}
"""

_FMT_ID = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q6_K": 4}
_PARTS = {"Q4_0": ("qs", "d", None), "Q4_1": ("qs", "d", "m"), "Q8_0": ("qs", "d", None),
          "Q4_K": ("blocks", None, None), "Q6_K": ("body", "d", None)}
_NAMES = tuple(f"qmm_q8<{i}>" for i in _FMT_ID.values())


def qmm(w: QWeight, xa: Q8Act, out: torch.Tensor | None = None) -> torch.Tensor:
    """out [M, N] fp32 (may be a column slice of a wider buffer) = dequant(xa) @ dequant(W).T."""
    if w.fmt not in FORMATS:
        raise ValueError(f"no int8 tensor-core GEMM for {w.fmt} (have {FORMATS})")
    M, K = xa.shape
    if K != w.cols:
        raise ValueError(f"x has {K} columns, weight {w.cols}")
    out = out_for(w, M, out, xa.xq.device)
    if M == 0:
        return out
    check_parts(w, _PARTS[w.fmt], xa.xq.device)
    parts = [w.parts[k] if k is not None else None for k in _PARTS[w.fmt]]
    fn = cu.function(SRC, f"qmm_q8<{_FMT_ID[w.fmt]}>", _NAMES)
    cu.launch(fn, (-(-w.rows // BN), -(-M // BM)), (128,), tuple(cu.ptr(t) for t in parts) + (
        cu.ptr(xa.xq), cu.ptr(xa.xds), cu.ptr(out), cu.i32(out.stride(0)), cu.i32(M), cu.i32(w.rows), cu.i32(K)))
    return out
