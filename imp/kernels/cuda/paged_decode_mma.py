"""Decode attention on tensor cores, rows that share a cached prefix reading it once (issue 39: cascade decode).

Why: agents in parallel share their system prompt and tools (10-30k tokens, the same KV blocks through the prefix
cache), and `paged_decode_split` streams a row's whole context for every row: 16 rows after a 16k shared prompt
read 16 x 2.1 GB a step on the 8B shape, where llama.cpp's batched attention reads the prompt once (3-5x ours).

How: a decode row's G query heads are G rows of an m16n8k16 MMA tile (paged_prefill's arithmetic: Q and the
probabilities in bf16, fp32 accumulators, 32-key tiles aligned to absolute positions, an online softmax a
row). A warp holds 16 / G sequences' heads and a block four warps, so one staged key tile serves up to 64 / G
rows of sequences whose block tables hold the same blocks there. A row's keys are cut into segments of `seg`
absolute positions, each an online softmax of its own written as a partial (o, max, sum); a second kernel merges
a row's partials in segment order (`seg_merge`, as paged_prefill_combine). The work is a list of items
(sequences, segments [sb, se)): the segments a group shares as one item list over the group, the rest of each
row's segments as items of one sequence.

Bits: an MMA's output row depends on its own A row and the B columns only, and every other step is a row's own
(quad shuffles within its lanes), so a row's partial for a segment is the same whether it was computed beside
other sequences or alone, and whatever the items' cut: a row's output is a function of its keys and `seg` alone
(batch invariant). The bits differ from paged_decode_split's (another arithmetic): a server uses one kernel for
every decode row.

The plan (which rows share what) is made on the device from the step's block tables and lengths by one small
kernel a forward (`decode_plan`, one block), so a CUDA graph captured once serves every sharing pattern; the
items' count is fixed per batch bucket (`capacity`) and unused items exit. `plan_host` is the same plan in numpy
(the reference the GPU lane compares the device's with, and the CPU tests' subject).

Shapes: q [B, >= H*D] fp32, kc/vc [num_blocks, bs, Hkv, D] bf16, bt [B, max_blocks] int32, lens [B] int32
(0 -> zeros), items [cap, 4] int32 (rl offset, sequences, first segment, end segment), rl [2B] int32 (row lists),
part [B, H, nseg_max, D + 2] fp32, out [B, H*D] fp32 or its int8 form (q8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from imp.kernels.cuda import paged_prefill_attention as k_pf
from imp.kernels.cuda import quantize_act_int8
from imp.kernels.cuda import runtime as cu
from imp.kernels.cuda.paged_decode_attention import check_args, outputs
from imp.kernels.cuda.paged_decode_split import PUT_OUT, seg_keys_for

WARPS = 4  # warps a block: 16 rows each
MAX_ROWS = 256  # decode rows one plan takes (its shared arrays)

SRC = k_pf.SRC + quantize_act_int8.DEVICE + PUT_OUT + r"""
#define DM_WARPS 4
#define DP_MAXB 256

