"""Paged decode attention for long contexts: a CTA per KV head (all G query heads of its group), keys split over S CTAs.

`paged_decode_attention.paged_decode` runs a CTA per *query* head and sequence: grid (H, B). Two things cost it at
agents' contexts (issue 39, 10-30k tokens):

- GQA: the G = H / Hkv query heads of a group each stream the group's K and V. At 1-2k tokens the repeats hit L2;
  at 32k the 8B shape's K+V is 16 MB a KV head a layer (128 MB over its 8 heads, past any L2), so each layer reads
  G = 4 times the bytes it needs. Here a CTA loads each key once and scores it against all G queries.
- Parallelism: one stream of the 8B has 32 CTAs (8 here) on 132 SMs, each streaming 32k keys with a few loads in
  flight: latency-bound. Here the keys are dealt in rounds of NSLOT x U to S CTAs (split s takes rounds s, s + S,
  ...: flash-decoding's split-K), each keeping G online-softmax states, and a second kernel merges the S partial
  states a head (m, l, acc[D]) into the output. S is the caller's, fixed per launch shape so that a CUDA graph
  captured once serves every context length: `splits(B, Hkv, sms)` fills the SMs twice over; rounds past a
  sequence's length cost a split nothing but its empty partial.

Per lane: D/8 lanes hold one key (8 elements: one 16-byte load for bf16), as in paged_decode; each lane keeps G x 8
accumulators, G maxima and sums. S == 1: the first kernel writes the output itself (no partials, no merge), so the
kernel also serves short contexts. The output is fp32 [B, H*D] or, with q8, quantized per block of 32 for an
int8-activation O projection by quantize_act_int8's rule, bit for bit as paged_decode's epilogue.

Bytes a layer: B x L x Hkv x D x 2 (K and V) x sizeof(kv), read once; the partials B x H x S x (D + 2) x 4 twice.
"""

from __future__ import annotations

import math

import torch

from imp.kernels.cuda import quantize_act_int8
from imp.kernels.cuda import runtime as cu

NW = 8  # warps a CTA

