"""Prefill attention over the paged cache: every prompt row of a step in one launch a layer.

Why: a step that admits new requests after a cached prefix used to run one torch
SDPA call (plus gathers, a mask and GQA repeats) per chunk per layer: 12 two-row
chunks on SmolLM2 were 360 calls and ~100 ms of host time, the 64-stream stalls of
issue 14. Here the chunks' rows are cut into tiles of 16 rows of one chunk (a host
table), and one launch runs every (tile, head) pair, reading K/V through each
chunk's block table: the chunk's own rows are already in the cache (RoPE + KV
write runs first), so a cached prefix and an uncached prompt are the same case.

Numerics are a function of the row alone. A row at position p scores keys 0..p in
tiles of 32 keys aligned to absolute positions, in order; each tile updates the
row's online softmax (max, sum, accumulator). Keys past p get probability exactly
0, and a tile entirely past p is an exact no-op (max unchanged, correction
exp2(0) = 1), so the bits a row gets do not depend on which rows share its tile,
on the chunk it arrived in, or on a cached prefix: a request answers the same
alone, batched or on a cache hit.

Long contexts: the keys are taken in segments of SEG_KEYS absolute positions,
each with its own online softmax, merged in order into the row's running
(max, sum, O) (`seg_merge`; the first segment is taken as it is, so a row of
up to SEG_KEYS keys gets exactly the one-pass bits). A block walks its tile's
segments in turn, or, when a launch has few tiles over a long context
(`splits`: a short chunk after a 20k-token cached prefix was 32 warps each
walking 625 key tiles alone), every segment gets a block of its own and
`paged_prefill_combine` merges their (o, max, sum) in the same order with the
same roundings: the same bits either way, so the choice may follow the step.

Math: tensor cores, mma.sync m16n8k16 bf16 -> fp32 (q and the probabilities
rounded to bf16, as flash attention does; the cache is bf16 already). A warp and a
head: S = Q K^T over a 32-key tile (D/16 k-steps x 4 n-tiles), online softmax in
the accumulator layout (a row lives in one lane quad), then O += P V (2 k-steps x
D/8 n-tiles), with P taken straight from S's registers. A block takes a tile and a
KV head: its G query heads' warps (one or two heads a warp) share each key tile,
staged once by cp.async into one of two buffers while the other is scored (the one-
warp kernel it replaced, `paged_prefill_warp`, staged its own copy for every head
and waited on each load: 4-13 TFLOP/s on the 8B shape; kept as the bits' reference).

Shapes: q [N, >= H*D] fp32 (qkv rows), kc/vc [num_blocks, bs, Hkv, D] bf16,
tiles [T, 4] int32 (row0, rows <= 16, chunk, position of row0), bt [C, max_blocks]
int32, out [N, H*D] fp32 (only the tiles' rows are written; between segments it holds
their running O), part [T, H, segments, 16, D + 2] fp32 when split (o, max, sum).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from imp.kernels.cuda import runtime as cu

TILE_ROWS = 16
KT = 32  # keys per tile

SRC = r"""
__device__ __forceinline__ unsigned pack_bf2(float lo, float hi) {
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (M, L) of a row so far and a segment's (m, l): 0 when the segment saw no key of the row (m = -inf: nothing
// changes), 1 for the row's first segment (taken as it is: a row inside one segment gets o / l, as the kernel
// always gave), 2 for a merge with scales a (the running O) and b (the segment's o). __fmul_rn / __fadd_rn are
// never contracted into an FMA, so the in-kernel merge and `paged_prefill_combine` round alike: the same bits.
__device__ __forceinline__ int seg_merge(float& M, float& L, float m, float l, float& a, float& b) {
    if (m == NEG_INF) return 0;
    if (M == NEG_INF) { M = m; L = l; return 1; }
    const float M2 = fmaxf(M, m);
    a = exp2f(M - M2);
    b = exp2f(m - M2);
    L = __fadd_rn(__fmul_rn(L, a), __fmul_rn(l, b));
    M = M2;
    return 2;
}
__device__ __forceinline__ float seg_mix(int how, float O, float a, float o, float b) {
    return how == 1 ? o : __fadd_rn(__fmul_rn(O, a), __fmul_rn(o, b));
}

// The one argument list of both prefill kernels (one host launch serves either)
#define PAGED_PREFILL_ARGS                                                                   \
    const float* __restrict__ q, int ldq, const u16* __restrict__ kc, const u16* __restrict__ vc, \
    const int* __restrict__ tiles, const int* __restrict__ bt, int max_blocks,                \
    float* __restrict__ out, int ldo, int H, int Hkv, int bs, float scale_log2,               \
    int seg, float* __restrict__ part, int nsplit

template <int D>
__global__ void __launch_bounds__(32) paged_prefill_warp(PAGED_PREFILL_ARGS) {
    constexpr int KS = D / 16;        // k-steps of S = Q K^T
    constexpr int NT = D / 8;         // n-tiles of O
    constexpr int KP = D + 8;         // padded K row (bf16)
    constexpr int VP = 32 + 8;        // padded V^T row (bf16)
    __shared__ __align__(16) u16 Ks[32 * KP];
    __shared__ __align__(16) u16 Vt[D * VP];
    const int tile = blockIdx.x, h = blockIdx.y;
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    const int row0 = tiles[tile * 4], nrows = tiles[tile * 4 + 1];
    const int chunk = tiles[tile * 4 + 2], pos0 = tiles[tile * 4 + 3];
    const int kvh = h / (H / Hkv);
    const int* btr = bt + (size_t)chunk * max_blocks;
    const int last = pos0 + nrows - 1;  // the last key any row of the tile sees
    const int pa = (g < nrows) ? pos0 + g : -1, pb = (g + 8 < nrows) ? pos0 + g + 8 : -1;

    // Q fragments (rows g and g+8, columns 16 ks + 2t (+1) and + 8), bf16, kept for every key tile
    unsigned qa[KS][4];
    {
        const float* ra = q + (size_t)(row0 + g) * ldq + (size_t)h * D;
        const float* rb = q + (size_t)(row0 + g + 8) * ldq + (size_t)h * D;
        #pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            const int c = ks * 16 + 2 * t;
            const float2 a0 = (pa >= 0) ? *(const float2*)(ra + c) : make_float2(0.f, 0.f);
            const float2 a2 = (pa >= 0) ? *(const float2*)(ra + c + 8) : make_float2(0.f, 0.f);
            const float2 b0 = (pb >= 0) ? *(const float2*)(rb + c) : make_float2(0.f, 0.f);
            const float2 b2 = (pb >= 0) ? *(const float2*)(rb + c + 8) : make_float2(0.f, 0.f);
            qa[ks][0] = pack_bf2(a0.x, a0.y);
            qa[ks][1] = pack_bf2(b0.x, b0.y);
            qa[ks][2] = pack_bf2(a2.x, a2.y);
            qa[ks][3] = pack_bf2(b2.x, b2.y);
        }
    }
    const size_t tok = (size_t)Hkv * D;
    constexpr int CH = D / 8;  // 16-byte chunks per key row
    const int nseg = last / seg + 1;
    int s_lo = 0, s_hi = nseg;  // in turn here; with `part`, block z's segment alone
    if (part != nullptr) {
        s_lo = blockIdx.z;
        s_hi = s_lo + 1;
        if (s_lo >= nseg) return;
    }
    float Ma = NEG_INF, Mb = NEG_INF, La = 0.f, Lb = 0.f;  // rows g, g+8 over the segments merged so far
    float* oa = out + (size_t)(row0 + g) * ldo + (size_t)h * D;  // the running O between segments (pa >= 0)
    float* ob = out + (size_t)(row0 + g + 8) * ldo + (size_t)h * D;
    for (int sg = s_lo; sg < s_hi; ++sg) {
    float o[NT][4];
    #pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float ma = NEG_INF, mb = NEG_INF, la = 0.f, lb = 0.f;  // rows g, g+8: running max (log2 units), lane's sum
    const int kend = min(last, sg * seg + seg - 1);
    for (int k0 = sg * seg; k0 <= kend; k0 += 32) {
        __syncwarp();
        // stage K (row-major) and V (transposed) of keys k0..k0+31; keys past `last` are zeros
        #pragma unroll 4
        for (int i = lane; i < 32 * CH; i += 32) {
            const int kk = i / CH, c = i % CH, kp = k0 + kk;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (kp <= last) {
                const size_t off = ((size_t)btr[kp / bs] * bs + kp % bs) * tok + (size_t)kvh * D + c * 8;
                kv = __ldg((const uint4*)(kc + off));
                vv = __ldg((const uint4*)(vc + off));
            }
            *(uint4*)(Ks + kk * KP + c * 8) = kv;
            const u16* ve = (const u16*)&vv;
            #pragma unroll
            for (int e = 0; e < 8; ++e) Vt[(c * 8 + e) * VP + kk] = ve[e];
        }
        __syncwarp();
        // S = Q K^T: 4 n-tiles of 8 keys
        float s[4][4];
        #pragma unroll
        for (int n = 0; n < 4; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            #pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                const u16* kr = Ks + (n * 8 + g) * KP + ks * 16 + 2 * t;
                mma_bf16(s[n], qa[ks], *(const unsigned*)kr, *(const unsigned*)(kr + 8));
            }
        }
        // mask, tile max per row (quad of lanes)
        float mxa = NEG_INF, mxb = NEG_INF;
        #pragma unroll
        for (int n = 0; n < 4; ++n) {
            #pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int kp = k0 + n * 8 + 2 * t + j;
                s[n][j] = (kp <= pa) ? s[n][j] * scale_log2 : NEG_INF;
                s[n][2 + j] = (kp <= pb) ? s[n][2 + j] * scale_log2 : NEG_INF;
                mxa = fmaxf(mxa, s[n][j]);
                mxb = fmaxf(mxb, s[n][2 + j]);
            }
        }
        mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
        mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
        mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
        mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
        const float na = fmaxf(ma, mxa), nb = fmaxf(mb, mxb);
        // a row with nothing seen yet (max -inf) keeps p = 0 and scale 1: the tile is an exact no-op
        const float ca = (na == NEG_INF) ? 1.f : exp2f(ma - na);
        const float cb = (nb == NEG_INF) ? 1.f : exp2f(mb - nb);
        ma = na; mb = nb;
        la *= ca; lb *= cb;
        #pragma unroll
        for (int n = 0; n < NT; ++n) { o[n][0] *= ca; o[n][1] *= ca; o[n][2] *= cb; o[n][3] *= cb; }
        unsigned pf[4][2];  // P in bf16 pairs: [n-tile][row g, row g+8]
        #pragma unroll
        for (int n = 0; n < 4; ++n) {
            const float p0 = (na == NEG_INF) ? 0.f : exp2f(s[n][0] - na);
            const float p1 = (na == NEG_INF) ? 0.f : exp2f(s[n][1] - na);
            const float p2 = (nb == NEG_INF) ? 0.f : exp2f(s[n][2] - nb);
            const float p3 = (nb == NEG_INF) ? 0.f : exp2f(s[n][3] - nb);
            pf[n][0] = pack_bf2(p0, p1);
            pf[n][1] = pack_bf2(p2, p3);
            // the sum takes the probabilities as the PV product sees them (bf16)
            la += bf2f((u16)(pf[n][0] & 0xffffu)) + bf2f((u16)(pf[n][0] >> 16));
            lb += bf2f((u16)(pf[n][1] & 0xffffu)) + bf2f((u16)(pf[n][1] >> 16));
        }
        // O += P V: two k-steps of 16 keys
        #pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            const unsigned a[4] = {pf[2 * kk][0], pf[2 * kk][1], pf[2 * kk + 1][0], pf[2 * kk + 1][1]};
            #pragma unroll
            for (int n = 0; n < NT; ++n) {
                const u16* vr = Vt + (n * 8 + g) * VP + kk * 16 + 2 * t;
                mma_bf16(o[n], a, *(const unsigned*)vr, *(const unsigned*)(vr + 8));
            }
        }
    }
    la += __shfl_xor_sync(0xffffffffu, la, 1);
    la += __shfl_xor_sync(0xffffffffu, la, 2);
    lb += __shfl_xor_sync(0xffffffffu, lb, 1);
    lb += __shfl_xor_sync(0xffffffffu, lb, 2);
    if (part != nullptr) {  // this segment's (o, m, l) per row: paged_prefill_combine merges them in order
        float* pr = part + (((size_t)tile * H + h) * nsplit + sg) * 16 * (D + 2);
        #pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int c = n * 8 + 2 * t;
            if (pa >= 0) *(float2*)(pr + (size_t)g * (D + 2) + c) = make_float2(o[n][0], o[n][1]);
            if (pb >= 0) *(float2*)(pr + (size_t)(g + 8) * (D + 2) + c) = make_float2(o[n][2], o[n][3]);
        }
        if (t == 0 && pa >= 0) { pr[(size_t)g * (D + 2) + D] = ma; pr[(size_t)g * (D + 2) + D + 1] = la; }
        if (t == 0 && pb >= 0) { pr[(size_t)(g + 8) * (D + 2) + D] = mb; pr[(size_t)(g + 8) * (D + 2) + D + 1] = lb; }
        return;
    }
    float aa = 0.f, ba = 0.f, ab = 0.f, bb = 0.f;
    const int ua = seg_merge(Ma, La, ma, la, aa, ba), ub = seg_merge(Mb, Lb, mb, lb, ab, bb);
    const bool final_ = sg == nseg - 1;  // normalise there; between segments the running O waits in `out`
    const float ia = (La > 0.f) ? 1.f / La : 0.f, ib = (Lb > 0.f) ? 1.f / Lb : 0.f;
    #pragma unroll
    for (int n = 0; n < NT; ++n) {
        const int c = n * 8 + 2 * t;
        if (pa >= 0 && (ua || final_)) {
            float2 O = ua == 1 ? make_float2(0.f, 0.f) : *(const float2*)(oa + c);
            if (ua) O = make_float2(seg_mix(ua, O.x, aa, o[n][0], ba), seg_mix(ua, O.y, aa, o[n][1], ba));
            if (final_) { O.x *= ia; O.y *= ia; }
            *(float2*)(oa + c) = O;
        }
        if (pb >= 0 && (ub || final_)) {
            float2 O = ub == 1 ? make_float2(0.f, 0.f) : *(const float2*)(ob + c);
            if (ub) O = make_float2(seg_mix(ub, O.x, ab, o[n][2], bb), seg_mix(ub, O.y, ab, o[n][3], bb));
            if (final_) { O.x *= ib; O.y *= ib; }
            *(float2*)(ob + c) = O;
        }
    }
    }  // segments
}