// grid (cap, Hkv), 128 threads. Item it: sequences rl[off .. off + nseq), segments [sb, se). Warp w holds sequences
// w * SPW .. w * SPW + SPW - 1 (SPW = 16 / G), its row m = sequence m / G, head m % G. The keys are the first
// sequence's (the others hold the same blocks there: the plan's promise). Dynamic shared memory: Q [4][16][D + 8],
// K and V [2][32][D + 8] each (`smem_bytes`).
template <int D>
__global__ void __launch_bounds__(128) paged_decode_mma(
    const float* __restrict__ q, int ldq, const u16* __restrict__ kc, const u16* __restrict__ vc,
    const int* __restrict__ bt, int max_blocks, const int* __restrict__ ctx_lens,
    const int* __restrict__ items, const int* __restrict__ rl, int H, int Hkv, int bs, float scale_log2,
    int seg, int nseg_max, float* __restrict__ part) {
    constexpr int KS = D / 16;        // k-steps of S = Q K^T
    constexpr int NT = D / 8;         // n-tiles of O
    constexpr int KP = D + 8;         // padded row (bf16)
    extern __shared__ __align__(16) unsigned char dm_sm[];
    u16* Qs = (u16*)dm_sm;            // [DM_WARPS][16][KP]
    u16* Ks = Qs + DM_WARPS * 16 * KP;
    u16* Vs = Ks + 2 * 32 * KP;
    const int it = blockIdx.x, kvh = blockIdx.y;
    const int off = items[it * 4], nseq = items[it * 4 + 1], sb = items[it * 4 + 2], se = items[it * 4 + 3];
    if (nseq <= 0 || sb >= se) return;  // the whole block: an unused item
    const int G = H / Hkv, SPW = 16 / G;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool busy = warp * SPW < nseq;  // this warp has rows
    int ra = -1, rb = -1, ha = 0, hb = 0, pa = -1, pb = -1;  // rows g and g + 8: batch row, head, last position
    {
        const int ja = g / G, jb = (g + 8) / G;
        if (ja < SPW && warp * SPW + ja < nseq) { ra = rl[off + warp * SPW + ja]; ha = kvh * G + g % G; pa = ctx_lens[ra] - 1; }
        if (jb < SPW && warp * SPW + jb < nseq) { rb = rl[off + warp * SPW + jb]; hb = kvh * G + (g + 8) % G; pb = ctx_lens[rb] - 1; }
    }
    for (int i = threadIdx.x; i < DM_WARPS * 16 * (D / 2); i += blockDim.x) {  // Q: column pairs, unused rows zero
        const int w = i / (16 * (D / 2)), m = (i / (D / 2)) % 16, c = 2 * (i % (D / 2));
        const int j = m / G, jj = w * SPW + j;
        float2 v = make_float2(0.f, 0.f);
        if (j < SPW && jj < nseq)
            v = *(const float2*)(q + (size_t)rl[off + jj] * ldq + (size_t)(kvh * G + m % G) * D + c);
        *(unsigned*)(Qs + (w * 16 + m) * KP + c) = pack_bf2(v.x, v.y);
    }
    const int first = rl[off];
    const int* btr = bt + (size_t)first * max_blocks;
    const int kend = min(se * seg, ctx_lens[first]);
    const size_t tok = (size_t)Hkv * D;
    for (int s = sb; s < se; ++s) {
        const int k0s = s * seg, last = min(kend, k0s + seg) - 1;
        if (k0s > last) break;
        float o[NT][4];
        float ma = NEG_INF, mb = NEG_INF, la = 0.f, lb = 0.f;  // rows g, g + 8: running max (log2 units), lane's sum
        #pragma unroll
        for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
        pf_stage<D>(Ks, Vs, kc, vc, btr, k0s, last, bs, tok, kvh);
        int buf = 0;
        for (int k0 = k0s; k0 <= last; k0 += 32, buf ^= 1) {
            if (k0 + 32 <= last) {
                pf_stage<D>(Ks + (buf ^ 1) * 32 * KP, Vs + (buf ^ 1) * 32 * KP, kc, vc, btr, k0 + 32, last, bs, tok, kvh);
                pf_wait<1>();
            } else {
                pf_wait<0>();
            }
            __syncthreads();  // the key tile (and, the first time, Q) is in shared memory for every warp
            if (busy) {
                const u16* Kb = Ks + buf * 32 * KP;
                const u16* Vb = Vs + buf * 32 * KP;
                float sc[4][4];
                #pragma unroll
                for (int n = 0; n < 4; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
                #pragma unroll
                for (int ks = 0; ks < KS; ++ks) {
                    unsigned qa[4];
                    ldsm_x4(qa[0], qa[1], qa[2], qa[3], Qs + (warp * 16 + (lane & 15)) * KP + ks * 16 + (lane >> 4) * 8);
                    #pragma unroll
                    for (int n = 0; n < 4; ++n) {
                        const u16* kr = Kb + (n * 8 + g) * KP + ks * 16 + 2 * t;
                        mma_bf16(sc[n], qa, *(const unsigned*)kr, *(const unsigned*)(kr + 8));
                    }
                }
                unsigned pf[4][2];
                float mxa = NEG_INF, mxb = NEG_INF;
                #pragma unroll
                for (int n = 0; n < 4; ++n) {
                    #pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int kp = k0 + n * 8 + 2 * t + e;
                        sc[n][e] = (kp <= pa) ? sc[n][e] * scale_log2 : NEG_INF;
                        sc[n][2 + e] = (kp <= pb) ? sc[n][2 + e] * scale_log2 : NEG_INF;
                        mxa = fmaxf(mxa, sc[n][e]);
                        mxb = fmaxf(mxb, sc[n][2 + e]);
                    }
                }
                mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 1));
                mxa = fmaxf(mxa, __shfl_xor_sync(0xffffffffu, mxa, 2));
                mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 1));
                mxb = fmaxf(mxb, __shfl_xor_sync(0xffffffffu, mxb, 2));
                const float na = fmaxf(ma, mxa), nb = fmaxf(mb, mxb);
                const float ca = (na == NEG_INF) ? 1.f : exp2f(ma - na);
                const float cb = (nb == NEG_INF) ? 1.f : exp2f(mb - nb);
                ma = na; mb = nb;
                la *= ca; lb *= cb;
                #pragma unroll
                for (int n = 0; n < NT; ++n) { o[n][0] *= ca; o[n][1] *= ca; o[n][2] *= cb; o[n][3] *= cb; }
                #pragma unroll
                for (int n = 0; n < 4; ++n) {
                    const float p0 = (na == NEG_INF) ? 0.f : exp2f(sc[n][0] - na);
                    const float p1 = (na == NEG_INF) ? 0.f : exp2f(sc[n][1] - na);
                    const float p2 = (nb == NEG_INF) ? 0.f : exp2f(sc[n][2] - nb);
                    const float p3 = (nb == NEG_INF) ? 0.f : exp2f(sc[n][3] - nb);
                    pf[n][0] = pack_bf2(p0, p1);
                    pf[n][1] = pack_bf2(p2, p3);
                    la += bf2f((u16)(pf[n][0] & 0xffffu)) + bf2f((u16)(pf[n][0] >> 16));
                    lb += bf2f((u16)(pf[n][1] & 0xffffu)) + bf2f((u16)(pf[n][1] >> 16));
                }
                #pragma unroll
                for (int kk = 0; kk < 2; ++kk) {
                    const unsigned a[4] = {pf[2 * kk][0], pf[2 * kk][1], pf[2 * kk + 1][0], pf[2 * kk + 1][1]};
                    #pragma unroll
                    for (int n = 0; n < NT; n += 2) {
                        unsigned b0, b1, b2, b3;
                        ldsm_x4_t(b0, b1, b2, b3, Vb + (kk * 16 + (lane & 15)) * KP + (n + (lane >> 4)) * 8);
                        mma_bf16(o[n], a, b0, b1);
                        mma_bf16(o[n + 1], a, b2, b3);
                    }
                }
            }
            __syncthreads();  // this buffer is the next-but-one tile's: every warp is done with it
        }
        la += __shfl_xor_sync(0xffffffffu, la, 1);
        la += __shfl_xor_sync(0xffffffffu, la, 2);
        lb += __shfl_xor_sync(0xffffffffu, lb, 1);
        lb += __shfl_xor_sync(0xffffffffu, lb, 2);
        float* qa_ = ra >= 0 ? part + (((size_t)ra * H + ha) * nseg_max + s) * (D + 2) : nullptr;
        float* qb_ = rb >= 0 ? part + (((size_t)rb * H + hb) * nseg_max + s) * (D + 2) : nullptr;
        #pragma unroll
        for (int n = 0; n < NT; ++n) {
            const int c = n * 8 + 2 * t;
            if (qa_) *(float2*)(qa_ + c) = make_float2(o[n][0], o[n][1]);
            if (qb_) *(float2*)(qb_ + c) = make_float2(o[n][2], o[n][3]);
        }
        if (t == 0 && qa_) { qa_[D] = ma; qa_[D + 1] = la; }
        if (t == 0 && qb_) { qb_[D] = mb; qb_[D + 1] = lb; }
    }
}

