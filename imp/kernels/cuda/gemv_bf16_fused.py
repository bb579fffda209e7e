"""BF16 GEMV with two rows a warp, several 16-byte loads in flight per row and lane, and
fused epilogues (gated activation; QKV with RoPE and the KV write), see `gemv_bf16x`."""

from __future__ import annotations

import numpy as np
import torch

from imp.kernels.cuda import runtime as cu
from imp.kernels.cuda.quant_weight import TILES, QWeight, check_x, tile_for

# ------------------------------------------------------------------ BF16 GEMV, two rows a warp, fused epilogues

SRC_X = r"""
// Weights are read once per step: stream them past L1 (keeps x, which every warp re-reads, in L1).
__device__ __forceinline__ uint4 ld_stream(const u16* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {  // L2 only, zero-fill
    unsigned sa;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(sa) : "l"(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(sa), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
__device__ __forceinline__ float dot8(const uint4 q, const float4 a, const float4 c, float s) {
    s = fmaf(__uint_as_float(q.x << 16), a.x, s); s = fmaf(__uint_as_float(q.x & 0xffff0000u), a.y, s);
    s = fmaf(__uint_as_float(q.y << 16), a.z, s); s = fmaf(__uint_as_float(q.y & 0xffff0000u), a.w, s);
    s = fmaf(__uint_as_float(q.z << 16), c.x, s); s = fmaf(__uint_as_float(q.z & 0xffff0000u), c.y, s);
    s = fmaf(__uint_as_float(q.w << 16), c.z, s); s = fmaf(__uint_as_float(q.w & 0xffff0000u), c.w, s);
    return s;
}

#define XWARPS 4
#define XSTAGES 3

// One warp computes two output rows r0, r1 for BT activation rows, 4 warps a block (KS = 1), or
// the block's KS = 4 warps split one pair's chunks (c = 32 kp + lane + 128 j) and add up their sums
// through shared memory (4x the warps in flight for short-N matrices). With KS = 1 the chunk order
// per lane is gemv_bf16's (c = lane, lane + 32, ...), so plain outputs are bit-identical to it.
// ASYNC 0: each lane loads U 16-byte chunks of each row into registers, then uses them (ptxas may
//          still interleave loads and FMAs to save registers: check the SASS).
// ASYNC 1: cp.async into a per-lane shared-memory ring of XSTAGES rounds of 2 x U chunks (48 KB a
//          block for U = 4): XSTAGES - 1 rounds always in flight, no registers held for them.
// Tile rows past the batch (b >= nact) re-read the last row instead of branching (a branch lets
// ptxas sink the weight loads to their uses); their sums are never stored.
//   MODE 0: rows (2p, 2p+1) -> y[:, r].
//   MODE 1: rows (p, F+p) of [gate; up] (N = 2F) -> y[:, p] = act(gate) * up (kind 0 SiLU, 1 GeLU-tanh).
//   MODE 2: rows (2p, 2p+1) of a fused [q; k; v] (N = qrows + 2 kvw): RoPE (adjacent pairs) on rows
//           < nrope = qrows + kvw, y[:, r] = result, and k/v rows stored into the paged caches
//           kc/vc [slots, kvw] (bf16 if kvbf16 else fp32) at slots[b] (< 0: skipped).
template <int BT, int U, int MODE, int ASYNC, int KS>
__global__ void __launch_bounds__(128) gemv_bf16x(
        const u16* __restrict__ wt, const float* __restrict__ x, int ldx, float* __restrict__ y, int ldy,
        int N, int K, int B, int kind,
        const int* __restrict__ pos, const float* __restrict__ cos_t, const float* __restrict__ sin_t, int half,
        int nrope, int qrows, int kvw, void* kc, void* vc, const int* __restrict__ slots, int kvbf16) {
    static_assert(KS == 1 || (KS == XWARPS && ASYNC == 0), "KS: 1, or all warps of a block on one pair");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int p = blockIdx.x * (XWARPS / KS) + warp / KS;  // KS == XWARPS: the same for the whole block
    const int kp = warp % KS;
    const int npairs = MODE == 1 ? (N >> 1) : ((N + 1) >> 1);
    if (p >= npairs) return;
    const int r0 = MODE == 1 ? p : 2 * p;
    const int r1 = MODE == 1 ? (N >> 1) + p : min(2 * p + 1, N - 1);
    const int b0 = blockIdx.y * BT;
    const int nact = min(BT, B - b0);
    x += (size_t)b0 * ldx;
    y += (size_t)b0 * ldy;
    const u16* w0 = wt + (size_t)r0 * K;
    const u16* w1 = wt + (size_t)r1 * K;
    float a0[BT], a1[BT];
    #pragma unroll
    for (int b = 0; b < BT; ++b) { a0[b] = 0.f; a1[b] = 0.f; }
    const int nc = K >> 3;
    if constexpr (ASYNC == 0) {
        constexpr int ST = 32 * KS;  // chunk stride between a lane's consecutive chunks
        int c0 = 32 * kp + lane;
        for (; c0 + ST * (U - 1) < nc; c0 += ST * U) {  // whole rounds: 2U loads issued, then used
            uint4 q0[U], q1[U];
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                q0[u] = ld_stream(w0 + (size_t)(c0 + ST * u) * 8);
                q1[u] = ld_stream(w1 + (size_t)(c0 + ST * u) * 8);
            }
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                #pragma unroll
                for (int b = 0; b < BT; ++b) {
                    const float* xp = x + (size_t)min(b, nact - 1) * ldx + (size_t)(c0 + ST * u) * 8;
                    const float4 xa = __ldg((const float4*)xp), xc = __ldg((const float4*)(xp + 4));
                    a0[b] = dot8(q0[u], xa, xc, a0[b]);
                    a1[b] = dot8(q1[u], xa, xc, a1[b]);
                }
            }
        }
        for (; c0 < nc; c0 += ST) {  // the rest, one chunk at a time (same chunk order per lane)
            const uint4 q0 = ld_stream(w0 + (size_t)c0 * 8), q1 = ld_stream(w1 + (size_t)c0 * 8);
            #pragma unroll
            for (int b = 0; b < BT; ++b) {
                const float* xp = x + (size_t)min(b, nact - 1) * ldx + (size_t)c0 * 8;
                const float4 xa = __ldg((const float4*)xp), xc = __ldg((const float4*)(xp + 4));
                a0[b] = dot8(q0, xa, xc, a0[b]);
                a1[b] = dot8(q1, xa, xc, a1[b]);
            }
        }
    } else {
        // ring[warp][stage][row][u][lane]: each lane reads back only what it copied itself, so
        // cp.async.wait_group alone orders it (no block barrier); 16-byte slots, conflict-free.
        __shared__ __align__(16) uint4 ring[XWARPS][XSTAGES][2][U][32];
        const int R = (nc + 32 * U - 1) / (32 * U);  // rounds, the same for every lane
        auto issue = [&](int r) {
            const int st = r % XSTAGES;
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = lane + 32 * (U * r + u);
                const bool ok = c < nc;
                const size_t off = ok ? (size_t)c * 8 : 0;
                cp_async16(&ring[warp][st][0][u][lane], w0 + off, ok ? 16 : 0);
                cp_async16(&ring[warp][st][1][u][lane], w1 + off, ok ? 16 : 0);
            }
        };
        #pragma unroll
        for (int r = 0; r < XSTAGES - 1; ++r) {
            if (r < R) issue(r);
            cp_async_commit();
        }
        for (int r = 0; r < R; ++r) {
            if (r + XSTAGES - 1 < R) issue(r + XSTAGES - 1);
            cp_async_commit();  // possibly empty: keeps one group per round
            cp_async_wait<XSTAGES - 1>();  // round r has landed
            const int st = r % XSTAGES;
            #pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = lane + 32 * (U * r + u);
                if (c < nc) {
                    const uint4 q0 = ring[warp][st][0][u][lane], q1 = ring[warp][st][1][u][lane];
                    #pragma unroll
                    for (int b = 0; b < BT; ++b) {
                        const float* xp = x + (size_t)min(b, nact - 1) * ldx + (size_t)c * 8;
                        const float4 xa = __ldg((const float4*)xp), xc = __ldg((const float4*)(xp + 4));
                        a0[b] = dot8(q0, xa, xc, a0[b]);
                        a1[b] = dot8(q1, xa, xc, a1[b]);
                    }
                }
            }
        }
        cp_async_wait<0>();
    }
    float s0[BT], s1[BT];  // the pair's dot products (complete in lane 0)
    if constexpr (KS == 1) {
        #pragma unroll
        for (int b = 0; b < BT; ++b) { s0[b] = warp_sum(a0[b]); s1[b] = warp_sum(a1[b]); }
    } else {
        __shared__ float red[XWARPS][BT][2];
        #pragma unroll
        for (int b = 0; b < BT; ++b) {
            const float t0 = warp_sum(a0[b]), t1 = warp_sum(a1[b]);
            if (lane == 0) { red[warp][b][0] = t0; red[warp][b][1] = t1; }
        }
        __syncthreads();
        if (kp != 0) return;
        #pragma unroll
        for (int b = 0; b < BT; ++b) {
            float t0 = 0.f, t1 = 0.f;
            #pragma unroll
            for (int k = 0; k < KS; ++k) { t0 += red[warp + k][b][0]; t1 += red[warp + k][b][1]; }
            s0[b] = t0;
            s1[b] = t1;
        }
    }
    #pragma unroll
    for (int b = 0; b < BT; ++b) {
        float v0 = s0[b];
        float v1 = s1[b];
        if (lane == 0 && b < nact) {
            float* yr = y + (size_t)b * ldy;
            if (MODE == 0) {
                yr[r0] = v0;
                if (r1 != r0) yr[r1] = v1;
            } else if (MODE == 1) {
                float a;
                if (kind == 0) a = v0 / (1.f + expf(-v0));
                else a = 0.5f * v0 * (1.f + tanhf(0.7978845608028654f * (v0 + 0.044715f * v0 * v0 * v0)));
                yr[p] = a * v1;
            } else {
                if (r0 < nrope) {
                    const int i = (r0 % (2 * half)) >> 1;
                    const size_t ti = (size_t)pos[b0 + b] * half + i;
                    const float cs = cos_t[ti], sn = sin_t[ti];
                    const float t0 = v0 * cs - v1 * sn, t1 = v1 * cs + v0 * sn;
                    v0 = t0;
                    v1 = t1;
                }
                yr[r0] = v0;
                yr[r1] = v1;
                if (r0 >= qrows) {
                    const int s = slots[b0 + b];
                    if (s >= 0) {
                        const bool isk = r0 < nrope;
                        const size_t o = (size_t)s * kvw + (r0 - (isk ? qrows : nrope));
                        void* cache = isk ? kc : vc;
                        if (kvbf16) { ((u16*)cache)[o] = f2bf(v0); ((u16*)cache)[o + 1] = f2bf(v1); }
                        else { ((float*)cache)[o] = v0; ((float*)cache)[o + 1] = v1; }
                    }
                }
            }
        }
    }
}
"""

