"""Gated MLP activation: out = act(gate) * up, gate/up the two halves of [N, 2F].

act = SiLU (llama) or GeLU-tanh (gemma). Elementwise, memory-bound: reads
2F, writes F floats a row; at decode it is launch-bound.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from imp.kernels.cuda import runtime as cu

KINDS = {"silu": 0, "gelu": 1}

SRC = r"""
extern "C" __global__ void gated_act(const float* __restrict__ gu, int ldg, float* __restrict__ out, int ldo,
                                     int Fd, int N, int kind) {
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)N * Fd) return;
    const int n = (int)(idx / Fd), f = (int)(idx % Fd);
    const float g = gu[(size_t)n * ldg + f], u = gu[(size_t)n * ldg + Fd + f];
    float a;
    if (kind == 0) a = g / (1.f + expf(-g));
    else a = 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    out[(size_t)n * ldo + f] = a * u;
}
"""


def gated_act(gu: torch.Tensor, kind: str = "silu", out: torch.Tensor | None = None) -> torch.Tensor:
    """gu [N, 2F] fp32 (gate columns first) -> [N, F] fp32."""
    cu.check(gu, "gu", torch.float32, 2)
    N, F2 = gu.shape
    if F2 % 2:
        raise ValueError("gu must have an even number of columns")
    Fd = F2 // 2
    if out is None:
        out = torch.empty(N, Fd, dtype=torch.float32, device=gu.device)
    cu.check(out, "out", torch.float32, 2)
    if tuple(out.shape) != (N, Fd):
        raise ValueError("out shape")
    total = N * Fd
    if total:
        fn = cu.function(SRC, "gated_act")
        cu.launch(fn, ((total + 255) // 256,), (256,), (
            cu.ptr(gu), cu.i32(gu.stride(0)), cu.ptr(out), cu.i32(out.stride(0)), cu.i32(Fd), cu.i32(N), cu.i32(KINDS[kind])))
    return out


def reference(gu: torch.Tensor, kind: str = "silu") -> torch.Tensor:
    g, u = gu.double().chunk(2, dim=-1)
    a = F.silu(g) if kind == "silu" else F.gelu(g, approximate="tanh")
    return a * u