SRC = quantize_act_int8.DEVICE + r"""
template <typename KV> struct Load8s;
template <> struct Load8s<float> {
    static __device__ __forceinline__ void run(const float* p, float (&o)[8]) {
        const float4 a = __ldg((const float4*)p), b = __ldg((const float4*)(p + 4));
        o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
    }
};
template <> struct Load8s<u16> {
    static __device__ __forceinline__ void run(const u16* p, float (&o)[8]) {
        const uint4 q = __ldg((const uint4*)p);
        o[0] = __uint_as_float(q.x << 16); o[1] = __uint_as_float(q.x & 0xffff0000u);
        o[2] = __uint_as_float(q.y << 16); o[3] = __uint_as_float(q.y & 0xffff0000u);
        o[4] = __uint_as_float(q.z << 16); o[5] = __uint_as_float(q.z & 0xffff0000u);
        o[6] = __uint_as_float(q.w << 16); o[7] = __uint_as_float(q.w & 0xffff0000u);
    }
};

// One value of the output row (b, h, d): fp32, or with Q8 quantized per block of 32 (a whole warp holds a block:
// threads d = 32 w .. 32 w + 31), by quantize_act_int8's rule.
template <bool Q8>
__device__ __forceinline__ void put_out(float val, int b, int h, int d, int H, int D, float* out, int ldo,
                                        signed char* xq, float2* xds) {
    if (!Q8) {
        out[(size_t)b * ldo + (size_t)h * D + d] = val;
    } else {
        float inv;
        const float sc = q8_scale(warp_max(fabsf(val)), inv);
        const int qi = q8_round(val, inv);
        int sq = qi;
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
        const size_t K = (size_t)H * D;
        xq[(size_t)b * K + (size_t)h * D + d] = (signed char)qi;
        if ((d & 31) == 0) xds[((size_t)b * K + (size_t)h * D + d) / 32] = make_float2(sc, __fmul_rn(sc, (float)sq));
    }
}

// grid (Hkv, B, S), 256 threads. Split s of S takes key rounds s, s + S, ... (a round: NSLOT x U keys). S == 1:
// writes the output; else part_ml [B, H, S] float2 (max, sum) and part_acc [B, H, S, D] (unnormalized).
template <typename KV, int D, int G, bool Q8>
__global__ void __launch_bounds__(256) paged_decode_split(
    const float* __restrict__ q, int ldq, const KV* __restrict__ kc, const KV* __restrict__ vc,
    const int* __restrict__ bt, int max_blocks, const int* __restrict__ ctx_lens,
    float* __restrict__ out, int ldo, int H, int Hkv, int bs, float scale,
    signed char* __restrict__ xq, float2* __restrict__ xds,
    float2* __restrict__ part_ml, float* __restrict__ part_acc) {
    constexpr int LPK = D / 8, KPW = 32 / LPK, NWARP = 8, NSLOT = NWARP * KPW, U = G <= 2 ? 4 : 2;
    constexpr int ROUND = NSLOT * U;
    __shared__ float s_m[NSLOT], s_l[NSLOT], s_acc[NSLOT][D];
    const int kvh = blockIdx.x, b = blockIdx.y, split = blockIdx.z, S = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kl = lane / LPK, sub = lane % LPK;
    const int slot = warp * KPW + kl;
    const int L = ctx_lens[b];
    float qv[G][8], m[G], l[G], acc[G][8];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        const float* qp = q + (size_t)b * ldq + (size_t)(kvh * G + g) * D + sub * 8;
        #pragma unroll
        for (int i = 0; i < 8; ++i) { qv[g][i] = qp[i] * scale; acc[g][i] = 0.f; }
        m[g] = NEG_INF; l[g] = 0.f;
    }
    const int* btr = bt + (size_t)b * max_blocks;
    const size_t tok = (size_t)Hkv * D;
    const size_t hoff = (size_t)kvh * D + sub * 8;
    for (int r0 = split * ROUND; r0 < L; r0 += S * ROUND) {  // CTA-uniform loop
        float kf[U][8], vf[U][8];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = r0 + u * NSLOT + slot;
            if (t < L) {
                const int blk = __ldg(btr + t / bs);
                const size_t off = ((size_t)blk * bs + (t % bs)) * tok + hoff;
                Load8s<KV>::run(kc + off, kf[u]);
                Load8s<KV>::run(vc + off, vf[u]);
            } else {
                #pragma unroll
                for (int i = 0; i < 8; ++i) { kf[u][i] = 0.f; vf[u][i] = 0.f; }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = r0 + u * NSLOT + slot;
            #pragma unroll
            for (int g = 0; g < G; ++g) {
                float s = 0.f;
                #pragma unroll
                for (int i = 0; i < 8; ++i) s = fmaf(qv[g][i], kf[u][i], s);
                #pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
                if (t < L) {
                    const float mn = fmaxf(m[g], s);
                    const float corr = (m[g] == NEG_INF) ? 0.f : __expf(m[g] - mn);
                    const float p = __expf(s - mn);
                    l[g] = l[g] * corr + p;
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(p, vf[u][i], acc[g][i] * corr);
                    m[g] = mn;
                }
            }
        }
    }
    // the NSLOT slots' states merged a query head at a time through one shared buffer
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        if (sub == 0) { s_m[slot] = m[g]; s_l[slot] = l[g]; }
        #pragma unroll
        for (int i = 0; i < 8; ++i) s_acc[slot][sub * 8 + i] = acc[g][i];
        __syncthreads();
        const int h = kvh * G + g;
        if (threadIdx.x < D) {
            float M = NEG_INF;
            for (int s2 = 0; s2 < NSLOT; ++s2) M = fmaxf(M, s_m[s2]);
            float tot = 0.f, o = 0.f;
            if (M != NEG_INF) {
                for (int s2 = 0; s2 < NSLOT; ++s2) {
                    const float w = (s_m[s2] == NEG_INF) ? 0.f : __expf(s_m[s2] - M);
                    tot += s_l[s2] * w;
                    o += s_acc[s2][threadIdx.x] * w;
                }
            }
            if (S == 1) {
                put_out<Q8>((M == NEG_INF) ? 0.f : o / tot, b, h, threadIdx.x, H, D, out, ldo, xq, xds);
            } else {
                const size_t p = ((size_t)b * H + h) * S + split;
                part_acc[p * D + threadIdx.x] = o;
                if (threadIdx.x == 0) part_ml[p] = make_float2(M, tot);
            }
        }
        __syncthreads();
    }
}

// grid (H, B), D threads: the S partial states of head h of row b merged into the output.
template <int D, bool Q8>
__global__ void __launch_bounds__(256) decode_merge(
    const float2* __restrict__ part_ml, const float* __restrict__ part_acc, int S,
    float* __restrict__ out, int ldo, int H, signed char* __restrict__ xq, float2* __restrict__ xds) {
    const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
    const size_t p0 = ((size_t)b * H + h) * S;
    float M = NEG_INF;
    for (int s = 0; s < S; ++s) M = fmaxf(M, part_ml[p0 + s].x);
    float tot = 0.f, o = 0.f;
    if (M != NEG_INF) {
        for (int s = 0; s < S; ++s) {
            const float2 ml = part_ml[p0 + s];
            const float w = (ml.x == NEG_INF) ? 0.f : __expf(ml.x - M);
            tot += ml.y * w;
            o += part_acc[(p0 + s) * D + d] * w;
        }
    }
    put_out<Q8>((M == NEG_INF) ? 0.f : o / tot, b, h, d, H, D, out, ldo, xq, xds);
}
"""

GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)
DIMS = (64, 128, 256)
_NAMES = tuple(f"paged_decode_split<{t}, {d}, {g}, {q}>" for t in ("float", "u16") for d in DIMS for g in GROUPS
               for q in ("false", "true")) + tuple(f"decode_merge<{d}, {q}>" for d in DIMS for q in ("false", "true"))


