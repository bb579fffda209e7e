"""Paged decode attention for long contexts: a CTA per KV head (all G query heads of its group), keys split over S CTAs.

`paged_decode_attention.paged_decode` runs a CTA per *query* head and sequence: grid (H, B). Two things cost it at
agents' contexts (issue 39, 10-30k tokens):

- GQA: the G = H / Hkv query heads of a group each stream the group's K and V. At 1-2k tokens the repeats hit L2;
  at 32k the 8B shape's K+V is 16 MB a KV head a layer (128 MB over its 8 heads, past any L2), so each layer reads
  G = 4 times the bytes it needs. Here a CTA loads each key once and scores it against all G queries.
- Parallelism: one stream of the 8B has 32 CTAs (8 here) on 132 SMs, each streaming 32k keys with a few loads in
  flight: latency-bound. Here a row's keys are cut into segments of `seg_keys` positions (flash-decoding's split-K),
  dealt to S CTAs a KV head (split s takes segments s, s + S, ...); each segment is one online softmax from its first
  key, and the CTA that finishes a row's last share merges its segments in order. S is parallelism only: a row's bits depend on its
  context and seg_keys (a server's constant, `seg_keys_for(max_ctx)`), never on S or on the rows beside it, so the
  kernel keeps batch invariance and a CUDA graph captured once at one S serves every context length.

Per lane: D/8 lanes hold one key (8 elements: one 16-byte load for bf16), as in paged_decode; each lane keeps G x 8
accumulators, G maxima and sums. A row of one segment is written by the first kernel itself (no partials; the merge
kernel skips it). The output is fp32 [B, H*D] or, with q8, quantized per block of 32 for an int8-activation O
projection by quantize_act_int8's rule, bit for bit as paged_decode's epilogue. The bits differ from paged_decode's
(another order of the same sums): a server uses one of the two for every decode row.

Bytes a layer: B x L x Hkv x D x 2 (K and V) x sizeof(kv), read once; the partials B x H x segments x (D + 2) x 4
twice (rows of more than one segment).
"""

from __future__ import annotations

import math

import torch

from imp.kernels.cuda import quantize_act_int8
from imp.kernels.cuda import runtime as cu
from imp.kernels.cuda.gemm_int8_act_tiles import sm_count
from imp.kernels.cuda.paged_decode_attention import LOAD8, check_args, outputs

NW = 8  # warps a CTA

# One value of the output row (fp32, or int8 for an int8 O projection): also paged_decode_mma's merge
PUT_OUT = r"""
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
"""