# variant -> (U, ASYNC, KS): "x4"/"x8" load U chunks a row into registers, "a4" streams through a cp.async
# ring, "k4" is x4 with the 4 warps of a block splitting one pair of rows along K (more warps for short N)
XVARIANTS = {"x4": (4, 0, 1), "x8": (8, 0, 1), "a4": (4, 1, 1), "k4": (4, 0, 4)}
XMODES = {"plain": 0, "gated": 1, "qkv": 2}
XACTS = {"silu": 0, "gelu": 1}
XWARPS = 4
# one NVRTC module per variant (12 kernels each), compiled on first use
_XNAMES = {v: tuple(f"gemv_bf16x<{bt}, {u}, {m}, {a}, {ks}>" for bt in TILES for m in XMODES.values())
           for v, (u, a, ks) in XVARIANTS.items()}


def x_ok(w: QWeight) -> bool:
    """gemv_bf16x applies: a BF16 weight whose rows are whole 16-byte chunks."""
    return w.fmt == "BF16" and w.cols % 8 == 0


def gemv_bf16x(w: QWeight, x: torch.Tensor, out: torch.Tensor | None = None, variant: str = "x4", mode: str = "plain",
               act: str = "silu", rope: tuple | None = None, kv: tuple | None = None) -> torch.Tensor:
    """BF16 GEMV with two rows a warp and several 16-byte loads in flight per row and lane (`XVARIANTS`).

    plain: out [B, N] = x @ W.T (bit-identical to `gemv` except for "k4", which sums in another order).
    gated: W = [gate; up] (N = 2F): out [B, F] = act(x @ gate.T) * (x @ up.T).
    qkv:   W = [q; k; v] rows (N = qrows + 2 kvw): rope = (positions int32 [B], cos, sin, nrope) rotates
           rows < nrope (= qrows + kvw) in adjacent pairs like `rope.rope`; kv = (kc, vc, slots int32 [B], qrows)
           with kc/vc [num_slots, kvw] fp32/bf16 contiguous: k/v rows stored at slots[b] like `kv_write`.
           out [B, N] holds the rotated q, k and v.
    """
    if not x_ok(w):
        raise ValueError(f"gemv_bf16x needs a BF16 weight with cols % 8 == 0 ({w.fmt}, {w.cols})")
    if variant not in XVARIANTS or mode not in XMODES or act not in XACTS:
        raise ValueError(f"variant={variant} mode={mode} act={act}")
    B, K = check_x(w, x)
    wt = w.parts["w"]
    if not wt.is_contiguous() or wt.device != x.device:
        raise ValueError(f"weight must be contiguous on {x.device}")
    N = w.rows
    ncols = N // 2 if mode == "gated" else N
    if mode == "gated" and N % 2:
        raise ValueError("gated: the weight must have an even number of rows")
    if out is None:
        out = torch.empty(B, ncols, dtype=torch.float32, device=x.device)
    cu.check(out, "out", torch.float32, 2)
    if tuple(out.shape) != (B, ncols):
        raise ValueError(f"out shape {tuple(out.shape)}, expected {(B, ncols)}")
    z = np.uint64(0)
    extra = [z, z, z, cu.i32(1), cu.i32(0), cu.i32(0), cu.i32(0), z, z, z, cu.i32(0)]
    if mode == "qkv":
        if rope is None or kv is None:
            raise ValueError("qkv mode needs rope and kv")
        positions, cos, sin, nrope = rope
        kc, vc, slots, qrows = kv
        kvw = kc.shape[1] if kc.dim() == 2 else -1
        half = cos.shape[1]
        if (N % 2 or qrows % 2 or kvw % 2 or N != qrows + 2 * kvw or nrope != qrows + kvw
                or qrows % (2 * half) or kvw % (2 * half)):
            raise ValueError(f"qkv layout: N={N} qrows={qrows} kvw={kvw} nrope={nrope} head_dim={2 * half}")
        cu.check(positions, "positions", torch.int32, 1)
        cu.check(slots, "slots", torch.int32, 1)
        cu.check(cos, "cos", torch.float32, 2)
        cu.check(sin, "sin", torch.float32, 2)
        for name, t in (("kc", kc), ("vc", vc)):
            cu.check(t, name, (torch.float32, torch.bfloat16), 2)
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if (vc.shape != kc.shape or vc.dtype != kc.dtype or positions.shape[0] < B or slots.shape[0] < B
                or not (positions.is_contiguous() and slots.is_contiguous() and cos.is_contiguous() and sin.is_contiguous())):
            raise ValueError("qkv: cache/positions/slots mismatch")
        extra = [cu.ptr(positions), cu.ptr(cos), cu.ptr(sin), cu.i32(half), cu.i32(nrope), cu.i32(qrows), cu.i32(kvw),
                 cu.ptr(kc), cu.ptr(vc), cu.ptr(slots), cu.i32(1 if kc.dtype == torch.bfloat16 else 0)]
    if B == 0:
        return out
    bt = tile_for(B)
    U, asy, ks = XVARIANTS[variant]
    fn = cu.function(SRC_X, f"gemv_bf16x<{bt}, {U}, {XMODES[mode]}, {asy}, {ks}>", _XNAMES[variant])
    npairs = N // 2 if mode == "gated" else (N + 1) // 2
    args = (cu.ptr(wt), cu.ptr(x), cu.i32(x.stride(0)), cu.ptr(out), cu.i32(out.stride(0)), cu.i32(N), cu.i32(K),
            cu.i32(B), cu.i32(XACTS[act])) + tuple(extra)
    ppb = XWARPS // ks  # pairs a block
    cu.launch(fn, ((npairs + ppb - 1) // ppb, (B + bt - 1) // bt), (32 * XWARPS,), args)
    return out