__device__ __forceinline__ void pf_cp16(void* dst, const void* src, int n) {  // n = 0: 16 zero bytes, no read
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(d), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void pf_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void pf_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
// four 8x8 b16 matrices transposed: lanes 8j..8j+7 address matrix j's rows; r_j is matrix j's fragment
__device__ __forceinline__ void ldsm_x4_t(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}

// Keys k0..k0+31 of KV head kvh into buffer (Kb, Vb), both row-major [key][D + 8]; keys past `last` as zeros
// (their scores are masked, and a zero V row times a zero probability adds exact zeros).
template <int D>
__device__ __forceinline__ void pf_stage(u16* Kb, u16* Vb, const u16* __restrict__ kc, const u16* __restrict__ vc,
                                         const int* __restrict__ btr, int k0, int last, int bs, size_t tok, int kvh) {
    constexpr int CH = D / 8, KP = D + 8;
    for (int i = threadIdx.x; i < 32 * CH; i += blockDim.x) {
        const int kk = i / CH, c = i % CH, kp = k0 + kk;
        const bool in = kp <= last;
        const size_t off = in ? ((size_t)btr[kp / bs] * bs + kp % bs) * tok + (size_t)kvh * D + c * 8 : 0;
        pf_cp16(Kb + kk * KP + c * 8, kc + off, in ? 16 : 0);
        pf_cp16(Vb + kk * KP + c * 8, vc + off, in ? 16 : 0);
    }
    pf_commit();
}

__device__ __forceinline__ void ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}

