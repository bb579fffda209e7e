"""Paged decode attention with GQA over block tables (flash-decoding style, one pass).

One query token per sequence. Grid (H, B); a block of 8 warps streams the
sequence's keys through its block table: D/8 lanes hold one key (8 elements,
one 16-byte load for bf16), so a warp scores 32/(D/8) keys at once and each
lane group keeps its own online-softmax state (max, sum, 8 accumulators).
Loads for U=4 keys per slot are issued before any use. The states of all
slots are merged through shared memory at the end.

Roofline: bytes = context * Hkv * D * 2 (K and V) * sizeof(kv) per sequence
per layer, read G = H/Hkv times (once per query head of the group; the
repeats hit L2). At decode the context is short and the kernel is
latency-bound: ~ceil(L / (slots * U)) dependent rounds of HBM latency.
"""

from __future__ import annotations

import math

import torch

from imp.kernels.cuda import runtime as cu
from imp.kernels.cuda import quantize_act_int8

NW = 8
U = 4

# 8 consecutive cache elements of one key (fp32 or bf16 as raw u16) into fp32 registers: one or two 16-byte loads.
LOAD8 = r"""
template <typename KV> struct Load8;
template <> struct Load8<float> {
    static __device__ __forceinline__ void run(const float* p, float (&o)[8]) {
        const float4 a = __ldg((const float4*)p), b = __ldg((const float4*)(p + 4));
        o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w; o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
    }
};
template <> struct Load8<u16> {
    static __device__ __forceinline__ void run(const u16* p, float (&o)[8]) {
        const uint4 q = __ldg((const uint4*)p);
        o[0] = __uint_as_float(q.x << 16); o[1] = __uint_as_float(q.x & 0xffff0000u);
        o[2] = __uint_as_float(q.y << 16); o[3] = __uint_as_float(q.y & 0xffff0000u);
        o[4] = __uint_as_float(q.z << 16); o[5] = __uint_as_float(q.z & 0xffff0000u);
        o[6] = __uint_as_float(q.w << 16); o[7] = __uint_as_float(q.w & 0xffff0000u);
    }
};

// the U keys t = first + u * step (u < U) of one lane group: K and V rows into registers, zeros at t >= end
template <typename KV, int U>
__device__ __forceinline__ void load_keys(const KV* __restrict__ kc, const KV* __restrict__ vc,
                                          const int* __restrict__ btr, int bs, size_t tok, size_t hoff, int first,
                                          int step, int end, float (&kf)[U][8], float (&vf)[U][8]) {
    #pragma unroll
    for (int u = 0; u < U; ++u) {
        const int t = first + u * step;
        if (t < end) {
            const int blk = __ldg(btr + t / bs);
            const size_t off = ((size_t)blk * bs + (t % bs)) * tok + hoff;
            Load8<KV>::run(kc + off, kf[u]);
            Load8<KV>::run(vc + off, vf[u]);
        } else {
            #pragma unroll
            for (int i = 0; i < 8; ++i) { kf[u][i] = 0.f; vf[u][i] = 0.f; }
        }
    }
}
// q . k over a lane group of LPK lanes, each holding 8 of the D elements (every lane of the warp calls it)
template <int LPK>
__device__ __forceinline__ float group_dot(const float (&q)[8], const float (&k)[8]) {
    float s = 0.f;
    #pragma unroll
    for (int i = 0; i < 8; ++i) s = fmaf(q[i], k[i], s);
    #pragma unroll
    for (int o = LPK / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}
// one key of score s and value v into an online softmax state (max m, sum l, unnormalized acc)
__device__ __forceinline__ void online_add(float& m, float& l, float (&acc)[8], float s, const float (&v)[8]) {
    const float mn = fmaxf(m, s);
    const float corr = (m == NEG_INF) ? 0.f : __expf(m - mn);
    const float p = __expf(s - mn);
    l = l * corr + p;
    #pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = fmaf(p, v[i], acc[i] * corr);
    m = mn;
}

"""

