"""RoPE in place over the q and k heads of a fused qkv buffer.

GGUF ("normal") layout: adjacent pairs (x[2i], x[2i+1]) rotate by
pos * theta^(-2i/D); cos/sin come from tables [max_pos, D/2] built in float64
(`imp.model.llama.rope_tables`), so the angles match the CPU runner's.
One thread per pair; memory-bound and tiny at decode (launch-bound), which is
why `rope_kv` also does the KV write (`imp.kernels.cuda.kv_write`) in the same launch.
"""

from __future__ import annotations

import torch

from imp.kernels.cuda import runtime as cu

SRC = r"""
// one rotation, every operation explicitly rounded: rope and rope_kv give the same bits
__device__ __forceinline__ float2 rot2(float2 v, float c, float s) {
    return make_float2(__fmaf_rn(v.x, c, -__fmul_rn(v.y, s)), __fmaf_rn(v.y, c, __fmul_rn(v.x, s)));
}
// thread idx -> pair i of head h of row n (N rows of nh heads of 2 * half values); false past the end
__device__ __forceinline__ bool pair_of(long long idx, int N, int nh, int half, int& n, int& h, int& i) {
    if (idx >= (long long)N * nh * half) return false;
    i = (int)(idx % half);
    const long long t = idx / half;
    h = (int)(t % nh);
    n = (int)(t / nh);
    return true;
}
extern "C" __global__ void rope(float* __restrict__ qk, int ld, const int* __restrict__ pos,
                                const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                int nh, int half, int N) {
    int n, h, i;
    if (!pair_of((long long)blockIdx.x * blockDim.x + threadIdx.x, N, nh, half, n, h, i)) return;
    float2* p = (float2*)(qk + (size_t)n * ld + (size_t)h * 2 * half + 2 * i);
    const size_t ti = (size_t)pos[n] * half + i;
    const float c = cos_t[ti], s = sin_t[ti];
    *p = rot2(*p, c, s);
}

// RoPE on the q and k heads of qkv [N, (H + 2 Hkv) D] in place, and the (rotated) k and the v heads into
// the cache at the rows' slots (slot < 0: no write): `rope` then `kv_write_cupy` in one launch.
extern "C" __global__ void rope_kv(float* __restrict__ qkv, int ld, const int* __restrict__ pos,
                                   const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                   int H, int Hkv, int half, int N, void* kc, void* vc,
                                   const int* __restrict__ slots, int bf16) {
    int n, h, i;
    if (!pair_of((long long)blockIdx.x * blockDim.x + threadIdx.x, N, H + 2 * Hkv, half, n, h, i)) return;
    float2* p = (float2*)(qkv + (size_t)n * ld + (size_t)h * 2 * half + 2 * i);
    float2 v = *p;
    if (h < H + Hkv) {
        const size_t ti = (size_t)pos[n] * half + i;
        v = rot2(v, cos_t[ti], sin_t[ti]);
        *p = v;
        if (h < H) return;
    }
    const int sl = slots[n];
    if (sl < 0) return;
    const bool is_k = h < H + Hkv;
    const size_t W = (size_t)Hkv * 2 * half;
    const size_t o = (size_t)sl * W + (size_t)(h - H - (is_k ? 0 : Hkv)) * 2 * half + 2 * i;
    void* dst = is_k ? kc : vc;
    if (bf16) { ((u16*)dst)[o] = f2bf(v.x); ((u16*)dst)[o + 1] = f2bf(v.y); }
    else { ((float*)dst)[o] = v.x; ((float*)dst)[o + 1] = v.y; }
}
"""


def rope(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rotate heads 0..n_heads-1 (head_dim = 2 * cos.shape[1]) of qk [N, >= n_heads*D] in place."""
    cu.check(qk, "qk", torch.float32, 2, align=8)
    cu.check(positions, "positions", torch.int32, 1)
    cu.check(cos, "cos", torch.float32, 2)
    cu.check(sin, "sin", torch.float32, 2)
    if not (cos.is_contiguous() and sin.is_contiguous() and positions.is_contiguous()):
        raise ValueError("cos, sin and positions must be contiguous")
    N = qk.shape[0]
    half = cos.shape[1]
    if qk.shape[1] < n_heads * 2 * half or positions.shape[0] != N or qk.stride(0) % 2:
        raise ValueError("shape mismatch")
    total = N * n_heads * half
    if total == 0:
        return qk
    fn = cu.function(SRC, "rope")
    cu.launch(fn, ((total + 255) // 256,), (256,), (
        cu.ptr(qk), cu.i32(qk.stride(0)), cu.ptr(positions), cu.ptr(cos), cu.ptr(sin),
        cu.i32(n_heads), cu.i32(half), cu.i32(N)))
    return qk


def rope_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
            n_kv_heads: int, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """RoPE on qkv [N, (H + 2 Hkv) D]'s q and k heads in place, and k, v into the flat caches kc, vc
    [num_slots, Hkv D] (fp32 or bf16) at `slots` [N] int32 (< 0: skipped): one kernel for two."""
    cu.check(qkv, "qkv", torch.float32, 2, align=8)
    for name, t in (("positions", positions), ("slots", slots)):
        cu.check(t, name, torch.int32, 1)
    half = cos.shape[1]
    N, D = qkv.shape[0], 2 * half
    W = n_kv_heads * D
    if qkv.shape[1] < (n_heads + 2 * n_kv_heads) * D or positions.shape[0] != N or slots.shape[0] != N \
            or qkv.stride(0) % 2:
        raise ValueError("shape mismatch")
    if not (kc.is_contiguous() and vc.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()) \
            or kc.shape[-1] != W or kc.shape != vc.shape or kc.dtype != vc.dtype \
            or kc.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError("caches must be contiguous [num_slots, Hkv D] fp32 or bf16, the tables contiguous")
    total = N * (n_heads + 2 * n_kv_heads) * half
    if total:
        fn = cu.function(SRC, "rope_kv")
        cu.launch(fn, ((total + 255) // 256,), (256,), (
            cu.ptr(qkv), cu.i32(qkv.stride(0)), cu.ptr(positions), cu.ptr(cos), cu.ptr(sin), cu.i32(n_heads),
            cu.i32(n_kv_heads), cu.i32(half), cu.i32(N), cu.ptr(kc), cu.ptr(vc), cu.ptr(slots),
            cu.i32(1 if kc.dtype == torch.bfloat16 else 0)))
    return qkv


def reference(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rotated copy of the first n_heads heads, [N, n_heads, D], float64: pairs
    (x[2i], x[2i+1]) rotate together by the angle of position p (as the CPU model)."""
    D = 2 * cos.shape[1]
    x = qk[:, : n_heads * D].double().view(-1, n_heads, D)
    p = positions.long()
    c, s = cos.double()[p].unsqueeze(1), sin.double()[p].unsqueeze(1)  # [N, 1, D/2]
    xp = x.unflatten(-1, (-1, 2))  # [N, heads, D/2, 2]
    x0, x1 = xp[..., 0], xp[..., 1]
    return torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