// One block a (tile, KV head): G / HPW warps, warp w the query heads kvh * G + HPW * w + j (j < HPW) over the tile's
// rows. The tile's Q rows (bf16, as the one-warp kernel rounds them) wait in shared memory for the G heads and each
// key tile is staged once for them, by cp.async into one of two buffers while the other is scored; a warp reads its
// K and V fragments once for its HPW heads (two heads: twice the independent MMAs between waits, half the loads a
// head). V is read with ldmatrix.trans instead of being transposed on the way in. Each head's arithmetic is
// paged_prefill_warp's, in the same order, so the bits are the same (tests/test_gpu_paged_prefill.py compares them).
// Dynamic shared memory: Q [G][16][D + 8], K and V [2][32][D + 8] each (`smem_bytes`).
template <int D, int HPW>
__global__ void __launch_bounds__(256) paged_prefill(PAGED_PREFILL_ARGS) {
    constexpr int KS = D / 16;        // k-steps of S = Q K^T
    constexpr int NT = D / 8;         // n-tiles of O
    constexpr int KP = D + 8;         // padded row (bf16): conflict-free fragment and ldmatrix reads
    extern __shared__ __align__(16) unsigned char pf_sm[];
    const int G = H / Hkv;
    u16* Qs = (u16*)pf_sm;            // [G][16][KP]
    u16* Ks = Qs + G * 16 * KP;       // [2][32][KP]
    u16* Vs = Ks + 2 * 32 * KP;       // [2][32][KP]
    const int tile = blockIdx.x, kvh = blockIdx.y;
    const int hw = HPW * (threadIdx.x >> 5);  // this warp's first head within the group
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int row0 = tiles[tile * 4], nrows = tiles[tile * 4 + 1];
    const int chunk = tiles[tile * 4 + 2], pos0 = tiles[tile * 4 + 3];
    const int* btr = bt + (size_t)chunk * max_blocks;
    const int last = pos0 + nrows - 1;  // the last key any row of the tile sees
    const int pa = (g < nrows) ? pos0 + g : -1, pb = (g + 8 < nrows) ? pos0 + g + 8 : -1;
    for (int i = threadIdx.x; i < G * 16 * (D / 2); i += blockDim.x) {  // Q: column pairs, rows past nrows zero
        const int hh = i / (16 * (D / 2)), r = (i / (D / 2)) % 16, c = 2 * (i % (D / 2));
        const float2 v = (r < nrows) ? *(const float2*)(q + (size_t)(row0 + r) * ldq + (size_t)(kvh * G + hh) * D + c)
                                     : make_float2(0.f, 0.f);
        *(unsigned*)(Qs + (hh * 16 + r) * KP + c) = pack_bf2(v.x, v.y);
    }
    const size_t tok = (size_t)Hkv * D;
    const int nseg = last / seg + 1;
    int s_lo = 0, s_hi = nseg;  // in turn here; with `part`, block z's segment alone
    if (part != nullptr) {
        s_lo = blockIdx.z;
        s_hi = s_lo + 1;
        if (s_lo >= nseg) return;  // the whole block: s_lo and nseg are the block's
    }
    const int kbeg = s_lo * seg, kfin = min(last, s_hi * seg - 1);
    float Ma[HPW], Mb[HPW], La[HPW], Lb[HPW];  // rows g, g+8 over the segments merged so far, a head each
    float o[HPW][NT][4];
    float ma[HPW], mb[HPW], la[HPW], lb[HPW];  // rows g, g+8: running max (log2 units), lane's sum
    #pragma unroll
    for (int j = 0; j < HPW; ++j) {
        Ma[j] = Mb[j] = NEG_INF; La[j] = Lb[j] = 0.f;
        ma[j] = mb[j] = NEG_INF; la[j] = lb[j] = 0.f;
        #pragma unroll
        for (int n = 0; n < NT; ++n) o[j][n][0] = o[j][n][1] = o[j][n][2] = o[j][n][3] = 0.f;
    }
    pf_stage<D>(Ks, Vs, kc, vc, btr, kbeg, last, bs, tok, kvh);
    int buf = 0;
    for (int k0 = kbeg; k0 <= kfin; k0 += 32, buf ^= 1) {
        if (k0 + 32 <= kfin) {
            pf_stage<D>(Ks + (buf ^ 1) * 32 * KP, Vs + (buf ^ 1) * 32 * KP, kc, vc, btr, k0 + 32, last, bs, tok, kvh);
            pf_wait<1>();
        } else {
            pf_wait<0>();
        }
        __syncthreads();  // the tile (and, the first time, Q) is in shared memory for every warp
        const u16* Kb = Ks + buf * 32 * KP;
        const u16* Vb = Vs + buf * 32 * KP;
        // S = Q K^T: 4 n-tiles of 8 keys; each s[j][n] takes its k-steps in order, as the one-warp kernel
        float s[HPW][4][4];
        #pragma unroll
        for (int j = 0; j < HPW; ++j)
            #pragma unroll
            for (int n = 0; n < 4; ++n) s[j][n][0] = s[j][n][1] = s[j][n][2] = s[j][n][3] = 0.f;
        #pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            unsigned qa[HPW][4];
            #pragma unroll
            for (int j = 0; j < HPW; ++j)
                ldsm_x4(qa[j][0], qa[j][1], qa[j][2], qa[j][3],
                        Qs + ((hw + j) * 16 + (lane & 15)) * KP + ks * 16 + (lane >> 4) * 8);
            #pragma unroll
            for (int n = 0; n < 4; ++n) {
                const u16* kr = Kb + (n * 8 + g) * KP + ks * 16 + 2 * t;
                const unsigned b0 = *(const unsigned*)kr, b1 = *(const unsigned*)(kr + 8);
                #pragma unroll
                for (int j = 0; j < HPW; ++j) mma_bf16(s[j][n], qa[j], b0, b1);
            }
        }
        unsigned pf[HPW][4][2];  // P in bf16 pairs: [head][n-tile][row g, row g+8]
        #pragma unroll
        for (int j = 0; j < HPW; ++j) {
            float mxa = NEG_INF, mxb = NEG_INF;
            #pragma unroll
            for (int n = 0; n < 4; ++n) {
                #pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int kp = k0 + n * 8 + 2 * t + e;
                    s[j][n][e] = (kp <= pa) ? s[j][n][e] * scale_log2 : NEG_INF;
                    s[j][n][2 + e] = (kp <= pb) ? s[j][n][2 + e] * scale_log2 : NEG_INF;
                    mxa = fmaxf(mxa, s[j][n][e]);
                    mxb = fmaxf(mxb, s[j][n][2 + e]);
                }
            }
            mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
            mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
            mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
            mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
            const float na = fmaxf(ma[j], mxa), nb = fmaxf(mb[j], mxb);
            // a row with nothing seen yet (max -inf) keeps p = 0 and scale 1: the tile is an exact no-op
            const float ca = (na == NEG_INF) ? 1.f : exp2f(ma[j] - na);
            const float cb = (nb == NEG_INF) ? 1.f : exp2f(mb[j] - nb);
            ma[j] = na; mb[j] = nb;
            la[j] *= ca; lb[j] *= cb;
            #pragma unroll
            for (int n = 0; n < NT; ++n) { o[j][n][0] *= ca; o[j][n][1] *= ca; o[j][n][2] *= cb; o[j][n][3] *= cb; }
            #pragma unroll
            for (int n = 0; n < 4; ++n) {
                const float p0 = (na == NEG_INF) ? 0.f : exp2f(s[j][n][0] - na);
                const float p1 = (na == NEG_INF) ? 0.f : exp2f(s[j][n][1] - na);
                const float p2 = (nb == NEG_INF) ? 0.f : exp2f(s[j][n][2] - nb);
                const float p3 = (nb == NEG_INF) ? 0.f : exp2f(s[j][n][3] - nb);
                pf[j][n][0] = pack_bf2(p0, p1);
                pf[j][n][1] = pack_bf2(p2, p3);
                // the sum takes the probabilities as the PV product sees them (bf16)
                la[j] += bf2f((u16)(pf[j][n][0] & 0xffffu)) + bf2f((u16)(pf[j][n][0] >> 16));
                lb[j] += bf2f((u16)(pf[j][n][1] & 0xffffu)) + bf2f((u16)(pf[j][n][1] >> 16));
            }
        }
        // O += P V: two k-steps of 16 keys; V fragments for two n-tiles per ldmatrix (lanes 0-15: keys 0-15 at
        // n-tile n, lanes 16-31: at n-tile n + 1), used by the warp's every head
        #pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
            #pragma unroll
            for (int n = 0; n < NT; n += 2) {
                unsigned b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3, Vb + (kk * 16 + (lane & 15)) * KP + (n + (lane >> 4)) * 8);
                #pragma unroll
                for (int j = 0; j < HPW; ++j) {
                    const unsigned a[4] = {pf[j][2 * kk][0], pf[j][2 * kk][1], pf[j][2 * kk + 1][0], pf[j][2 * kk + 1][1]};
                    mma_bf16(o[j][n], a, b0, b1);
                    mma_bf16(o[j][n + 1], a, b2, b3);
                }
            }
        }
        __syncthreads();  // this buffer is the next-but-one tile's: every warp is done with it
        if ((k0 + 32) % seg != 0 && k0 + 32 <= kfin) continue;
        // the end of segment sg: merge it (or hand it to paged_prefill_combine), then start the next
        const int sg = k0 / seg;
        const bool final_ = sg == nseg - 1;  // normalise there; between segments the running O waits in `out`
        #pragma unroll
        for (int j = 0; j < HPW; ++j) {
            const int h = kvh * G + hw + j;
            la[j] += __shfl_xor_sync(0xffffffffu, la[j], 1);
            la[j] += __shfl_xor_sync(0xffffffffu, la[j], 2);
            lb[j] += __shfl_xor_sync(0xffffffffu, lb[j], 1);
            lb[j] += __shfl_xor_sync(0xffffffffu, lb[j], 2);
            if (part != nullptr) {
                float* pr = part + (((size_t)tile * H + h) * nsplit + sg) * 16 * (D + 2);
                #pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const int c = n * 8 + 2 * t;
                    if (pa >= 0) *(float2*)(pr + (size_t)g * (D + 2) + c) = make_float2(o[j][n][0], o[j][n][1]);
                    if (pb >= 0) *(float2*)(pr + (size_t)(g + 8) * (D + 2) + c) = make_float2(o[j][n][2], o[j][n][3]);
                }
                if (t == 0 && pa >= 0) { pr[(size_t)g * (D + 2) + D] = ma[j]; pr[(size_t)g * (D + 2) + D + 1] = la[j]; }
                if (t == 0 && pb >= 0) { pr[(size_t)(g + 8) * (D + 2) + D] = mb[j]; pr[(size_t)(g + 8) * (D + 2) + D + 1] = lb[j]; }
            } else {
                float* oa = out + (size_t)(row0 + g) * ldo + (size_t)h * D;  // the running O between segments
                float* ob = out + (size_t)(row0 + g + 8) * ldo + (size_t)h * D;
                float aa = 0.f, ba = 0.f, ab = 0.f, bb = 0.f;
                const int ua = seg_merge(Ma[j], La[j], ma[j], la[j], aa, ba);
                const int ub = seg_merge(Mb[j], Lb[j], mb[j], lb[j], ab, bb);
                const float ia = (La[j] > 0.f) ? 1.f / La[j] : 0.f, ib = (Lb[j] > 0.f) ? 1.f / Lb[j] : 0.f;
                #pragma unroll
                for (int n = 0; n < NT; ++n) {
                    const int c = n * 8 + 2 * t;
                    if (pa >= 0 && (ua || final_)) {
                        float2 O = ua == 1 ? make_float2(0.f, 0.f) : *(const float2*)(oa + c);
                        if (ua) O = make_float2(seg_mix(ua, O.x, aa, o[j][n][0], ba), seg_mix(ua, O.y, aa, o[j][n][1], ba));
                        if (final_) { O.x *= ia; O.y *= ia; }
                        *(float2*)(oa + c) = O;
                    }
                    if (pb >= 0 && (ub || final_)) {
                        float2 O = ub == 1 ? make_float2(0.f, 0.f) : *(const float2*)(ob + c);
                        if (ub) O = make_float2(seg_mix(ub, O.x, ab, o[j][n][2], bb), seg_mix(ub, O.y, ab, o[j][n][3], bb));
                        if (final_) { O.x *= ib; O.y *= ib; }
                        *(float2*)(ob + c) = O;
                    }
                }
            }
            #pragma unroll
            for (int n = 0; n < NT; ++n) o[j][n][0] = o[j][n][1] = o[j][n][2] = o[j][n][3] = 0.f;
            ma[j] = NEG_INF; mb[j] = NEG_INF; la[j] = 0.f; lb[j] = 0.f;
        }
    }
}

