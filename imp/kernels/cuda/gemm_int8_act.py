"""Quantized GEMM on int8 activations with integer tensor cores (llama.cpp's MMQ): Y = X W^T for batches
of 9..512+ rows, where the GEMV (`gemv_int8_act`, dp4a) is compute-bound and the server today falls back to
cuBLAS over a dense fp16 copy of the weights (3.3x the bytes of a Q4_K model kept in memory).

Wired in for the int8 path without a dense copy (`imp.gpu.linear.Linear.mode`: prompt rows and decode
batches past 8); with a dense copy cuBLAS over it is still faster at 64+ rows (bench/qmm.py, H200:
0.26-0.61x of cuBLAS at M = 64..512, 0.9-1.2x at 16). `tests/test_gpu_qmm.py` (GPU lane) checks every
tile against the float64 reference and the tiles' bits against each other.

Same numerics as the GEMV: x is q8 per block of 32 (`imp.kernels.cuda.quantize_act_int8`), each weight block read as
int8 with its scale (and min), integer dot products exact, scaled in fp32:

    Y[m, n] = sum_g xd[m, g/2] * s16[n, g] * isum16(m, n, g) + sum_j xs[m, j] * mn32[n, j]

(s16: the weight scale of each 16 elements, the same for both halves of a 32-block except in Q6_K;
mn32: the min term of Q4_1 / Q4_K per 32.) Per output and block of 32, in block order:
acc = fmaf(xs, mn, acc) (formats with a min), then acc = fmaf(__fmul_rn(xd, s), (float)isum, acc)
(Q6_K: that twice, low half then high half), the same bits for every tile shape below.
One `mma.sync.m16n8k32.s8` per 32 elements; Q6_K two `m16n8k16` (one per 16, the halves of the
same A fragment registers: half the tensor work of two k32 with the other half zeroed).

Where the time goes, and what this kernel does about it:
  * The fp32 epilogue, not the tensor cores: per output and block of 32 a conversion, a multiply and
    one or two FMAs. The int -> float conversion (I2F, a quarter-rate pipe) is gone: the mma
    accumulator starts at 0x4B400000 (1.5 * 2^23 as float bits), so its result's bits read as a float
    are exactly 12582912 + isum (|isum| < 2^22), and one exact FADD gives (float)isum.
  * No overlap of loads and compute: now a STAGES-deep cp.async pipeline (sm_80+) over chunks of
    256 columns. The RAW weight blocks go to shared memory as they are in the repacked layout
    (`imp.kernels.cuda.quant_weight`: 16-byte pieces, adjacent threads adjacent pieces of a row: coalesced), and
    the B fragments are built from them directly (nibble masks / Q6_K's 4+2 bits, a few ALU ops a
    register): no int8 staging copy of the weights. Per chunk: wait for its copies, __syncthreads,
    issue the copies of chunk + STAGES - 1, decode the chunk's weight scales (and mins) once per
    (row, 32-block) into a small fp32 table, __syncthreads, then the mma + epilogue loop. Scales
    kept outside the blocks (Q4_0/Q4_1/Q8_0 d and m, Q6_K d) are read one chunk ahead into registers.
  * Tiles fit M: a block of WGM x WGN warps, each warp 16 MI x 8 NJ outputs; tiles of 16x64, 32x64,
    64x32, 64x64, 64x128 and 128x128 (`TILES`), picked by `pick_tile` from M, N, K and the SM count
    (`gemm_int8_act_tiles`, with each tile's shared memory)
    (warps whose rows lie wholly past M skip their mma and epilogue: one branch a chunk, outside the
    unrolled loop, so that ptxas can interleave the ldmatrix / mma / fp32 work of all the warp's fragments). Grid
    (ceil(M / BM), ceil(N / BN)), the token tiles fastest: the blocks that share weight rows run
    together (weights read once from DRAM, the small x stays in L2). Large tiles cut the L2 -> SM
    traffic (x is 256 bytes a row a chunk, Q4_K 144): per output and chunk 256 / BN + 144 / BM bytes.
  * Shared memory is dynamic (up to ~150 KB for 128x128 Q8_0): x rows padded to 272 bytes (ldmatrix
    rows on 8 distinct 4-bank groups), x scales 9 float2 a row, weight rows 144 / 272 / 144 / 208 bytes
    (Q4_0-Q4_1 / Q8_0 / Q4_K / Q6_K: fragment loads on 32 distinct banks).
Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k32", integer types), g = lane / 4, t = lane % 4:
    A 16x32 row: a0 row g, k 4t..4t+3 | a1 row g+8 | a2 row g, k 16+4t.. | a3 row g+8, k 16+4t..
      (= ldmatrix.x4 of rows 0-7 / 8-15, bytes 0-15 / 16-31; m16n8k16: {a0, a1} k 0..15, {a2, a3} k 16..31)
    B 32x8 col:  b0 col g, k 4t..4t+3 | b1 col g, k 16+4t..
    C 16x8 s32:  c0, c1 row g, cols 2t, 2t+1 | c2, c3 row g+8, cols 2t, 2t+1
"""