SRC = quantize_act_int8.DEVICE + LOAD8 + PUT_OUT + r"""
// grid (Hkv, B, S), 256 threads. A row's keys are cut into segments of seg_keys positions; split s of S takes
// segments s, s + S, ... Each segment is one online softmax from its first key, merged over the NSLOT slots in slot
// order: a row with one segment writes the output here; else each segment writes part_ml [B, H, nseg_max] float2
// (max, sum) and part_acc [B, H, nseg_max, D] (unnormalized), merged in segment order by the last CTA to finish. So a row's
// bits depend on its context and seg_keys alone, never on S or on the rows beside it (batch invariance).
template <typename KV, int D, int G, bool Q8>
__global__ void __launch_bounds__(256) paged_decode_split(
    const float* __restrict__ q, int ldq, const KV* __restrict__ kc, const KV* __restrict__ vc,
    const int* __restrict__ bt, int max_blocks, const int* __restrict__ ctx_lens,
    float* __restrict__ out, int ldo, int H, int Hkv, int bs, float scale,
    signed char* __restrict__ xq, float2* __restrict__ xds,
    float2* __restrict__ part_ml, float* __restrict__ part_acc, int seg_keys, int nseg_max, int* __restrict__ cnt) {
    constexpr int LPK = D / 8, KPW = 32 / LPK, NWARP = 8, NSLOT = NWARP * KPW, U = G <= 2 ? 4 : 2;
    constexpr int ROUND = NSLOT * U;
    __shared__ float s_m[NSLOT], s_l[NSLOT], s_acc[NSLOT][D];
    const int kvh = blockIdx.x, b = blockIdx.y, split = blockIdx.z, S = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kl = lane / LPK, sub = lane % LPK;
    const int slot = warp * KPW + kl;
    const int L = ctx_lens[b];
    const int nseg = (L + seg_keys - 1) / seg_keys;
    if (L <= 0) {  // an empty context reads nothing: zeros, from split 0
        if (split == 0 && threadIdx.x < D) {
            #pragma unroll 1
            for (int g = 0; g < G; ++g) put_out<Q8>(0.f, b, kvh * G + g, threadIdx.x, H, D, out, ldo, xq, xds);
        }
        return;
    }
    float qv[G][8];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        const float* qp = q + (size_t)b * ldq + (size_t)(kvh * G + g) * D + sub * 8;
        #pragma unroll
        for (int i = 0; i < 8; ++i) qv[g][i] = qp[i] * scale;
    }
    const int* btr = bt + (size_t)b * max_blocks;
    const size_t tok = (size_t)Hkv * D;
    const size_t hoff = (size_t)kvh * D + sub * 8;
    for (int seg = split; seg < nseg && seg < nseg_max; seg += S) {  // CTA-uniform (a context past max_ctx: cut)
        const int k0 = seg * seg_keys, k1 = min(L, k0 + seg_keys);
        float m[G], l[G], acc[G][8];
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            m[g] = NEG_INF; l[g] = 0.f;
            #pragma unroll
            for (int i = 0; i < 8; ++i) acc[g][i] = 0.f;
        }
        for (int r0 = k0; r0 < k1; r0 += ROUND) {  // CTA-uniform
            float kf[U][8], vf[U][8];
            load_keys<KV, U>(kc, vc, btr, bs, tok, hoff, r0 + slot, NSLOT, k1, kf, vf);
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const bool live = r0 + u * NSLOT + slot < k1;
                #pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float sc = group_dot<LPK>(qv[g], kf[u]);
                    if (live) online_add(m[g], l[g], acc[g], sc, vf[u]);
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
                for (int s2 = 0; s2 < NSLOT; ++s2) {  // a segment has a key: M is finite
                    const float w = (s_m[s2] == NEG_INF) ? 0.f : __expf(s_m[s2] - M);
                    tot += s_l[s2] * w;
                    o += s_acc[s2][threadIdx.x] * w;
                }
                if (nseg == 1) {
                    put_out<Q8>(o / tot, b, h, threadIdx.x, H, D, out, ldo, xq, xds);
                } else {
                    const size_t p = ((size_t)b * H + h) * nseg_max + seg;
                    part_acc[p * D + threadIdx.x] = o;
                    if (threadIdx.x == 0) part_ml[p] = make_float2(M, tot);
                }
            }
            __syncthreads();
        }
    }
    // A row of several segments: the CTA that finishes its share last (a counter a row and KV head, reset by it for
    // the next launch) merges the group's heads in segment order, as a second kernel did (the same bits, one launch
    // less a layer). The fence publishes this CTA's partials before its count; the last one reads them from L2.
    const int nseg_c = min(nseg, nseg_max);
    if (nseg_c <= 1 || split >= nseg_c) return;  // written above, or this CTA had no segment
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int prev = atomicAdd(cnt + (size_t)b * Hkv + kvh, 1);
        s_last = prev == min(S, nseg_c) - 1;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    if (threadIdx.x == 0) cnt[(size_t)b * Hkv + kvh] = 0;
    if (threadIdx.x >= D) return;
    #pragma unroll 1
    for (int g = 0; g < G; ++g) {
        const int h = kvh * G + g;
        const size_t p0 = ((size_t)b * H + h) * nseg_max;
        float M = NEG_INF;
        for (int s2 = 0; s2 < nseg_c; ++s2) M = fmaxf(M, __ldcg(&part_ml[p0 + s2].x));
        float tot = 0.f, o = 0.f;
        for (int s2 = 0; s2 < nseg_c; ++s2) {
            const float2 ml = __ldcg(part_ml + p0 + s2);
            const float w = __expf(ml.x - M);
            tot += ml.y * w;
            o += __ldcg(part_acc + (p0 + s2) * D + threadIdx.x) * w;
        }
        put_out<Q8>(o / tot, b, h, threadIdx.x, H, D, out, ldo, xq, xds);
    }
}
"""

GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)
DIMS = (64, 128, 256)
_NAMES = tuple(f"paged_decode_split<{t}, {d}, {g}, {q}>" for t in ("float", "u16") for d in DIMS for g in GROUPS
               for q in ("false", "true"))


