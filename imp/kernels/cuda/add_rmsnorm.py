"""Fused residual add + RMSNorm: x += delta (in place); out = x / rms(x) * w.

One block per row, float4 loads; the row is read twice (the second time from
L1/L2). Roofline: 3 (or 2 without delta) * d * 4 bytes read/written per row,
a few microseconds at decode sizes: launch-bound, the point is one launch
instead of three (add, norm, scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from imp.kernels.cuda import runtime as cu

# x += delta for one row (in place) and 1 / rms of the sum: one block per row, blockDim a multiple of 32.
# Shared with the kernel that writes the normed row as int8 (imp.kernels.cuda.quantize_act_int8.add_rmsnorm_q8).
ROW = r"""
__device__ __forceinline__ float add_row_rs(float* __restrict__ xr, const float* __restrict__ dr, int d, float eps) {
    float ss = 0.f;
    for (int i = threadIdx.x * 4; i < d; i += blockDim.x * 4) {
        float4 v = *(const float4*)(xr + i);
        if (dr) {
            const float4 a = *(const float4*)(dr + i);
            v.x += a.x; v.y += a.y; v.z += a.z; v.w += a.w;
            *(float4*)(xr + i) = v;
        }
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    __shared__ float red[32];
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float t = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
        t = warp_sum(t);
        if (threadIdx.x == 0) red[0] = t;
    }
    __syncthreads();
    return rsqrtf(red[0] / (float)d + eps);
}
"""

SRC = ROW + r"""
extern "C" __global__ void add_rmsnorm(float* __restrict__ x, int ldx, const float* __restrict__ delta, int ldd,
                                       const float* __restrict__ w, float* __restrict__ out, int ldo, int d, float eps) {
    const int r = blockIdx.x;
    float* xr = x + (size_t)r * ldx;
    const float rs = add_row_rs(xr, delta ? delta + (size_t)r * ldd : nullptr, d, eps);
    float* orow = out + (size_t)r * ldo;
    for (int i = threadIdx.x * 4; i < d; i += blockDim.x * 4) {
        const float4 v = *(const float4*)(xr + i);
        const float4 g = *(const float4*)(w + i);
        *(float4*)(orow + i) = make_float4(v.x * rs * g.x, v.y * rs * g.y, v.z * rs * g.z, v.w * rs * g.w);
    }
}
"""


def check_args(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor) -> tuple[int, int]:
    """(N, d) of a row kernel's x [N, d] fp32, delta [N, d] or None, w [d] (float4 loads: multiples of 4);
    shared with imp.kernels.cuda.quantize_act_int8.add_rmsnorm_q8."""
    cu.check(x, "x", torch.float32, 2, align=16)
    N, d = x.shape
    if d % 4 or x.stride(0) % 4:
        raise ValueError("d and the row stride must be multiples of 4")
    if delta is not None:
        cu.check(delta, "delta", torch.float32, 2, align=16)
        if tuple(delta.shape) != (N, d) or delta.stride(0) % 4:
            raise ValueError("delta must match x")
    cu.check(w, "w", torch.float32, 1, align=16)
    if w.shape[0] != d:
        raise ValueError("w must have d elements")
    return N, d


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, d] fp32 (updated in place to x + delta), w [d] -> out [N, d] fp32."""
    N, d = check_args(x, delta, w)
    if out is None:
        out = torch.empty(N, d, dtype=torch.float32, device=x.device)
    cu.check(out, "out", torch.float32, 2, align=16)
    if N == 0:
        return out
    threads = min(256, max(32, ((d // 4 + 31) // 32) * 32))
    fn = cu.function(SRC, "add_rmsnorm")
    cu.launch(fn, (N,), (threads,), (
        cu.ptr(x), cu.i32(x.stride(0)), cu.ptr(delta), cu.i32(0 if delta is None else delta.stride(0)),
        cu.ptr(w), cu.ptr(out), cu.i32(out.stride(0)), cu.i32(d), cu.f32(eps)))
    return out


def reference(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta) * w) in float64."""
    s = x.double() + (0 if delta is None else delta.double())
    return s, F.rms_norm(s, (s.shape[-1],), w.double(), eps)
