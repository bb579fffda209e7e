"""int8 activations for `imp.kernels.cuda.gemv_int8_act`: quantize x per block of 32 (llama.cpp's Q8_1), alone
or fused into the kernel that produces x (add+RMSNorm, the gated activation).

    xq [N, K] int8, xds [N, K/32] float2: xd = max|x| / 127, xs = xd * sum(xq)

Why fused: at decode every kernel is a graph node of ~2-3 µs whatever it does; a separate
quantize before each of the 4 GEMVs of a layer is 128 nodes for a 32-layer model. Here the
norm before QKV and gate/up, and the SiLU*up before down, write xq/xds directly (the fp32
vector is never stored); only the attention output (before O) is quantized by itself.

Rounding as `imp.kernels.cpu.gemm_int8_act.quantize_rows` (the CPU runner's): v = x * (1 / xd), q = trunc(v + 0.5)
away from zero, every operation explicitly rounded (no FMA contraction), so a fused kernel
gives the same bits as quantizing the fp32 output of the unfused one, and the GPU the same
as the CPU for the same x. `reference` is that rule in torch float32 ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from imp.kernels.cuda import runtime as cu
from imp.kernels.cuda.add_rmsnorm import ROW, check_args

QK = 32

# The rounding rule, for every kernel that writes int8 activations (here, and paged_decode_attention's epilogue).
DEVICE = r"""
// xd = max|x| / 127 and its inverse (0 for an all-zero block)
__device__ __forceinline__ float q8_scale(float amax, float& inv) {
    const float d = __fdiv_rn(amax, 127.f);
    inv = d > 0.f ? __fdiv_rn(1.f, d) : 0.f;
    return d;
}
// q = trunc(x * inv + 0.5) away from zero, each operation rounded on its own (no FMA contraction)
__device__ __forceinline__ int q8_round(float x, float inv) {
    const float u = __fmul_rn(x, inv);
    return u >= 0.f ? (int)__fadd_rn(u, 0.5f) : -(int)__fadd_rn(0.5f, -u);
}
"""

SRC = DEVICE + ROW + r"""
typedef signed char i8;
// Quantize 4 consecutive values of one block of 32; the 8 threads of the block are 8 consecutive lanes
// (lane & ~7 aligned) and all 32 lanes of the warp call this (the shuffles are warp-wide; dead lanes
// pass live = false). col4: the float4 index in the row.
__device__ __forceinline__ void q8_store4(float4 v, bool live, i8* __restrict__ xq_row, float2* __restrict__ xds_row, int col4) {
    float am = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    #pragma unroll
    for (int o = 4; o > 0; o >>= 1) am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
    float inv;
    const float d = q8_scale(am, inv);
    const float e[4] = {v.x, v.y, v.z, v.w};
    int q[4], s = 0;
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        q[i] = q8_round(e[i], inv);
        s += q[i];
    }
    #pragma unroll
    for (int o = 4; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (!live) return;
    *(unsigned*)(xq_row + 4 * col4) = (unsigned)(q[0] & 255) | ((unsigned)(q[1] & 255) << 8) |
                                       ((unsigned)(q[2] & 255) << 16) | ((unsigned)(q[3] & 255) << 24);
    if ((col4 & 7) == 0) xds_row[col4 >> 3] = make_float2(d, __fmul_rn(d, (float)s));
}

// x [N, K] fp32 (row stride ldx) -> xq, xds; one thread per float4
extern "C" __global__ void quantize_q8(const float* __restrict__ x, int ldx, i8* __restrict__ xq,
                                       float2* __restrict__ xds, int K, int N) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int per_row = K >> 2;
    const int n = t / per_row, c4 = t - n * per_row;
    const bool live = n < N;
    const float4 v = live ? *(const float4*)(x + (size_t)n * ldx + 4 * c4) : make_float4(0.f, 0.f, 0.f, 0.f);
    q8_store4(v, live, xq + (size_t)(live ? n : 0) * K, xds + (size_t)(live ? n : 0) * (K >> 5), c4);
}

// x += delta (in place); xq/xds = q8(x / rms(x) * w): add_rmsnorm (imp.kernels.cuda.add_rmsnorm) with its output
// quantized instead of stored. One block per row; blockDim a multiple of 32.
extern "C" __global__ void add_rmsnorm_q8(float* __restrict__ x, int ldx, const float* __restrict__ delta, int ldd,
                                          const float* __restrict__ w, i8* __restrict__ xq, float2* __restrict__ xds,
                                          int d, float eps) {
    const int r = blockIdx.x;
    float* xr = x + (size_t)r * ldx;
    const float rs = add_row_rs(xr, delta ? delta + (size_t)r * ldd : nullptr, d, eps);
    i8* qrow = xq + (size_t)r * d;
    float2* drow = xds + (size_t)r * (d >> 5);
    for (int base = 0; base < d; base += blockDim.x * 4) {  // every lane goes round (the shuffles)
        const int i = base + threadIdx.x * 4;
        const bool live = i < d;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
        if (live) {
            const float4 v = *(const float4*)(xr + i);
            const float4 g = *(const float4*)(w + i);
            o = make_float4(v.x * rs * g.x, v.y * rs * g.y, v.z * rs * g.z, v.w * rs * g.w);
        }
        q8_store4(o, live, qrow, drow, i >> 2);
    }
}