// grid (B, H), D threads: row b's segments merged in order (paged_prefill_combine's roundings), then O / L.
template <int D, bool Q8>
__global__ void __launch_bounds__(D) paged_decode_mma_merge(
    const int* __restrict__ ctx_lens, const float* __restrict__ part, int seg, int nseg_max, int H,
    float* __restrict__ out, int ldo, signed char* __restrict__ xq, float2* __restrict__ xds) {
    const int b = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
    const int L = ctx_lens[b];
    const int nseg = L > 0 ? min(nseg_max, (L + seg - 1) / seg) : 0;
    const float* pr = part + ((size_t)b * H + h) * nseg_max * (D + 2);
    float M = NEG_INF, S = 0.f, O = 0.f;
    for (int s = 0; s < nseg; ++s, pr += D + 2) {
        float a = 0.f, w = 0.f;
        const int how = seg_merge(M, S, pr[D], pr[D + 1], a, w);
        if (how) O = seg_mix(how, O, a, pr[c], w);
    }
    const float inv = (S > 0.f) ? 1.f / S : 0.f;
    put_out<Q8>(O * inv, b, h, c, H, D, out, ldo, xq, xds);
}

// One block (up to 1024 threads), B <= DP_MAXB rows: which rows share which segments, and the items.
// 1. A row's group leader: the first row whose table starts with the same block (both longer than a segment).
// 2. sh: whole segments a member shares with its leader (equal block ids, within both contexts); a member
//    sharing none leaves the group; the leader's sh is its members' largest.
// 3. A group's rows by sh (descending, then index) into rl, tiles of R rows; a tile of two or more shares the
//    segments its last row shares (the least): those are one tile's items, the rest each row's own.
// 4. Items of c segments, c = ceil(work / target) (more if the count passes cap); the rest of items zeroed.
__global__ void __launch_bounds__(1024) decode_plan(
    const int* __restrict__ bt, int max_blocks, const int* __restrict__ lens, int B, int bs, int seg, int R,
    int cap, int target, int* __restrict__ items, int* __restrict__ rl) {
    __shared__ int sL[DP_MAXB], lead[DP_MAXB], sh[DP_MAXB], rk[DP_MAXB], own[DP_MAXB], goff[DP_MAXB], gcnt[DP_MAXB];
    __shared__ int s_base;
    const int tid = threadIdx.x, nthr = blockDim.x, warp = tid >> 5, lane = tid & 31, nwarp = nthr >> 5;
    for (int i = tid; i < cap * 4; i += nthr) items[i] = 0;
    for (int b = tid; b < B; b += nthr) sL[b] = lens[b];
    __syncthreads();
    for (int b = tid; b < B; b += nthr) {
        int ld = b;
        if (sL[b] > seg) {
            const int f = bt[(size_t)b * max_blocks];
            for (int b2 = 0; b2 < b; ++b2)
                if (sL[b2] > seg && bt[(size_t)b2 * max_blocks] == f) { ld = b2; break; }
        }
        lead[b] = ld;
        sh[b] = 0;
    }
    __syncthreads();
    for (int b = warp; b < B; b += nwarp) {  // a warp a member: the first block where its table and the leader's part
        const int ld = lead[b];
        if (ld == b) continue;
        const int Lm = min(sL[b], sL[ld]);
        const int nb = (Lm - 1) / bs + 1;
        const int* r1 = bt + (size_t)b * max_blocks;
        const int* r2 = bt + (size_t)ld * max_blocks;
        int cp = nb;
        for (int k0 = 0; k0 < nb; k0 += 32) {
            const int k = k0 + lane;
            const unsigned ne = __ballot_sync(0xffffffffu, k < nb && r1[k] != r2[k]);
            if (ne) { cp = k0 + __ffs(ne) - 1; break; }
        }
        if (lane == 0) sh[b] = min(cp * bs, Lm) / seg;
    }
    __syncthreads();
    for (int b = tid; b < B; b += nthr)
        if (lead[b] != b && sh[b] == 0) lead[b] = b;
    __syncthreads();
    for (int b = tid; b < B; b += nthr) {
        gcnt[b] = 0;
        if (lead[b] != b) continue;
        int m = 0, n = 1;
        for (int b2 = b + 1; b2 < B; ++b2)
            if (lead[b2] == b) { m = max(m, sh[b2]); ++n; }
        sh[b] = m;  // (members' sh are not written here: only leaders')
        gcnt[b] = n;
    }
    __syncthreads();
    for (int b = tid; b < B; b += nthr) {
        const int ld = lead[b];
        int r = 0;
        if (gcnt[ld] > 1)
            for (int b2 = ld; b2 < B; ++b2)
                if (b2 != b && lead[b2] == ld && (sh[b2] > sh[b] || (sh[b2] == sh[b] && b2 < b))) ++r;
        rk[b] = r;
    }
    __syncthreads();
    if (tid == 0) {
        int cur = 0;
        for (int b = 0; b < B; ++b)
            if (lead[b] == b && gcnt[b] > 1) { goff[b] = cur; cur += gcnt[b]; }
        s_base = cur;
    }
    __syncthreads();
    for (int b = tid; b < B; b += nthr) {
        const int ld = lead[b];
        if (gcnt[ld] > 1) rl[goff[ld] + rk[b]] = b;
        rl[s_base + b] = b;
    }
    __syncthreads();
    for (int b = tid; b < B; b += nthr) {
        const int ld = lead[b];
        own[b] = 0;
        if (gcnt[ld] > 1) {
            const int f = rk[b] / R * R, l = min(gcnt[ld], f + R) - 1;
            if (l > f) own[b] = sh[rl[goff[ld] + l]];
        }
    }
    __syncthreads();
    if (tid != 0) return;
    int work = 0;
    for (int b = 0; b < B; ++b) {
        work += max(0, (sL[b] + seg - 1) / seg - own[b]);
        if (lead[b] == b && gcnt[b] > 1)
            for (int f = 0; f + 1 < gcnt[b]; f += R)
                work += sh[rl[goff[b] + min(gcnt[b], f + R) - 1]];
    }
    int c = max(1, (work + target - 1) / target);
    for (;; ++c) {
        int n = 0;
        for (int b = 0; b < B; ++b) {
            n += (max(0, (sL[b] + seg - 1) / seg - own[b]) + c - 1) / c;
            if (lead[b] == b && gcnt[b] > 1)
                for (int f = 0; f + 1 < gcnt[b]; f += R)
                    n += (sh[rl[goff[b] + min(gcnt[b], f + R) - 1]] + c - 1) / c;
        }
        if (n <= cap) break;
    }
    int n = 0;
    for (int b = 0; b < B; ++b) {  // a group's tiles at its leader, then the leader's own segments, in row order
        if (lead[b] == b && gcnt[b] > 1)
            for (int f = 0; f + 1 < gcnt[b]; f += R) {
                const int k = min(gcnt[b], f + R), s1 = sh[rl[goff[b] + k - 1]];
                for (int a = 0; a < s1; a += c, ++n) {
                    items[n * 4] = goff[b] + f; items[n * 4 + 1] = k - f; items[n * 4 + 2] = a; items[n * 4 + 3] = min(s1, a + c);
                }
            }
        const int ns = (sL[b] + seg - 1) / seg;
        for (int a = own[b]; a < ns; a += c, ++n) {
            items[n * 4] = s_base + b; items[n * 4 + 1] = 1; items[n * 4 + 2] = a; items[n * 4 + 3] = min(ns, a + c);
        }
    }
}
"""

_NAMES = ("paged_decode_mma<64>", "paged_decode_mma<128>",
          "paged_decode_mma_merge<64, false>", "paged_decode_mma_merge<64, true>",
          "paged_decode_mma_merge<128, false>", "paged_decode_mma_merge<128, true>", "decode_plan")

_smem_set: dict[int, int] = {}


def smem_bytes(d: int) -> int:
    """The attention kernel's dynamic shared memory: Q rows of four warps, two K and two V key tiles (bf16)."""
    return (WARPS * 16 + 4 * k_pf.KT) * (d + 8) * 2