// One block a (tile, head), a thread a column: the segments' (o, m, l) merged in order, as the kernel above
// merges them in turn, then O / L.
template <int D>
__global__ void __launch_bounds__(D) paged_prefill_combine(
    const int* __restrict__ tiles, const float* __restrict__ part, int nsplit, int seg,
    float* __restrict__ out, int ldo, int H) {
    const int tile = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
    const int row0 = tiles[tile * 4], nrows = tiles[tile * 4 + 1], pos0 = tiles[tile * 4 + 3];
    const int nseg = (pos0 + nrows - 1) / seg + 1;
    const float* pt = part + ((size_t)tile * H + h) * nsplit * 16 * (D + 2);
    for (int r = 0; r < nrows; ++r) {
        float M = NEG_INF, L = 0.f, O = 0.f;
        for (int sg = 0; sg < nseg; ++sg) {
            const float* pr = pt + ((size_t)sg * 16 + r) * (D + 2);
            float a = 0.f, b = 0.f;
            const int how = seg_merge(M, L, pr[D], pr[D + 1], a, b);
            if (how) O = seg_mix(how, O, a, pr[c], b);
        }
        const float i = (L > 0.f) ? 1.f / L : 0.f;
        out[(size_t)(row0 + r) * ldo + (size_t)h * D + c] = O * i;
    }
}
"""

_NAMES = ("paged_prefill<64, 1>", "paged_prefill<64, 2>", "paged_prefill<128, 1>", "paged_prefill<128, 2>",
          "paged_prefill_warp<64>", "paged_prefill_warp<128>",
          "paged_prefill_combine<64>", "paged_prefill_combine<128>")

SEG_KEYS = 2048  # a row's keys are scored in segments of this many absolute positions, merged in order
SPLIT_BELOW = 512  # (tile, head) pairs under which a launch over several segments runs them side by side


_smem_set: dict[int, int] = {}  # id(kernel) -> the dynamic shared memory it has been allowed (before any graph capture)


def smem_bytes(group: int, d: int) -> int:
    """paged_prefill's dynamic shared memory: the tile's Q rows for the group's heads, two K and two V key tiles
    (bf16 rows of D + 8)."""
    return (group * TILE_ROWS + 4 * KT) * (d + 8) * 2


def splits(tiles: int, heads: int, last: int, seg: int = SEG_KEYS) -> int:
    """How many blocks a (tile, head) gets: its segments side by side (then `paged_prefill_combine`) when the
    launch has few tiles over a long context, else 1 (the segments in turn). The bits are the same either way,
    so this is free to depend on the step: a 16-row chunk after a 20k-token cached prefix was 32 warps on the
    8B shape, each walking 625 key tiles alone (~0.2 s a step, issue 35's restart TTFT)."""
    n = last // seg + 1
    return n if n > 1 and tiles * heads < SPLIT_BELOW else 1


def supports(kc: torch.Tensor, n_heads: int) -> bool:
    """bf16 caches with head dim 64 or 128 (every llama-family shape the GPU runner serves)."""
    return kc.dtype == torch.bfloat16 and kc.shape[-1] in (64, 128) and n_heads % kc.shape[-2] == 0


def plan(chunks: list[tuple[int, int, np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Host tables for `chunks` [(row0, rows, block ids covering every row's position, start)]:
    tiles [T, 4] int32 (row0, rows <= 16, chunk index, position of row0) and bt [C, max_blocks] int32."""
    tiles = []
    nbmax = max(len(b) for _, _, b, _ in chunks)
    bt = np.zeros((len(chunks), nbmax), np.int32)
    for c, (r0, n, blocks, start) in enumerate(chunks):
        bt[c, :len(blocks)] = blocks
        for i in range(0, n, TILE_ROWS):
            tiles.append((r0 + i, min(TILE_ROWS, n - i), c, start + i))
    return np.asarray(tiles, np.int32).reshape(-1, 4), bt


def paged_prefill(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tiles: torch.Tensor, bt: torch.Tensor,
                  n_heads: int, out: torch.Tensor, scale: float | None = None, last: int | None = None,
                  seg: int = SEG_KEYS, warp: bool = False, hpw: int | None = None) -> torch.Tensor:
    """Writes the attention of every tile's rows into out [N, H*D] fp32 (see the module docstring). last: the
    last key position of any tile (the host knows it; a graph's launch does not), which lets a launch of few
    tiles over a long context run its segments side by side (`splits`); None: in turn. warp: the one-warp kernel (a
    warp a tile and head, the reference for the bits); hpw: heads a warp of the staged kernel (1 or 2; None: 2 where
    the group is even). Every choice gives the same bits."""
    cu.check(q, "q", torch.float32, 2, align=16)
    cu.check(kc, "kc", torch.bfloat16, 4, align=16)
    cu.check(vc, "vc", torch.bfloat16, 4, align=16)
    cu.check(tiles, "tiles", torch.int32, 2)
    cu.check(bt, "bt", torch.int32, 2)
    cu.check(out, "out", torch.float32, 2, align=8)
    _, bs, Hkv, D = kc.shape
    if not supports(kc, n_heads) or vc.shape != kc.shape or q.shape[1] < n_heads * D or q.stride(0) % 4:
        raise ValueError(f"unsupported shape: D={D}, H={n_heads}, Hkv={Hkv}")
    if not (kc.is_contiguous() and vc.is_contiguous() and tiles.is_contiguous() and bt.is_contiguous()):
        raise ValueError("caches and tables must be contiguous")
    if out.stride(0) % 2:
        raise ValueError("out rows must be 8-byte aligned")
    if seg <= 0 or seg % KT:
        raise ValueError(f"segments of whole key tiles: {seg}")
    T = tiles.shape[0]
    if T == 0:
        return out
    s = (1.0 / math.sqrt(D)) if scale is None else scale
    n = 1 if last is None else splits(T, n_heads, last, seg)
    part = torch.empty(T * n_heads * n * TILE_ROWS * (D + 2), dtype=torch.float32, device=q.device) if n > 1 else None
    G, smem = n_heads // Hkv, 0
    hpw = hpw or 1  # two heads a warp: 255 registers, 10-40 % slower on an H100 (bench/prefill_attention.py)
    if hpw not in (1, 2) or G % hpw:
        raise ValueError(f"{hpw} heads a warp for a group of {G}")
    if warp or G // hpw > 8:  # the one-warp kernel: the reference for the bits; past 8 warps (256 threads) a block
        fn, grid, block = cu.function(SRC, f"paged_prefill_warp<{D}>", _NAMES), (T, n_heads, n), (32,)
    else:
        fn, grid, block = cu.function(SRC, f"paged_prefill<{D}, {hpw}>", _NAMES), (T, Hkv, n), (32 * G // hpw,)
        smem = smem_bytes(G, D)
        if id(fn) not in _smem_set:  # past 48 KiB a kernel must ask, once, for the most any group takes (8 warps)
            _smem_set[id(fn)] = fn.max_dynamic_shared_size_bytes = smem_bytes(8 * hpw, D)
    cu.launch(fn, grid, block, (
        cu.ptr(q), cu.i32(q.stride(0)), cu.ptr(kc), cu.ptr(vc), cu.ptr(tiles), cu.ptr(bt), cu.i32(bt.shape[1]),
        cu.ptr(out), cu.i32(out.stride(0)), cu.i32(n_heads), cu.i32(Hkv), cu.i32(bs), cu.f32(s * math.log2(math.e)),
        cu.i32(seg), cu.ptr(part), cu.i32(n)), shared_mem=smem)
    if part is not None:
        comb = cu.function(SRC, f"paged_prefill_combine<{D}>", _NAMES)
        cu.launch(comb, (T, n_heads), (D,), (cu.ptr(tiles), cu.ptr(part), cu.i32(n), cu.i32(seg), cu.ptr(out),
                                              cu.i32(out.stride(0)), cu.i32(n_heads)))
    return out


def reference(q, kc, vc, chunks, n_heads: int, scale: float | None = None) -> dict[int, torch.Tensor]:
    """float64 causal attention of each chunk's rows over its block table: {row: [H*D]}."""
    _, bs, Hkv, D = kc.shape
    G = n_heads // Hkv
    s = (1.0 / math.sqrt(D)) if scale is None else scale
    res = {}
    for r0, n, blocks, start in chunks:
        b = torch.as_tensor(np.asarray(blocks), dtype=torch.int64, device=kc.device)
        k = kc.index_select(0, b).reshape(-1, Hkv, D).double().repeat_interleave(G, dim=1)  # [L, H, D]
        v = vc.index_select(0, b).reshape(-1, Hkv, D).double().repeat_interleave(G, dim=1)
        for i in range(n):
            p = start + i
            qb = q[r0 + i, : n_heads * D].double().view(n_heads, D)
            sc = torch.einsum("hd,lhd->hl", qb, k[: p + 1]) * s
            res[r0 + i] = torch.einsum("hl,lhd->hd", torch.softmax(sc, -1), v[: p + 1]).reshape(-1)
    return res