// xq/xds = q8(act(gate) * up), gu [N, 2F] (gate columns first): gated_act (imp.kernels.cuda.gated_act) quantized.
extern "C" __global__ void gated_act_q8(const float* __restrict__ gu, int ldg, i8* __restrict__ xq,
                                        float2* __restrict__ xds, int Fd, int N, int kind) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int per_row = Fd >> 2;
    const int n = t / per_row, c4 = t - n * per_row;
    const bool live = n < N;
    float o[4] = {0.f, 0.f, 0.f, 0.f};
    if (live) {
        const float* row = gu + (size_t)n * ldg + 4 * c4;
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float g = row[j], u = row[Fd + j];
            float a;
            if (kind == 0) a = g / (1.f + expf(-g));
            else a = 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
            o[j] = a * u;
        }
    }
    q8_store4(make_float4(o[0], o[1], o[2], o[3]), live, xq + (size_t)(live ? n : 0) * Fd,
              xds + (size_t)(live ? n : 0) * (Fd >> 5), c4);
}
"""

ACT_KINDS = {"silu": 0, "gelu": 1}


@dataclass
class Q8Act:
    """x quantized per block of 32: xq [N, K] int8, xds [N, K/32, 2] fp32 (xd, xd * sum xq)."""

    xq: torch.Tensor
    xds: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.xq.shape)


def empty(N: int, K: int, device) -> Q8Act:
    if K % QK:
        raise ValueError(f"K ({K}) must be a multiple of {QK}")
    return Q8Act(torch.empty(N, K, dtype=torch.int8, device=device),
                 torch.empty(N, K // QK, 2, dtype=torch.float32, device=device))


def _launch_flat(name: str, threads: int, args: tuple) -> None:
    fn = cu.function(SRC, name)
    cu.launch(fn, ((threads + 255) // 256,), (256,), args)


def quantize(x: torch.Tensor) -> Q8Act:
    """x [N, K] fp32 (row stride a multiple of 4, K a multiple of 32) -> Q8Act."""
    cu.check(x, "x", torch.float32, 2, align=16)
    N, K = x.shape
    if x.stride(0) % 4:
        raise ValueError("the row stride must be a multiple of 4")
    xa = empty(N, K, x.device)
    if N:
        _launch_flat("quantize_q8", N * K // 4, (cu.ptr(x), cu.i32(x.stride(0)), cu.ptr(xa.xq), cu.ptr(xa.xds),
                                                 cu.i32(K), cu.i32(N)))
    return xa


def add_rmsnorm_q8(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> Q8Act:
    """x [N, d] fp32 += delta (in place); returns q8(rms_norm(x) * w) (`add_rmsnorm.add_rmsnorm`'s output)."""
    N, d = check_args(x, delta, w)
    if d % QK:
        raise ValueError(f"d must be a multiple of {QK}")
    xa = empty(N, d, x.device)
    if N:
        threads = min(256, max(32, ((d // 4 + 31) // 32) * 32))
        fn = cu.function(SRC, "add_rmsnorm_q8")
        cu.launch(fn, (N,), (threads,), (
            cu.ptr(x), cu.i32(x.stride(0)), cu.ptr(delta), cu.i32(0 if delta is None else delta.stride(0)),
            cu.ptr(w), cu.ptr(xa.xq), cu.ptr(xa.xds), cu.i32(d), cu.f32(eps)))
    return xa


def gated_act_q8(gu: torch.Tensor, kind: str = "silu") -> Q8Act:
    """gu [N, 2F] fp32 (gate columns first) -> q8(act(gate) * up) (`gated_act.gated_act`'s output)."""
    cu.check(gu, "gu", torch.float32, 2)
    N, F2 = gu.shape
    Fd = F2 // 2
    if F2 % 2 or Fd % QK or gu.stride(0) % 4:
        raise ValueError(f"gu must be [N, 2F] with F a multiple of {QK} and the row stride of 4")
    xa = empty(N, Fd, gu.device)
    if N:
        _launch_flat("gated_act_q8", N * Fd // 4, (cu.ptr(gu), cu.i32(gu.stride(0)), cu.ptr(xa.xq), cu.ptr(xa.xds),
                                                   cu.i32(Fd), cu.i32(N), cu.i32(ACT_KINDS[kind])))
    return xa


# ------------------------------------------------------------------ reference (torch, any device)


def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' quantization in torch float32 ops, bit for bit: (xq int8 [N, K], xds [N, K/32, 2])."""
    N, K = x.shape
    xb = x.float().reshape(N, K // QK, QK)
    d = xb.abs().amax(-1) / 127.0  # [N, nb] float32 (IEEE division)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    u = xb * inv[..., None]
    q = torch.where(u >= 0, torch.trunc(u + 0.5), -torch.trunc(0.5 - u))
    xs = d * q.sum(-1)
    return q.to(torch.int8).reshape(N, K), torch.stack([d, xs], -1)


def dequant(xq: torch.Tensor, xds: torch.Tensor) -> torch.Tensor:
    """float64 [N, K]: xq * xd per block."""
    N, K = xq.shape
    return (xq.double().reshape(N, K // QK, QK) * xds[..., 0].double()[..., None]).reshape(N, K)