SRC = quantize_act_int8.DEVICE + LOAD8 + r"""
// Q8: the output is written quantized per block of 32 (imp.kernels.cuda.quantize_act_int8's rule, bit for bit) into xq [B, H D]
// int8 and xds [B, H D / 32] float2 for an int8-activation O projection, instead of into out.
template <typename KV, int D, bool Q8>
__global__ void __launch_bounds__(256) paged_decode(
    const float* __restrict__ q, int ldq, const KV* __restrict__ kc, const KV* __restrict__ vc,
    const int* __restrict__ bt, int max_blocks, const int* __restrict__ ctx_lens,
    float* __restrict__ out, int ldo, int H, int Hkv, int bs, float scale,
    signed char* __restrict__ xq, float2* __restrict__ xds) {
    constexpr int LPK = D / 8, KPW = 32 / LPK, NW = 8, NSLOT = NW * KPW, U = 4;
    __shared__ float s_m[NSLOT], s_l[NSLOT], s_acc[NSLOT][D];
    const int h = blockIdx.x, b = blockIdx.y;
    const int g = h / (H / Hkv);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kl = lane / LPK, sub = lane % LPK;
    const int slot = warp * KPW + kl;
    const int L = ctx_lens[b];
    float qv[8];
    const float* qp = q + (size_t)b * ldq + (size_t)h * D + sub * 8;
    #pragma unroll
    for (int i = 0; i < 8; ++i) qv[i] = qp[i] * scale;
    float m = NEG_INF, l = 0.f, acc[8];
    #pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.f;
    const int* btr = bt + (size_t)b * max_blocks;
    const size_t tok = (size_t)Hkv * D;
    const size_t hoff = (size_t)g * D + sub * 8;
    for (int base = warp * KPW; base < L; base += NSLOT * U) {  // warp-uniform loop
        float kf[U][8], vf[U][8];
        load_keys<KV, U>(kc, vc, btr, bs, tok, hoff, base + kl, NSLOT, L, kf, vf);
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const float s = group_dot<LPK>(qv, kf[u]);
            if (base + u * NSLOT + kl < L) online_add(m, l, acc, s, vf[u]);
        }
    }
    if (sub == 0) { s_m[slot] = m; s_l[slot] = l; }
    #pragma unroll
    for (int i = 0; i < 8; ++i) s_acc[slot][sub * 8 + i] = acc[i];
    __syncthreads();
    if (threadIdx.x < D) {
        float M = NEG_INF;
        for (int s2 = 0; s2 < NSLOT; ++s2) M = fmaxf(M, s_m[s2]);
        float tot = 0.f, o = 0.f;
        if (M != NEG_INF) {
            for (int s2 = 0; s2 < NSLOT; ++s2) {
                const float wgt = (s_m[s2] == NEG_INF) ? 0.f : __expf(s_m[s2] - M);
                tot += s_l[s2] * wgt;
                o += s_acc[s2][threadIdx.x] * wgt;
            }
        }
        const float val = (M == NEG_INF) ? 0.f : o / tot;
        if (!Q8) {
            out[(size_t)b * ldo + (size_t)h * D + threadIdx.x] = val;
        } else {  // whole warps are here (D is a multiple of 32): one warp = one block of 32
            float inv;
            const float d = q8_scale(warp_max(fabsf(val)), inv);
            const int qi = q8_round(val, inv);
            int sq = qi;
            #pragma unroll
            for (int o2 = 16; o2 > 0; o2 >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o2);
            const size_t K = (size_t)H * D;
            xq[(size_t)b * K + (size_t)h * D + threadIdx.x] = (signed char)qi;
            if (lane == 0) xds[((size_t)b * K + (size_t)h * D) / 32 + warp] = make_float2(d, __fmul_rn(d, (float)sq));
        }
    }
}
"""

_NAMES = tuple(f"paged_decode<{t}, {d}, {q}>" for t in ("float", "u16") for d in (64, 128, 256) for q in ("false", "true"))


