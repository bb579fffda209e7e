"""Per-row matrix-vector products over a gathered stack of matrices (LoRA factors):

    y[n, o] (+)= sum_k W[idx[n], o, k] * x[n, k]      W [S, O, K], x [N, K] (row stride ldx), idx [N] int64

One thread per output, the sum over k in order with fmaf: a row's bits depend on the row alone,
never on how many rows share the launch. torch's `(W[idx] * x).sum(-1)` picks its reduction's
split by the tensor's shape, and bmm picks its cuBLAS kernel by the batch count: either makes a
LoRA row's numbers change with the traffic beside it (seen on the H200: one row alone vs the
same row among eight, different bits), which `--batch-invariant` promises not to do. The
products here are tiny (rank <= 64 one way, the projection's width the other), so a thread per
output costs nothing next to the projection itself.
"""

from __future__ import annotations

import torch

from imp.kernels.cuda import runtime as cu

SRC = r"""
extern "C" __global__ void gathered_mv(const float* __restrict__ w, const long long* __restrict__ idx,
                                       const float* __restrict__ x, int ldx, float* __restrict__ y, int ldy,
                                       int N, int O, int K, int accumulate) {
    const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)N * O) return;
    const int n = (int)(t / O), o = (int)(t % O);
    const float* wr = w + (idx[n] * O + o) * (long long)K;
    const float* xr = x + (long long)n * ldx;
    float s = 0.f;
    for (int k = 0; k < K; ++k) s = fmaf(wr[k], xr[k], s);
    float* out = y + (long long)n * ldy + o;
    *out = accumulate ? *out + s : s;
}
"""


def gathered_mv(w: torch.Tensor, idx: torch.Tensor, x: torch.Tensor, y: torch.Tensor | None = None,
                accumulate: bool = False) -> torch.Tensor:
    """y [N, O] fp32 (may be a column slice of a wider buffer) = or += W[idx] @ x per row; w [S, O, K] fp32
    contiguous, idx [N] int64, x [N, K] fp32 (unit column stride)."""
    S, O, K = w.shape
    N = x.shape[0]
    cu.check(w, "w", torch.float32, 3)
    cu.check(idx, "idx", torch.int64, 1)
    if not w.is_contiguous() or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != K or x.stride(1) != 1:
        raise ValueError(f"gathered_mv: w {tuple(w.shape)} contiguous, x [N, {K}] fp32 rows, got {tuple(x.shape)}")
    if idx.shape[0] != N:
        raise ValueError(f"gathered_mv: {idx.shape[0]} indices for {N} rows")
    if y is None:
        if accumulate:
            raise ValueError("gathered_mv: accumulate needs y")
        y = torch.empty(N, O, dtype=torch.float32, device=x.device)
    if y.dtype != torch.float32 or tuple(y.shape) != (N, O) or y.stride(1) != 1:
        raise ValueError(f"gathered_mv: y must be [{N}, {O}] fp32 with unit column stride")
    if N * O:
        cu.launch(cu.function(SRC, "gathered_mv"), ((N * O + 127) // 128,), (128,),
                  (cu.ptr(w), cu.ptr(idx), cu.ptr(x), cu.i32(x.stride(0)), cu.ptr(y), cu.i32(y.stride(0)),
                   cu.i32(N), cu.i32(O), cu.i32(K), cu.i32(int(accumulate))))
    return y


def reference(w: torch.Tensor, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float64 W[idx] @ x per row."""
    return torch.einsum("nok,nk->no", w.double()[idx], x.double())