def splits(batch: int, n_kv_heads: int, sms: int, max_ctx: int, round_keys: int = 64) -> int:
    """S for a launch of `batch` rows: CTAs (Hkv x B x S) to fill the SMs twice over, at most one split per round of
    keys the longest context can hold, 1..32. Fixed per batch size (a graph captures it once)."""
    want = -(-2 * sms // max(1, n_kv_heads * batch))
    return max(1, min(32, want, max(1, max_ctx // round_keys)))


def round_keys(head_dim: int, group: int) -> int:
    """Keys a round (NSLOT x U): what `splits` divides a context into."""
    lpk = head_dim // 8
    return NW * (32 // lpk) * (4 if group <= 2 else 2)


def paged_decode_split(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, block_tables: torch.Tensor,
                       ctx_lens: torch.Tensor, n_heads: int, n_splits: int = 1, out: torch.Tensor | None = None,
                       q8: bool = False, work: tuple[torch.Tensor, torch.Tensor] | None = None):
    """paged_decode_attention.paged_decode's contract (q [B, >= H*D] fp32, kc/vc [num_blocks, bs, Hkv, D] fp32|bf16,
    block_tables [B, max_blocks] int32, ctx_lens [B] int32 (0 -> zeros) -> out [B, H*D] fp32, or with q8 the
    output quantized), with the keys split over n_splits CTAs a KV head. work: (part_ml [>= B*H*S, 2],
    part_acc [>= B*H*S, D]) fp32 to reuse (a graph's); made here when None."""
    cu.check(q, "q", torch.float32, 2, align=16)
    cu.check(kc, "kc", (torch.float32, torch.bfloat16), 4, align=16)
    cu.check(vc, "vc", (torch.float32, torch.bfloat16), 4, align=16)
    cu.check(block_tables, "block_tables", torch.int32, 2)
    cu.check(ctx_lens, "ctx_lens", torch.int32, 1)
    if not (kc.is_contiguous() and vc.is_contiguous() and block_tables.is_contiguous() and ctx_lens.is_contiguous()):
        raise ValueError("caches, block tables and lengths must be contiguous")
    B = q.shape[0]
    _, bs, Hkv, D = kc.shape
    G = n_heads // max(1, Hkv)
    if D not in DIMS or n_heads % Hkv or G not in GROUPS or q.shape[1] < n_heads * D or q.stride(0) % 4:
        raise ValueError(f"unsupported shape: D={D}, H={n_heads}, Hkv={Hkv}")
    if vc.shape != kc.shape or vc.dtype != kc.dtype or block_tables.shape[0] != B or ctx_lens.shape[0] != B:
        raise ValueError("shape mismatch")
    if not 1 <= n_splits <= 64:
        raise ValueError(f"n_splits {n_splits}: 1..64")
    xa = None
    if q8:
        xa = quantize_act_int8.empty(B, n_heads * D, q.device)
    elif out is None:
        out = torch.empty(B, n_heads * D, dtype=torch.float32, device=q.device)
    if out is not None:
        cu.check(out, "out", torch.float32, 2)
    if B == 0:
        return xa if q8 else out
    S = n_splits
    if S > 1:
        if work is None:
            work = (torch.empty(B * n_heads * S, 2, dtype=torch.float32, device=q.device),
                    torch.empty(B * n_heads * S, D, dtype=torch.float32, device=q.device))
        if work[0].numel() < B * n_heads * S * 2 or work[1].numel() < B * n_heads * S * D:
            raise ValueError("work buffers too small")
    t = "float" if kc.dtype == torch.float32 else "u16"
    qs = "true" if q8 else "false"
    fn = cu.function(SRC, f"paged_decode_split<{t}, {D}, {G}, {qs}>", _NAMES)
    o_ptr, ldo = cu.ptr(out), cu.i32(0 if out is None else out.stride(0))
    xq, xds = cu.ptr(None if xa is None else xa.xq), cu.ptr(None if xa is None else xa.xds)
    ml, pa = (cu.ptr(work[0]), cu.ptr(work[1])) if S > 1 else (cu.ptr(None), cu.ptr(None))
    cu.launch(fn, (Hkv, B, S), (32 * NW,), (
        cu.ptr(q), cu.i32(q.stride(0)), cu.ptr(kc), cu.ptr(vc), cu.ptr(block_tables), cu.i32(block_tables.shape[1]),
        cu.ptr(ctx_lens), o_ptr, ldo, cu.i32(n_heads), cu.i32(Hkv), cu.i32(bs), cu.f32(1.0 / math.sqrt(D)),
        xq, xds, ml, pa))
    if S > 1:
        merge = cu.function(SRC, f"decode_merge<{D}, {qs}>", _NAMES)
        cu.launch(merge, (n_heads, B), (D,), (ml, pa, cu.i32(S), o_ptr, ldo, cu.i32(n_heads), xq, xds))
    return xa if q8 else out