def check_args(q, kc, vc, block_tables, ctx_lens, n_heads: int) -> tuple[int, int, int, int]:
    """The decode kernels' inputs (paged_decode's contract) checked: (B, block size, Hkv, D)."""
    cu.check(q, "q", torch.float32, 2, align=16)
    cu.check(kc, "kc", (torch.float32, torch.bfloat16), 4, align=16)
    cu.check(vc, "vc", (torch.float32, torch.bfloat16), 4, align=16)
    cu.check(block_tables, "block_tables", torch.int32, 2)
    cu.check(ctx_lens, "ctx_lens", torch.int32, 1)
    if not (kc.is_contiguous() and vc.is_contiguous() and block_tables.is_contiguous() and ctx_lens.is_contiguous()):
        raise ValueError("caches, block tables and lengths must be contiguous")
    B = q.shape[0]
    _, bs, Hkv, D = kc.shape
    if D not in (64, 128, 256) or n_heads % Hkv or q.shape[1] < n_heads * D or q.stride(0) % 4:
        raise ValueError(f"unsupported shape: D={D}, H={n_heads}, Hkv={Hkv}")
    if vc.shape != kc.shape or vc.dtype != kc.dtype or block_tables.shape[0] != B or ctx_lens.shape[0] != B:
        raise ValueError("shape mismatch")
    return B, bs, Hkv, D


def outputs(q, B: int, width: int, out, q8: bool):
    """(out, xa): the fp32 output [B, width] (the caller's, checked, or a new one), or with q8 its int8 form."""
    if q8:
        return None, quantize_act_int8.empty(B, width, q.device)
    if out is None:
        out = torch.empty(B, width, dtype=torch.float32, device=q.device)
    cu.check(out, "out", torch.float32, 2)
    return out, None


def paged_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, block_tables: torch.Tensor,
                 ctx_lens: torch.Tensor, n_heads: int, out: torch.Tensor | None = None, q8: bool = False):
    """q [B, >= H*D] fp32 (row stride free), kc/vc [num_blocks, bs, Hkv, D] fp32|bf16,
    block_tables [B, max_blocks] int32, ctx_lens [B] int32 (0 -> zeros) -> out [B, H*D] fp32,
    or with q8 the same output quantized (`imp.kernels.cuda.quantize_act_int8.Q8Act`, for an int8 O projection)."""
    B, bs, Hkv, D = check_args(q, kc, vc, block_tables, ctx_lens, n_heads)
    out, xa = outputs(q, B, n_heads * D, out, q8)
    if B == 0:
        return xa if q8 else out
    t = "float" if kc.dtype == torch.float32 else "u16"
    fn = cu.function(SRC, f"paged_decode<{t}, {D}, {'true' if q8 else 'false'}>", _NAMES)
    cu.launch(fn, (n_heads, B), (32 * NW,), (
        cu.ptr(q), cu.i32(q.stride(0)), cu.ptr(kc), cu.ptr(vc), cu.ptr(block_tables), cu.i32(block_tables.shape[1]),
        cu.ptr(ctx_lens), cu.ptr(out), cu.i32(0 if out is None else out.stride(0)), cu.i32(n_heads), cu.i32(Hkv),
        cu.i32(bs), cu.f32(1.0 / math.sqrt(D)), cu.ptr(None if xa is None else xa.xq),
        cu.ptr(None if xa is None else xa.xds)))
    return xa if q8 else out


def reference(q, kc, vc, block_tables, ctx_lens, n_heads: int) -> torch.Tensor:
    """float64 softmax attention of each row's query over its first ctx_len cached positions."""
    B = q.shape[0]
    _, bs, Hkv, D = kc.shape
    G = n_heads // Hkv
    out = torch.zeros(B, n_heads * D, dtype=torch.float64, device=q.device)
    for b in range(B):
        L = int(ctx_lens[b])
        if L == 0:
            continue
        nb = (L + bs - 1) // bs
        blocks = block_tables[b, :nb].long()
        k = kc[blocks].reshape(nb * bs, Hkv, D)[:L].double().repeat_interleave(G, dim=1)  # [L, H, D]
        v = vc[blocks].reshape(nb * bs, Hkv, D)[:L].double().repeat_interleave(G, dim=1)
        qb = q[b, : n_heads * D].double().view(n_heads, D)
        s = torch.einsum("hd,lhd->hl", qb, k) / math.sqrt(D)
        out[b] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v).reshape(-1)
    return out
