"""RoPE in place over the q and k heads of a fused qkv buffer.

GGUF ("normal") layout: adjacent pairs (x[2i], x[2i+1]) rotate by
pos * theta^(-2i/D); cos/sin come from tables [max_pos, D/2] built in float64
(`imp.model.llama.rope_tables`), so the angles match the CPU runner's.
One thread per pair; memory-bound and tiny at decode (launch-bound).
"""

from __future__ import annotations

import torch

from imp.kernels import _cuda as cu

SRC = r"""
extern "C" __global__ void rope(float* __restrict__ qk, int ld, const int* __restrict__ pos,
                                const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                int nh, int half, int N) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * nh * half) return;
    const int i = (int)(idx % half);
    const long long t = idx / half;
    const int h = (int)(t % nh);
    const int n = (int)(t / nh);
    float2* p = (float2*)(qk + (size_t)n * ld + (size_t)h * 2 * half + 2 * i);
    const size_t ti = (size_t)pos[n] * half + i;
    const float c = cos_t[ti], s = sin_t[ti];
    const float2 v = *p;
    *p = make_float2(v.x * c - v.y * s, v.y * c + v.x * s);
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