def supports(n_heads: int, n_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> bool:
    """bf16 caches, D 64 or 128, a group of at most 16 query heads (one warp's rows hold a sequence's)."""
    return (kv_dtype == torch.bfloat16 and head_dim in (64, 128) and n_heads % n_kv_heads == 0
            and n_heads // n_kv_heads <= 16)


def per_tile(group: int) -> int:
    """R: sequences one item's block holds (four warps of 16 // G)."""
    return WARPS * (16 // group)


def capacity(rows: int, target: int) -> int:
    """Items a plan of `rows` rows may make (its launch's grid): the target count, plus one a row and one a tile
    for the rounding up of each one's share (the plan raises its items' size past this)."""
    return target + 2 * rows


def target_items(sms: int, n_kv_heads: int) -> int:
    """Items that fill the SMs twice over (a block an item and KV head)."""
    return max(1, -(-2 * sms // max(1, n_kv_heads)))


@dataclass(frozen=True)
class Shape:
    """A server's constants for this kernel: the segment (bits depend on it), the rows a tile, the items' target."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    seg: int
    nseg_max: int
    target: int

    @classmethod
    def of(cls, n_heads: int, n_kv_heads: int, head_dim: int, max_ctx: int, sms: int) -> Shape:
        seg = seg_keys_for(max_ctx)
        return cls(n_heads, n_kv_heads, head_dim, seg, max(1, -(-max_ctx // seg)), target_items(sms, n_kv_heads))

    @property
    def rows_a_tile(self) -> int:
        return per_tile(self.n_heads // self.n_kv_heads)


class Work:
    """Buffers for up to `rows` rows, made once (a graph holds them): partials, items and row lists."""

    def __init__(self, shape: Shape, rows: int, device):
        self.shape, self.rows = shape, rows
        self.cap = capacity(rows, shape.target)
        self.part = torch.empty(rows * shape.n_heads * shape.nseg_max * (shape.head_dim + 2), dtype=torch.float32,
                                device=device)
        self.items = torch.zeros(self.cap, 4, dtype=torch.int32, device=device)
        self.rl = torch.zeros(2 * rows, dtype=torch.int32, device=device)


def decode_plan(bt: torch.Tensor, lens: torch.Tensor, bs: int, work: Work) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's items and row lists (views of work's buffers for lens' rows), made on the device."""
    B, sh = lens.shape[0], work.shape
    if B > work.rows or B > MAX_ROWS:
        raise ValueError(f"{B} rows: the plan's buffers hold {min(work.rows, MAX_ROWS)}")
    cap = capacity(B, sh.target)
    items, rl = work.items[:cap], work.rl[:2 * B]
    fn = cu.function(SRC, "decode_plan", _NAMES)
    cu.launch(fn, (1,), (512,), (
        cu.ptr(bt), cu.i32(bt.shape[1]), cu.ptr(lens), cu.i32(B), cu.i32(bs), cu.i32(sh.seg), cu.i32(sh.rows_a_tile),
        cu.i32(cap), cu.i32(sh.target), cu.ptr(items), cu.ptr(rl)))
    return items, rl


def paged_decode_mma(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bt: torch.Tensor, lens: torch.Tensor,
                     work: Work, out: torch.Tensor | None = None, q8: bool = False,
                     plan: tuple[torch.Tensor, torch.Tensor] | None = None):
    """paged_decode's contract (q [B, >= H*D] fp32, kc/vc bf16 [num_blocks, bs, Hkv, D], bt [B, max_blocks] int32,
    lens [B] int32, 0 -> zeros) -> out [B, H*D] fp32, or with q8 the output quantized. plan: `decode_plan`'s
    (items, rl) for these rows (a forward makes it once for every layer); None: made here."""
    sh = work.shape
    H = sh.n_heads
    B, bs, Hkv, D = check_args(q, kc, vc, bt, lens, H)
    if kc.dtype != torch.bfloat16 or not supports(H, Hkv, D, kc.dtype) or Hkv != sh.n_kv_heads or D != sh.head_dim:
        raise ValueError(f"unsupported: H {H}, Hkv {Hkv}, D {D}, {kc.dtype}")
    out, xa = outputs(q, B, H * D, out, q8)
    if B == 0:
        return xa if q8 else out
    if B > work.rows:  # an eager step past the graphs' largest batch
        work = Work(sh, B, q.device)
    items, rl = plan if plan is not None else decode_plan(bt, lens, bs, work)
    fn = cu.function(SRC, f"paged_decode_mma<{D}>", _NAMES)
    smem = smem_bytes(D)
    if id(fn) not in _smem_set:
        _smem_set[id(fn)] = fn.max_dynamic_shared_size_bytes = smem
    cu.launch(fn, (items.shape[0], Hkv), (32 * WARPS,), (
        cu.ptr(q), cu.i32(q.stride(0)), cu.ptr(kc), cu.ptr(vc), cu.ptr(bt), cu.i32(bt.shape[1]), cu.ptr(lens),
        cu.ptr(items), cu.ptr(rl), cu.i32(H), cu.i32(Hkv), cu.i32(bs), cu.f32(math.log2(math.e) / math.sqrt(D)),
        cu.i32(sh.seg), cu.i32(sh.nseg_max), cu.ptr(work.part)), shared_mem=smem)
    mg = cu.function(SRC, f"paged_decode_mma_merge<{D}, {'true' if q8 else 'false'}>", _NAMES)
    cu.launch(mg, (B, H), (D,), (
        cu.ptr(lens), cu.ptr(work.part), cu.i32(sh.seg), cu.i32(sh.nseg_max), cu.i32(H),
        cu.ptr(out), cu.i32(0 if out is None else out.stride(0)),
        cu.ptr(None if xa is None else xa.xq), cu.ptr(None if xa is None else xa.xds)))
    return xa if q8 else out


def plan_host(bt: np.ndarray, lens: np.ndarray, bs: int, seg: int, R: int, cap: int, target: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """`decode_plan` in numpy, step for step: (items [cap, 4] int32, rl [2B] int32)."""
    B = len(lens)
    L = np.asarray(lens, np.int64)
    lead = np.arange(B)
    for b in range(B):
        if L[b] > seg:
            for b2 in range(b):
                if L[b2] > seg and bt[b2, 0] == bt[b, 0]:
                    lead[b] = b2
                    break
    sh = np.zeros(B, np.int64)
    for b in range(B):
        ld = lead[b]
        if ld == b:
            continue
        lm = min(L[b], L[ld])
        nb = (lm - 1) // bs + 1
        ne = np.flatnonzero(bt[b, :nb] != bt[ld, :nb])
        cp = int(ne[0]) if ne.size else nb
        sh[b] = min(cp * bs, lm) // seg
    lead[(lead != np.arange(B)) & (sh == 0)] = np.flatnonzero((lead != np.arange(B)) & (sh == 0))
    gcnt = np.zeros(B, np.int64)
    for b in range(B):
        if lead[b] == b:
            mem = [b2 for b2 in range(b + 1, B) if lead[b2] == b]
            sh[b] = max((sh[m] for m in mem), default=0)
            gcnt[b] = 1 + len(mem)
    rk = np.zeros(B, np.int64)
    for b in range(B):
        ld = lead[b]
        if gcnt[ld] > 1:
            rk[b] = sum(1 for b2 in range(ld, B) if b2 != b and lead[b2] == ld
                        and (sh[b2] > sh[b] or (sh[b2] == sh[b] and b2 < b)))
    goff = np.zeros(B, np.int64)
    cur = 0
    for b in range(B):
        if lead[b] == b and gcnt[b] > 1:
            goff[b] = cur
            cur += gcnt[b]
    base = cur
    rl = np.zeros(2 * B, np.int32)
    for b in range(B):
        if gcnt[lead[b]] > 1:
            rl[goff[lead[b]] + rk[b]] = b
        rl[base + b] = b
    own = np.zeros(B, np.int64)
    for b in range(B):
        ld = lead[b]
        if gcnt[ld] > 1:
            f = rk[b] // R * R
            last = min(gcnt[ld], f + R) - 1
            if last > f:
                own[b] = sh[rl[goff[ld] + last]]
    nseg = (L + seg - 1) // seg

    def tiles(b):
        return [(f, min(gcnt[b], f + R), sh[rl[goff[b] + min(gcnt[b], f + R) - 1]])
                for f in range(0, gcnt[b] - 1, R)] if lead[b] == b and gcnt[b] > 1 else []

    work = sum(max(0, nseg[b] - own[b]) + sum(s1 for _, _, s1 in tiles(b)) for b in range(B))
    c = max(1, -(-int(work) // target))
    while sum(-(-max(0, nseg[b] - own[b]) // c) + sum(-(-s1 // c) for _, _, s1 in tiles(b)) for b in range(B)) > cap:
        c += 1
    items = np.zeros((cap, 4), np.int32)
    n = 0
    for b in range(B):
        for f, k, s1 in tiles(b):
            for a in range(0, s1, c):
                items[n] = (goff[b] + f, k - f, a, min(s1, a + c))
                n += 1
        for a in range(own[b], nseg[b], c):
            items[n] = (base + b, 1, a, min(nseg[b], a + c))
            n += 1
    return items, rl


def reference(q, kc, vc, bt, lens, n_heads: int) -> torch.Tensor:
    """float64 attention of each row over its first lens[b] keys: [B, H*D]."""
    _, bs, Hkv, D = kc.shape
    G = n_heads // Hkv
    out = torch.zeros(q.shape[0], n_heads * D, dtype=torch.float64, device=q.device)
    for b in range(q.shape[0]):
        L = int(lens[b])
        if L <= 0:
            continue
        blocks = bt[b, :(L - 1) // bs + 1].long()
        k = kc.index_select(0, blocks).reshape(-1, Hkv, D)[:L].double().repeat_interleave(G, dim=1)
        v = vc.index_select(0, blocks).reshape(-1, Hkv, D)[:L].double().repeat_interleave(G, dim=1)
        qb = q[b, :n_heads * D].double().view(n_heads, D)
        p = torch.softmax(torch.einsum("hd,lhd->hl", qb, k) / math.sqrt(D), -1)
        out[b] = torch.einsum("hl,lhd->hd", p, v).reshape(-1)
    return out