from __future__ import annotations

import torch

from imp.kernels.cuda import runtime as cu
from imp.kernels.cuda.gemm_int8_act_tiles import TILES, pick_tile, sm_count, smem_bytes, tile_dims
from imp.kernels.cuda.quant_weight import Q4K_SCALE_MIN_SRC, QWeight, check_parts, out_for
from imp.kernels.cuda.quantize_act_int8 import Q8Act

FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
KC = 256

SRC = Q4K_SCALE_MIN_SRC + r"""
typedef signed char i8;
#define KC 256
#define XS 272      // bytes a row of the x tile (256 + 16: ldmatrix rows on distinct banks)
#define XDS 9       // float2 a row of the x scale tile (8 + 1: conflict-free)
#define MAGIC_I 0x4B400000
#define MAGIC_F 12582912.f
#define F_Q4_0 0
#define F_Q4_1 1
#define F_Q8_0 2
#define F_Q4_K 3
#define F_Q6_K 4

// WB: shared bytes a weight row per chunk, PPR: 16-byte pieces copied a row per chunk,
// SQ: weight scales a row per chunk, MN: has a min per 32
template <int FMT> struct Fmt;
template <> struct Fmt<F_Q4_0> { enum { WB = 144, PPR = 8, SQ = 8, MN = 0 }; };
template <> struct Fmt<F_Q4_1> { enum { WB = 144, PPR = 8, SQ = 8, MN = 1 }; };
template <> struct Fmt<F_Q8_0> { enum { WB = 272, PPR = 16, SQ = 8, MN = 0 }; };
template <> struct Fmt<F_Q4_K> { enum { WB = 144, PPR = 9, SQ = 8, MN = 1 }; };
template <> struct Fmt<F_Q6_K> { enum { WB = 208, PPR = 13, SQ = 16, MN = 0 }; };

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}
// n < 16 / 8: the rest of the 16 / 8 bytes zero-filled (n = 0: nothing read)
__device__ __forceinline__ void cp16(unsigned dst, const void* src, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp8(unsigned dst, const void* src, int n) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" :: "r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
__device__ __forceinline__ void ldsm4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void mma32(int (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16(int (&c)[4], unsigned a0, unsigned a1, unsigned b0) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3]) : "r"(a0), "r"(a1), "r"(b0));
}
// (float)isum for an accumulator that started at MAGIC_I: exact for |isum| < 2^22
__device__ __forceinline__ float mfloat(int c) { return __fsub_rn(__int_as_float(c), MAGIC_F); }
// bytes in [0, 63] minus 32 / [0, 15] minus 8, as signed bytes (no borrow crosses a byte after the or)
__device__ __forceinline__ unsigned sub32(unsigned v) { return ((v | 0x80808080u) - 0x20202020u) ^ 0x80808080u; }
__device__ __forceinline__ unsigned sub8(unsigned v) { return ((v | 0x80808080u) - 0x08080808u) ^ 0x80808080u; }


// blocks an SM is meant to hold (the register budget ptxas gets): 256 threads 1 (at 2, i.e. 128 registers,
// 64x128 spills), 128 threads 4 (warp tile 16x16) or 3
#define QMM_MINB(MI, NJ, WGM, WGN) ((WGM) * (WGN) == 8 ? 1 : ((MI) * (NJ) <= 2 ? 4 : 3))

// Y [M, N] (row stride ldy) = q8(X) [M, K] . W [N, K]^T. Block: WGM x WGN warps, warp tile 16 MI x 8 NJ,
// block tile BM = 16 MI WGM x BN = 8 NJ WGN; grid (ceil(M / BM), ceil(N / BN)); dynamic shared memory
// STAGES x (x tile, x scales, raw weights) + the chunk's weight scale (and min) table.
template <int FMT, int MI, int NJ, int WGM, int WGN, int STAGES>
__global__ void __launch_bounds__(32 * WGM * WGN, QMM_MINB(MI, NJ, WGM, WGN)) qmm_q8(const u8* __restrict__ p0, const u16* __restrict__ p1,
                                                         const u16* __restrict__ p2, const i8* __restrict__ xq,
                                                         const float2* __restrict__ xds, float* __restrict__ y,
                                                         int ldy, int M, int N, int K) {
    constexpr int T = 32 * WGM * WGN, BM = 16 * MI * WGM, BN = 8 * NJ * WGN;
    constexpr int WB = Fmt<FMT>::WB, PPR = Fmt<FMT>::PPR, SQ = Fmt<FMT>::SQ, HASMN = Fmt<FMT>::MN;
    constexpr int XBYTES = BM * XS, XDBYTES = BM * XDS * 8, WBYTES = BN * WB;
    constexpr int STAGE = XBYTES + XDBYTES + WBYTES;
    static_assert(T % BN == 0 && (SQ * BN) % T == 0 && (BM * 16) % T == 0 && (BM * 8) % T == 0, "tile");
    static_assert(STAGE % 16 == 0, "stage alignment");
    extern __shared__ __align__(16) unsigned char sm[];
    float* Sc = (float*)(sm + STAGES * STAGE);  // [SQ][BN]: weight scale per 32 (Q6_K: per 16) of the chunk
    float* Mn = Sc + SQ * BN;                   // [8][BN]: weight min per 32 (formats with a min)
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int wm = (warp / WGN) * 16 * MI, wn = (warp % WGN) * 8 * NJ;
    const int nx = K >> 5, ns = K >> 8, nch = (K + KC - 1) / KC;
    const bool live = m0 + wm < M;  // this warp's rows: any real one (else it only copies and decodes)

    // ---- copies of chunk ch into stage s (one commit group a chunk, issued by the caller)
    auto load = [&](int s, int ch) {
        unsigned char* st = sm + s * STAGE;
        const unsigned xa = smem_u32(st), da = smem_u32(st + XBYTES), wa = smem_u32(st + XBYTES + XDBYTES);
        #pragma unroll
        for (int r = 0; r < BM * 16 / T; ++r) {  // x: BM rows x 16 pieces of 16 bytes; past M or K: zeros
            const int p = tid + T * r, m = p >> 4, c16 = p & 15;
            const int row = m0 + m, col = ch * KC + 16 * c16;
            const bool ok = row < M && col < K;
            cp16(xa + m * XS + 16 * c16, xq + (ok ? (size_t)row * K + col : 0), ok ? 16 : 0);
        }
        #pragma unroll
        for (int r = 0; r < BM * 8 / T; ++r) {  // x scales: BM rows x 8 float2
            const int p = tid + T * r, m = p >> 3, j = p & 7;
            const int row = m0 + m, b = ch * 8 + j;
            const bool ok = row < M && b < nx;
            cp8(da + (m * XDS + j) * 8, xds + (ok ? (size_t)row * nx + b : 0), ok ? 8 : 0);
        }
        constexpr int WP = BN * PPR, WR = (WP + T - 1) / T;
        #pragma unroll
        for (int r = 0; r < WR; ++r) {  // raw weights: BN rows x PPR pieces (rows past N: row N - 1, not written)
            const int p = tid + T * r;
            if (WP % T == 0 || p < WP) {
                const int n = p / PPR, c = p - n * PPR, row = min(n0 + n, N - 1);
                const u8* src;
                int bytes = 16;
                if (FMT == F_Q4_K) {
                    src = p0 + ((size_t)row * ns + ch) * 144 + 16 * c;
                } else if (FMT == F_Q6_K) {
                    src = p0 + ((size_t)row * ns + ch) * 208 + 16 * c;
                } else if (FMT == F_Q8_0) {  // two pieces a block of 32
                    const int b = ch * 8 + (c >> 1);
                    const bool ok = b < nx;
                    src = p0 + ((size_t)row * nx + (ok ? b : 0)) * 32 + 16 * (c & 1);
                    bytes = ok ? 16 : 0;
                } else {  // Q4_0 / Q4_1: one piece a block of 32
                    const int b = ch * 8 + c;
                    const bool ok = b < nx;
                    src = p0 + ((size_t)row * nx + (ok ? b : 0)) * 16;
                    bytes = ok ? 16 : 0;
                }
                cp16(wa + n * WB + 16 * c, src, bytes);
            }
        }
    };

    // ---- the chunk's weight scales: thread = (row sn, scale indices sq0 + SQS r); scales held outside the
    // blocks are read from global one chunk ahead (pre*)
    constexpr int SQS = T / BN, NE = SQ * BN / T;
    const int sn = tid % BN, sq0 = tid / BN, srow = min(n0 + sn, N - 1);
    u16 pre_d[NE], pre_m[NE];
    auto fetch = [&](int ch) {
        if (FMT == F_Q6_K) {
            pre_d[0] = ch < nch ? p1[(size_t)srow * ns + ch] : (u16)0;
        } else if (FMT != F_Q4_K) {
            #pragma unroll
            for (int r = 0; r < NE; ++r) {
                const int b = ch * 8 + sq0 + SQS * r;
                const bool ok = ch < nch && b < nx;  // past K: scale 0 (h2f(0) = +0), as the zero-filled blocks
                pre_d[r] = ok ? p1[(size_t)srow * nx + b] : (u16)0;
                if (FMT == F_Q4_1) pre_m[r] = ok ? p2[(size_t)srow * nx + b] : (u16)0;
            }
        }
    };
    auto decode = [&](int s) {
        const u8* wr = sm + s * STAGE + XBYTES + XDBYTES + sn * WB;
        if (FMT == F_Q4_K) {
            const uint4 h = *(const uint4*)wr;
            const float d = h2f((u16)(h.x & 0xffffu)), dmin = h2f((u16)(h.x >> 16));
            #pragma unroll
            for (int r = 0; r < NE; ++r) {
                const int q = sq0 + SQS * r;
                float sc, m;
                q4k_scale_min(q, h, sc, m);
                Sc[q * BN + sn] = d * sc;
                Mn[q * BN + sn] = -dmin * m;
            }
        } else if (FMT == F_Q6_K) {
            const float d = h2f(pre_d[0]);
            #pragma unroll
            for (int r = 0; r < NE; ++r) {
                const int q = sq0 + SQS * r;
                Sc[q * BN + sn] = d * (float)(signed char)wr[192 + q];
            }
        } else {
            #pragma unroll
            for (int r = 0; r < NE; ++r) {
                const int q = sq0 + SQS * r;
                Sc[q * BN + sn] = h2f(pre_d[r]);
                if (FMT == F_Q4_1) Mn[q * BN + sn] = h2f(pre_m[r]);
            }
        }
    };

    float acc[MI][NJ][4];
    #pragma unroll
    for (int i = 0; i < MI; ++i)
        #pragma unroll
        for (int j = 0; j < NJ; ++j)
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
    // ldmatrix.x4 row address of this lane: rows 0-7 / 8-15 (lanes 0-7, 16-23 / 8-15, 24-31), bytes 0 / 16
    const unsigned a_off = (unsigned)((wm + (lane & 7) + ((lane >> 3) & 1) * 8) * XS + (lane >> 4) * 16);

    #pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nch) load(s, s);
        cp_commit();
    }
    fetch(0);
    for (int ch = 0; ch < nch; ++ch) {
        const int s = ch % STAGES;
        cp_wait<STAGES - 2>();  // this thread's copies of chunk ch have landed
        __syncthreads();        // everyone's; and everyone is done with chunk ch - 1 (its stage, the scale table)
        {
            const int nxt = ch + STAGES - 1;
            if (nxt < nch) load(nxt % STAGES, nxt);
            cp_commit();
        }
        decode(s);
        fetch(ch + 1);
        __syncthreads();
        if (!live) continue;  // warp-uniform; no barrier below
        const unsigned char* st = sm + s * STAGE;
        const unsigned xa = smem_u32(st) + a_off;
        const float2* xd2 = (const float2*)(st + XBYTES);
        const u8* wr = st + XBYTES + XDBYTES;
        unsigned wv[NJ][6];  // raw weight words of this lane's B fragments, reused over 2 (Q4_K) / 4 (Q6_K) blocks
        #pragma unroll
        for (int kk = 0; kk < 8; ++kk) {  // blocks of 32 in the chunk
            unsigned b[NJ][2];
            #pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const u8* wrow = wr + (wn + 8 * j + g) * WB + 4 * t;
                if (FMT == F_Q4_K) {  // pair kk / 2: 32 bytes, low nibbles sub-block kk (even), high kk + 1
                    if ((kk & 1) == 0) {
                        wv[j][0] = *(const unsigned*)(wrow + 16 + 32 * (kk >> 1));
                        wv[j][1] = *(const unsigned*)(wrow + 16 + 32 * (kk >> 1) + 16);
                    }
                    const int sh = 4 * (kk & 1);
                    b[j][0] = (wv[j][0] >> sh) & 0x0f0f0f0fu;
                    b[j][1] = (wv[j][1] >> sh) & 0x0f0f0f0fu;
                } else if (FMT == F_Q6_K) {  // half h = kk / 4 (128 elements), quarter k = kk % 4
                    const int h = kk >> 2, k = kk & 3;
                    if (k == 0) {
                        #pragma unroll
                        for (int q = 0; q < 4; ++q) wv[j][q] = *(const unsigned*)(wrow + 64 * h + 16 * q);
                        wv[j][4] = *(const unsigned*)(wrow + 128 + 32 * h);
                        wv[j][5] = *(const unsigned*)(wrow + 128 + 32 * h + 16);
                    }
                    #pragma unroll
                    for (int c = 0; c < 2; ++c) {  // c: elements 16 c + 4t.. of the quarter
                        const unsigned a = wv[j][2 * (k & 1) + c];
                        const unsigned lo = (k >> 1) ? ((a >> 4) & 0x0f0f0f0fu) : (a & 0x0f0f0f0fu);
                        const unsigned hi = ((wv[j][4 + c] >> (2 * k)) & 0x03030303u) << 4;
                        b[j][c] = sub32(lo | hi);
                    }
                } else if (FMT == F_Q8_0) {
                    b[j][0] = *(const unsigned*)(wrow + 32 * kk);
                    b[j][1] = *(const unsigned*)(wrow + 32 * kk + 16);
                } else {  // Q4_0 / Q4_1: low nibbles elements 0..15, high 16..31
                    const unsigned w = *(const unsigned*)(wrow + 16 * kk);
                    b[j][0] = w & 0x0f0f0f0fu;
                    b[j][1] = (w >> 4) & 0x0f0f0f0fu;
                    if (FMT == F_Q4_0) { b[j][0] = sub8(b[j][0]); b[j][1] = sub8(b[j][1]); }
                }
            }
            float2 sc[NJ][2], mn[NJ];  // this lane's two columns: wn + 8j + 2t, + 1
            #pragma unroll
            for (int j = 0; j < NJ; ++j) {
                const int nc = wn + 8 * j + 2 * t;
                if (FMT == F_Q6_K) {
                    sc[j][0] = *(const float2*)(Sc + (2 * kk) * BN + nc);
                    sc[j][1] = *(const float2*)(Sc + (2 * kk + 1) * BN + nc);
                } else {
                    sc[j][0] = *(const float2*)(Sc + kk * BN + nc);
                }
                if (HASMN) mn[j] = *(const float2*)(Mn + kk * BN + nc);
            }
            #pragma unroll
            for (int i = 0; i < MI; ++i) {
                {
                    unsigned a[4];
                    ldsm4(a, xa + i * 16 * XS + 32 * kk);
                    float2 xv[2];  // (xd, xs) of rows g, g + 8 of the slice
                    xv[0] = xd2[(wm + 16 * i + g) * XDS + kk];
                    xv[1] = xd2[(wm + 16 * i + g + 8) * XDS + kk];
                    #pragma unroll
                    for (int j = 0; j < NJ; ++j) {
                        if (FMT == F_Q6_K) {
                            int lo[4] = {MAGIC_I, MAGIC_I, MAGIC_I, MAGIC_I}, hi[4] = {MAGIC_I, MAGIC_I, MAGIC_I, MAGIC_I};
                            mma16(lo, a[0], a[1], b[j][0]);
                            mma16(hi, a[2], a[3], b[j][1]);
                            #pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const float xd = (e >> 1) ? xv[1].x : xv[0].x;
                                const float s0 = (e & 1) ? sc[j][0].y : sc[j][0].x;
                                const float s1 = (e & 1) ? sc[j][1].y : sc[j][1].x;
                                acc[i][j][e] = fmaf(__fmul_rn(xd, s0), mfloat(lo[e]), acc[i][j][e]);
                                acc[i][j][e] = fmaf(__fmul_rn(xd, s1), mfloat(hi[e]), acc[i][j][e]);
                            }
                        } else {
                            int c[4] = {MAGIC_I, MAGIC_I, MAGIC_I, MAGIC_I};
                            mma32(c, a, b[j][0], b[j][1]);
                            #pragma unroll
                            for (int e = 0; e < 4; ++e) {
                                const float2 x = (e >> 1) ? xv[1] : xv[0];
                                const float s0 = (e & 1) ? sc[j][0].y : sc[j][0].x;
                                if (HASMN) acc[i][j][e] = fmaf(x.y, (e & 1) ? mn[j].y : mn[j].x, acc[i][j][e]);
                                acc[i][j][e] = fmaf(__fmul_rn(x.x, s0), mfloat(c[e]), acc[i][j][e]);
                            }
                        }
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int i = 0; i < MI; ++i)
        #pragma unroll
        for (int j = 0; j < NJ; ++j)
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


def _name(fmt: str, tile: str) -> str:
    return f"qmm_q8<{_FMT_ID[fmt]}, {', '.join(str(v) for v in TILES[tile])}>"


_NAMES_BY_FMT = {f: tuple(_name(f, t) for t in TILES) for f in FORMATS}
_NAMES = tuple(n for f in FORMATS for n in _NAMES_BY_FMT[f])
_smem_set: set[tuple[int, int]] = set()


def _kernel(fmt: str, tile: str):
    fn = cu.function(SRC, _name(fmt, tile), _NAMES_BY_FMT[fmt])
    smem = smem_bytes(fmt, tile)
    key = (id(fn), smem)
    if smem > 48 * 1024 and key not in _smem_set:  # above the default 48 KB: opt in (once per function)
        fn.max_dynamic_shared_size_bytes = smem
        _smem_set.add(key)
    return fn, smem


def qmm(w: QWeight, xa: Q8Act, out: torch.Tensor | None = None, tile: str | None = None) -> torch.Tensor:
    """out [M, N] fp32 (may be a column slice of a wider buffer) = dequant(xa) @ dequant(W).T.
    `tile` (a key of TILES) overrides `pick_tile` (benchmarks, tuning)."""
    if w.fmt not in FORMATS:
        raise ValueError(f"no int8 tensor-core GEMM for {w.fmt} (have {FORMATS})")
    M, K = xa.shape
    if K != w.cols:
        raise ValueError(f"x has {K} columns, weight {w.cols}")
    if tile is not None and tile not in TILES:
        raise ValueError(f"unknown tile {tile!r} (have {tuple(TILES)})")
    out = out_for(w, M, out, xa.xq.device)
    if M == 0:
        return out
    check_parts(w, _PARTS[w.fmt], xa.xq.device)
    parts = [w.parts[k] if k is not None else None for k in _PARTS[w.fmt]]
    if tile is None:
        tile = pick_tile(w.fmt, M, w.rows, K, sm_count(xa.xq.device.index or 0))
    fn, smem = _kernel(w.fmt, tile)
    BM, BN, thr = tile_dims(tile)
    cu.launch(fn, (-(-M // BM), -(-w.rows // BN)), (thr,), tuple(cu.ptr(t) for t in parts) + (
        cu.ptr(xa.xq), cu.ptr(xa.xds), cu.ptr(out), cu.i32(out.stride(0)), cu.i32(M), cu.i32(w.rows), cu.i32(K)),
        shared_mem=smem)
    return out