def seg_keys_for(max_ctx: int) -> int:
    """Keys a segment for a server whose contexts reach max_ctx: about max_ctx / 64 (so a row has at most 64 partial
    states: the work buffers are B x H x 64 x (D + 2) floats), a multiple of 128, at least 256 (a short context's
    segments are still several CTAs' work at batch 1). A server's constant: a row's bits depend on it."""
    return max(256, -(-max_ctx // (64 * 128)) * 128)


def splits(batch: int, n_kv_heads: int, sms: int, nseg_max: int) -> int:
    """S for a launch of `batch` rows: CTAs (Hkv x B x S) to fill the SMs twice over, at most the segments a row can
    have. Parallelism only (a row's bits do not depend on it); fixed per batch size, so a graph captures it once."""
    return max(1, min(nseg_max, -(-2 * sms // max(1, n_kv_heads * batch))))


def paged_decode_split(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, block_tables: torch.Tensor,
                       ctx_lens: torch.Tensor, n_heads: int, max_ctx: int, n_splits: int = 0,
                       out: torch.Tensor | None = None, q8: bool = False,
                       work: tuple[torch.Tensor, torch.Tensor] | None = None, seg_keys: int = 0):
    """paged_decode_attention.paged_decode's contract (q [B, >= H*D] fp32, kc/vc [num_blocks, bs, Hkv, D] fp32|bf16,
    block_tables [B, max_blocks] int32, ctx_lens [B] int32 <= max_ctx (0 -> zeros) -> out [B, H*D] fp32, or with
    q8 the output quantized), a CTA a KV head, a row's keys in segments of seg_keys (default `seg_keys_for(max_ctx)`)
    dealt to n_splits CTAs (default `splits`). work: (part_ml [>= B*H*nseg_max, 2], part_acc [>= B*H*nseg_max, D]
    fp32, counters [>= B*Hkv] int32 zeros, left zero by every launch) to reuse (a graph's); made here when None and a
    row can have more than one segment."""
    B, bs, Hkv, D = check_args(q, kc, vc, block_tables, ctx_lens, n_heads)
    G = n_heads // Hkv
    if G not in GROUPS:
        raise ValueError(f"unsupported shape: H={n_heads}, Hkv={Hkv} (groups {GROUPS})")
    seg = seg_keys or seg_keys_for(max_ctx)
    nseg_max = max(1, -(-max_ctx // seg))
    S = n_splits or splits(B, Hkv, sm_count(q.device.index or 0), nseg_max)
    if not 1 <= S <= 1024:
        raise ValueError(f"n_splits {S}: 1..1024")
    out, xa = outputs(q, B, n_heads * D, out, q8)
    if B == 0:
        return xa if q8 else out
    if nseg_max > 1:
        n = B * n_heads * nseg_max
        if work is None:
            work = (torch.empty(n, 2, dtype=torch.float32, device=q.device),
                    torch.empty(n, D, dtype=torch.float32, device=q.device),
                    torch.zeros(B * Hkv, dtype=torch.int32, device=q.device))
        if work[0].numel() < 2 * n or work[1].numel() < n * D or work[2].numel() < B * Hkv:
            raise ValueError("work buffers too small")
        if work[2].dtype != torch.int32:
            raise ValueError("the counters are int32")
    t = "float" if kc.dtype == torch.float32 else "u16"
    qs = "true" if q8 else "false"
    fn = cu.function(SRC, f"paged_decode_split<{t}, {D}, {G}, {qs}>", _NAMES)
    o_ptr, ldo = cu.ptr(out), cu.i32(0 if out is None else out.stride(0))
    xq, xds = cu.ptr(None if xa is None else xa.xq), cu.ptr(None if xa is None else xa.xds)
    ml, pa, cn = (cu.ptr(w) for w in work) if nseg_max > 1 else (cu.ptr(None),) * 3
    cu.launch(fn, (Hkv, B, S), (32 * NW,), (
        cu.ptr(q), cu.i32(q.stride(0)), cu.ptr(kc), cu.ptr(vc), cu.ptr(block_tables), cu.i32(block_tables.shape[1]),
        cu.ptr(ctx_lens), o_ptr, ldo, cu.i32(n_heads), cu.i32(Hkv), cu.i32(bs), cu.f32(1.0 / math.sqrt(D)),
        xq, xds, ml, pa, cu.i32(seg), cu.i32(nseg_max), cn))
    return xa if q8 else out
