"""Quantized GEMV (decode matmul) y[b] = W @ x[b], dequantizing in registers.

Formats: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K (GGML block layouts) and BF16. At load
the GGUF blocks are *repacked* (same bits, no re-quantization) so that every
load in the kernel is 8 or 16 bytes wide and aligned:

    Q4_0  qs u8 [rows, nb*16]        d f16 [rows, nb]            (nb = cols/32)
    Q4_1  qs u8 [rows, nb*16]        d, m f16 [rows, nb]
    Q8_0  qs i8 [rows, nb*32]        d f16 [rows, nb]
    Q4_K  blocks u8 [rows, ns*144]   (native: d, dmin, scales[12], qs[128]; 144 = 9*16)
    Q6_K  body u8 [rows, ns*208]     d f16 [rows, ns]            (ql, qh, scales; ns = cols/256)
    BF16  w bf16 [rows, cols]

Kernel shape: one warp per output row, 4 warps a block; lanes stride over the
row's chunks (32 elements of a block, 64 of a Q4_K sub-block pair, 8 of bf16)
so a warp reads one contiguous stretch per iteration. Activations x are fp32
[B, K] (row stride ldx) read through the read-only cache; a launch handles a
tile of BT <= 8 activation rows (grid.y tiles larger batches). Accumulation in
fp32, one warp reduction per activation row at the end.

Roofline (decode, batch 1): bytes = weight bytes (bits/8 * rows * cols) +
x; arithmetic is negligible, so time >= bytes / copy-rate.

`reference()` dequantizes a repacked weight with torch ops (any device) and
is what the tests compare against; `repack()` is checked against
`imp.formats.quants.dequantize` on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from imp.kernels import _cuda as cu

FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "BF16")
BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210), "BF16": (1, 2)}
BITS = {f: 8.0 * BLOCK[f][1] / BLOCK[f][0] for f in FORMATS}
TILES = (1, 2, 4, 8)
WARPS = 4


@dataclass
class QWeight:
    """A [rows, cols] weight in one of FORMATS, repacked for the kernel."""

    fmt: str
    rows: int
    cols: int
    parts: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device) -> "QWeight":
        return QWeight(self.fmt, self.rows, self.cols, {k: v.to(device) for k, v in self.parts.items()})

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.parts.values())


def cat_rows(ws: list[QWeight]) -> QWeight:
    """Stack weights of one format along rows (fused QKV, gate+up)."""
    f = ws[0].fmt
    assert all(w.fmt == f and w.cols == ws[0].cols for w in ws)
    parts = {k: torch.cat([w.parts[k] for w in ws]) for k in ws[0].parts}
    return QWeight(f, sum(w.rows for w in ws), ws[0].cols, parts)


# ------------------------------------------------------------------ repack (CPU, numpy)


def repack(raw: np.ndarray, fmt: str, rows: int, cols: int) -> QWeight:
    """GGUF tensor bytes (any shape, `rows*cols` elements in file order) -> QWeight on CPU."""
    assert fmt in FORMATS, fmt
    be, bs = BLOCK[fmt]
    assert cols % be == 0, (fmt, cols)
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, cols // be, bs)
    nb = cols // be

    def t(a, dtype=None):
        a = np.ascontiguousarray(a)
        out = torch.from_numpy(a.copy())
        return out if dtype is None else out.view(dtype)

    if fmt == "BF16":
        return QWeight(fmt, rows, cols, {"w": t(b.reshape(rows, cols * 2)).view(torch.bfloat16)})
    if fmt == "Q4_0":
        return QWeight(fmt, rows, cols, {"qs": t(b[:, :, 2:].reshape(rows, nb * 16)), "d": t(b[:, :, 0:2].reshape(rows, nb * 2)).view(torch.float16)})
    if fmt == "Q4_1":
        return QWeight(fmt, rows, cols, {
            "qs": t(b[:, :, 4:].reshape(rows, nb * 16)),
            "d": t(b[:, :, 0:2].reshape(rows, nb * 2)).view(torch.float16),
            "m": t(b[:, :, 2:4].reshape(rows, nb * 2)).view(torch.float16),
        })
    if fmt == "Q8_0":
        return QWeight(fmt, rows, cols, {"qs": t(b[:, :, 2:].reshape(rows, nb * 32)).view(torch.int8), "d": t(b[:, :, 0:2].reshape(rows, nb * 2)).view(torch.float16)})
    if fmt == "Q4_K":
        return QWeight(fmt, rows, cols, {"blocks": t(b.reshape(rows, nb * 144))})
    if fmt == "Q6_K":
        return QWeight(fmt, rows, cols, {"body": t(b[:, :, :208].reshape(rows, nb * 208)), "d": t(b[:, :, 208:210].reshape(rows, nb * 2)).view(torch.float16)})
    raise AssertionError(fmt)


# ------------------------------------------------------------------ reference (torch, any device)


def _nib(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = q.to(torch.int32)
    return q & 15, q >> 4


def reference(w: QWeight) -> torch.Tensor:
    """Dequantize to float32 [rows, cols] with plain torch ops (same device as w)."""
    R, C, p = w.rows, w.cols, w.parts
    if w.fmt == "BF16":
        return p["w"].float()
    if w.fmt in ("Q4_0", "Q4_1"):
        lo, hi = _nib(p["qs"].view(R, C // 32, 16))
        q = torch.cat([lo, hi], -1).float()  # [R, nb, 32]
        d = p["d"].float()[:, :, None]
        if w.fmt == "Q4_0":
            return (d * (q - 8)).reshape(R, C)
        return (d * q + p["m"].float()[:, :, None]).reshape(R, C)
    if w.fmt == "Q8_0":
        return (p["d"].float()[:, :, None] * p["qs"].view(R, C // 32, 32).float()).reshape(R, C)
    if w.fmt == "Q4_K":
        b = p["blocks"].view(R, C // 256, 144)
        d = b[..., 0:2].contiguous().view(torch.float16).float()  # [R, ns, 1]
        dmin = b[..., 2:4].contiguous().view(torch.float16).float()
        s12 = b[..., 4:16].to(torch.int32)
        a, m, hi = s12[..., 0:4], s12[..., 4:8], s12[..., 8:12]
        sc = torch.cat([a & 63, (hi & 15) | ((a >> 6) << 4)], -1).float()  # [R, ns, 8]
        mn = torch.cat([m & 63, (hi >> 4) | ((m >> 6) << 4)], -1).float()
        lo, hi4 = _nib(b[..., 16:].reshape(R, C // 256, 4, 32))
        q = torch.stack([lo, hi4], dim=3).reshape(R, C // 256, 8, 32).float()
        return ((d * sc)[..., None] * q - (dmin * mn)[..., None]).reshape(R, C)
    if w.fmt == "Q6_K":
        ns = C // 256
        body = p["body"].view(R, ns, 208)
        ql = body[..., :128].reshape(R, ns, 2, 64).to(torch.int32)
        qh = body[..., 128:192].reshape(R, ns, 2, 32).to(torch.int32)
        quarters = []
        for k in range(4):
            src = ql[..., (k % 2) * 32:(k % 2) * 32 + 32]
            low = (src & 15) if k < 2 else (src >> 4)
            quarters.append(low | (((qh >> (2 * k)) & 3) << 4))
        q = (torch.stack(quarters, dim=3) - 32).reshape(R, ns, 16, 16).float()  # [R, ns, 16, 16]
        sc = body[..., 192:208].contiguous().view(torch.int8).float()  # [R, ns, 16]
        d = p["d"].float()[:, :, None]  # [R, ns, 1]
        return ((d * sc)[..., None] * q).reshape(R, C)
    raise AssertionError(w.fmt)


def gemv_reference(w: QWeight, x: torch.Tensor) -> torch.Tensor:
    """x [B, K] -> [B, N] in float64 (the tests' yardstick)."""
    return x.double() @ reference(w).double().T


# ------------------------------------------------------------------ CUDA

SRC = r"""
#define WARPS 4
__device__ __forceinline__ void unpack_nib(unsigned a, unsigned b, float (&lo)[8], float (&hi)[8]) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned ba = (a >> (8 * i)) & 0xffu, bb = (b >> (8 * i)) & 0xffu;
        lo[i] = (float)(ba & 15u); hi[i] = (float)(ba >> 4);
        lo[4 + i] = (float)(bb & 15u); hi[4 + i] = (float)(bb >> 4);
    }
}
__device__ __forceinline__ void unpack_i8(unsigned a, unsigned b, float s, float (&w)[8]) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[i] = s * (float)(signed char)((a >> (8 * i)) & 0xffu);
        w[4 + i] = s * (float)(signed char)((b >> (8 * i)) & 0xffu);
    }
}
template <int BT>
__device__ __forceinline__ void fma8(float (&acc)[BT], const float* __restrict__ x, int ldx, int nact, int col, const float (&w)[8]) {
    #pragma unroll
    for (int b = 0; b < BT; ++b) {
        if (b < nact) {
            const float4 a = __ldg((const float4*)(x + (size_t)b * ldx + col));
            const float4 c = __ldg((const float4*)(x + (size_t)b * ldx + col + 4));
            float s = acc[b];
            s = fmaf(w[0], a.x, s); s = fmaf(w[1], a.y, s); s = fmaf(w[2], a.z, s); s = fmaf(w[3], a.w, s);
            s = fmaf(w[4], c.x, s); s = fmaf(w[5], c.y, s); s = fmaf(w[6], c.z, s); s = fmaf(w[7], c.w, s);
            acc[b] = s;
        }
    }
}

#define PROLOGUE                                                        \
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;         \
    const int row = blockIdx.x * WARPS + warp;                          \
    if (row >= N) return;                                               \
    const int b0 = blockIdx.y * BT;                                     \
    const int nact = min(BT, B - b0);                                   \
    x += (size_t)b0 * ldx;                                              \
    y += (size_t)b0 * ldy;                                              \
    float acc[BT];                                                      \
    _Pragma("unroll") for (int b = 0; b < BT; ++b) acc[b] = 0.f;

#define EPILOGUE                                                        \
    _Pragma("unroll") for (int b = 0; b < BT; ++b) {                    \
        const float v = warp_sum(acc[b]);                               \
        if (lane == 0 && b < nact) y[(size_t)b * ldy + row] = v;        \
    }

#define ARGS const float* __restrict__ x, int ldx, float* __restrict__ y, int ldy, int N, int K, int B

template <int BT>
__global__ void __launch_bounds__(128) gemv_q4_0(const u8* __restrict__ qs, const u16* __restrict__ d, ARGS) {
    PROLOGUE
    const int nb = K >> 5;
    const u8* qr = qs + (size_t)row * nb * 16;
    const u16* dr = d + (size_t)row * nb;
    #pragma unroll 2
    for (int c = lane; c < nb; c += 32) {
        const uint4 q = __ldg((const uint4*)(qr + (size_t)c * 16));
        const float s = h2f(__ldg(dr + c));
        float lo[8], hi[8], w[8];
        unpack_nib(q.x, q.y, lo, hi);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = s * (lo[i] - 8.f);
        fma8<BT>(acc, x, ldx, nact, c * 32, w);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = s * (hi[i] - 8.f);
        fma8<BT>(acc, x, ldx, nact, c * 32 + 16, w);
        unpack_nib(q.z, q.w, lo, hi);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = s * (lo[i] - 8.f);
        fma8<BT>(acc, x, ldx, nact, c * 32 + 8, w);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = s * (hi[i] - 8.f);
        fma8<BT>(acc, x, ldx, nact, c * 32 + 24, w);
    }
    EPILOGUE
}

template <int BT>
__global__ void __launch_bounds__(128) gemv_q4_1(const u8* __restrict__ qs, const u16* __restrict__ d, const u16* __restrict__ m, ARGS) {
    PROLOGUE
    const int nb = K >> 5;
    const u8* qr = qs + (size_t)row * nb * 16;
    const u16* dr = d + (size_t)row * nb;
    const u16* mr = m + (size_t)row * nb;
    #pragma unroll 2
    for (int c = lane; c < nb; c += 32) {
        const uint4 q = __ldg((const uint4*)(qr + (size_t)c * 16));
        const float s = h2f(__ldg(dr + c)), mm = h2f(__ldg(mr + c));
        float lo[8], hi[8], w[8];
        unpack_nib(q.x, q.y, lo, hi);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = s * lo[i] + mm;
        fma8<BT>(acc, x, ldx, nact, c * 32, w);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = s * hi[i] + mm;
        fma8<BT>(acc, x, ldx, nact, c * 32 + 16, w);
        unpack_nib(q.z, q.w, lo, hi);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = s * lo[i] + mm;
        fma8<BT>(acc, x, ldx, nact, c * 32 + 8, w);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = s * hi[i] + mm;
        fma8<BT>(acc, x, ldx, nact, c * 32 + 24, w);
    }
    EPILOGUE
}

template <int BT>
__global__ void __launch_bounds__(128) gemv_q8_0(const u8* __restrict__ qs, const u16* __restrict__ d, ARGS) {
    PROLOGUE
    const int nb = K >> 5;
    const u8* qr = qs + (size_t)row * nb * 32;
    const u16* dr = d + (size_t)row * nb;
    #pragma unroll 2
    for (int c = lane; c < nb; c += 32) {
        const uint4 q0 = __ldg((const uint4*)(qr + (size_t)c * 32));
        const uint4 q1 = __ldg((const uint4*)(qr + (size_t)c * 32 + 16));
        const float s = h2f(__ldg(dr + c));
        float w[8];
        unpack_i8(q0.x, q0.y, s, w); fma8<BT>(acc, x, ldx, nact, c * 32, w);
        unpack_i8(q0.z, q0.w, s, w); fma8<BT>(acc, x, ldx, nact, c * 32 + 8, w);
        unpack_i8(q1.x, q1.y, s, w); fma8<BT>(acc, x, ldx, nact, c * 32 + 16, w);
        unpack_i8(q1.z, q1.w, s, w); fma8<BT>(acc, x, ldx, nact, c * 32 + 24, w);
    }
    EPILOGUE
}

__device__ __forceinline__ unsigned kbyte(const uint4& h, int k) {  // byte k of scales[12] (h.y, h.z, h.w)
    const unsigned wd = k < 4 ? h.y : (k < 8 ? h.z : h.w);
    return (wd >> (8 * (k & 3))) & 0xffu;
}
__device__ __forceinline__ void scale_min_k4(int j, const uint4& h, float& sc, float& mn) {
    if (j < 4) {
        sc = (float)(kbyte(h, j) & 63u);
        mn = (float)(kbyte(h, j + 4) & 63u);
    } else {
        sc = (float)((kbyte(h, j + 4) & 15u) | ((kbyte(h, j - 4) >> 6) << 4));
        mn = (float)((kbyte(h, j + 4) >> 4) | ((kbyte(h, j) >> 6) << 4));
    }
}

template <int BT>
__global__ void __launch_bounds__(128) gemv_q4_k(const u8* __restrict__ blocks, ARGS) {
    PROLOGUE
    const int ns = K >> 8;
    const u8* br = blocks + (size_t)row * ns * 144;
    const int nc = ns * 4;  // chunks: (super-block, pair of 32-element sub-blocks)
    #pragma unroll 2
    for (int c = lane; c < nc; c += 32) {
        const int sb = c >> 2, p = c & 3;
        const u8* blk = br + (size_t)sb * 144;
        const uint4 h = __ldg((const uint4*)blk);
        const uint4 qa = __ldg((const uint4*)(blk + 16 + 32 * p));
        const uint4 qb = __ldg((const uint4*)(blk + 32 + 32 * p));
        const float dd = h2f((u16)(h.x & 0xffffu)), dmin = h2f((u16)(h.x >> 16));
        float sc0, m0, sc1, m1;
        scale_min_k4(2 * p, h, sc0, m0);
        scale_min_k4(2 * p + 1, h, sc1, m1);
        const float ds0 = dd * sc0, dm0 = dmin * m0, ds1 = dd * sc1, dm1 = dmin * m1;
        const int col = sb * 256 + 64 * p;
        float lo[8], hi[8], w[8];
        unpack_nib(qa.x, qa.y, lo, hi);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = ds0 * lo[i] - dm0;
        fma8<BT>(acc, x, ldx, nact, col, w);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = ds1 * hi[i] - dm1;
        fma8<BT>(acc, x, ldx, nact, col + 32, w);
        unpack_nib(qa.z, qa.w, lo, hi);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = ds0 * lo[i] - dm0;
        fma8<BT>(acc, x, ldx, nact, col + 8, w);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = ds1 * hi[i] - dm1;
        fma8<BT>(acc, x, ldx, nact, col + 40, w);
        unpack_nib(qb.x, qb.y, lo, hi);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = ds0 * lo[i] - dm0;
        fma8<BT>(acc, x, ldx, nact, col + 16, w);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = ds1 * hi[i] - dm1;
        fma8<BT>(acc, x, ldx, nact, col + 48, w);
        unpack_nib(qb.z, qb.w, lo, hi);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = ds0 * lo[i] - dm0;
        fma8<BT>(acc, x, ldx, nact, col + 24, w);
        #pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = ds1 * hi[i] - dm1;
        fma8<BT>(acc, x, ldx, nact, col + 56, w);
    }
    EPILOGUE
}

template <int BT>
__global__ void __launch_bounds__(128) gemv_q6_k(const u8* __restrict__ body, const u16* __restrict__ d, ARGS) {
    PROLOGUE
    const int ns = K >> 8;
    const u8* br = body + (size_t)row * ns * 208;
    const u16* dr = d + (size_t)row * ns;
    const int nc = ns * 8;  // chunks: (super-block, half h, group g of 8 l's) -> 32 elements
    #pragma unroll 2
    for (int c = lane; c < nc; c += 32) {
        const int sb = c >> 3, hf = (c >> 2) & 1, g = c & 3, l0 = 8 * g;
        const u8* blk = br + (size_t)sb * 208;
        const uint2 qa = __ldg((const uint2*)(blk + 64 * hf + l0));
        const uint2 qb = __ldg((const uint2*)(blk + 64 * hf + 32 + l0));
        const uint2 qh = __ldg((const uint2*)(blk + 128 + 32 * hf + l0));
        const float dd = h2f(__ldg(dr + sb));
        const signed char* scp = (const signed char*)(blk + 192 + 8 * hf + (g >> 1));
        float ds[4];
        #pragma unroll
        for (int k = 0; k < 4; ++k) ds[k] = dd * (float)__ldg(scp + 2 * k);
        const int col = sb * 256 + 128 * hf + l0;
        float w0[8], w1[8], w2[8], w3[8];
        #pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned a = ((i < 4 ? qa.x : qa.y) >> (8 * (i & 3))) & 0xffu;
            const unsigned b = ((i < 4 ? qb.x : qb.y) >> (8 * (i & 3))) & 0xffu;
            const unsigned hh = ((i < 4 ? qh.x : qh.y) >> (8 * (i & 3))) & 0xffu;
            w0[i] = ds[0] * (float)((int)((a & 15u) | ((hh & 3u) << 4)) - 32);
            w1[i] = ds[1] * (float)((int)((b & 15u) | (((hh >> 2) & 3u) << 4)) - 32);
            w2[i] = ds[2] * (float)((int)((a >> 4) | (((hh >> 4) & 3u) << 4)) - 32);
            w3[i] = ds[3] * (float)((int)((b >> 4) | (((hh >> 6) & 3u) << 4)) - 32);
        }
        fma8<BT>(acc, x, ldx, nact, col, w0);
        fma8<BT>(acc, x, ldx, nact, col + 32, w1);
        fma8<BT>(acc, x, ldx, nact, col + 64, w2);
        fma8<BT>(acc, x, ldx, nact, col + 96, w3);
    }
    EPILOGUE
}

template <int BT>
__global__ void __launch_bounds__(128) gemv_bf16(const u16* __restrict__ wt, ARGS) {
    PROLOGUE
    const int nc = K >> 3;
    const u16* wr = wt + (size_t)row * K;
    #pragma unroll 4
    for (int c = lane; c < nc; c += 32) {
        const uint4 q = __ldg((const uint4*)(wr + (size_t)c * 8));
        float w[8];
        w[0] = __uint_as_float(q.x << 16); w[1] = __uint_as_float(q.x & 0xffff0000u);
        w[2] = __uint_as_float(q.y << 16); w[3] = __uint_as_float(q.y & 0xffff0000u);
        w[4] = __uint_as_float(q.z << 16); w[5] = __uint_as_float(q.z & 0xffff0000u);
        w[6] = __uint_as_float(q.w << 16); w[7] = __uint_as_float(q.w & 0xffff0000u);
        fma8<BT>(acc, x, ldx, nact, c * 8, w);
    }
    EPILOGUE
}
"""

_KNAME = {"Q4_0": "gemv_q4_0", "Q4_1": "gemv_q4_1", "Q8_0": "gemv_q8_0", "Q4_K": "gemv_q4_k", "Q6_K": "gemv_q6_k", "BF16": "gemv_bf16"}
_PARTS = {"Q4_0": ("qs", "d"), "Q4_1": ("qs", "d", "m"), "Q8_0": ("qs", "d"), "Q4_K": ("blocks",), "Q6_K": ("body", "d"), "BF16": ("w",)}
_NAMES = tuple(f"{k}<{bt}>" for k in _KNAME.values() for bt in TILES)


def tile_for(B: int) -> int:
    return 1 if B <= 1 else 2 if B == 2 else 4 if B <= 4 else 8


def gemv(w: QWeight, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[B, N] (fp32, may be a column slice of a wider buffer) = x[B, K] @ W.T."""
    cu.check(x, "x", torch.float32, 2, align=16)
    B, K = x.shape
    if K != w.cols:
        raise ValueError(f"x has {K} columns, weight {w.cols}")
    if x.stride(0) % 4:
        raise ValueError("x row stride must be a multiple of 4 floats")
    if out is None:
        out = torch.empty(B, w.rows, dtype=torch.float32, device=x.device)
    cu.check(out, "out", torch.float32, 2)
    if tuple(out.shape) != (B, w.rows):
        raise ValueError(f"out shape {tuple(out.shape)}, expected {(B, w.rows)}")
    if B == 0:
        return out
    for k in _PARTS[w.fmt]:
        t = w.parts[k]
        if not t.is_contiguous() or t.device != x.device:
            raise ValueError(f"weight part {k} must be contiguous on {x.device}")
    bt = tile_for(B)
    fn = cu.function(SRC, f"{_KNAME[w.fmt]}<{bt}>", _NAMES)
    args = tuple(cu.ptr(w.parts[k]) for k in _PARTS[w.fmt]) + (
        cu.ptr(x), cu.i32(x.stride(0)), cu.ptr(out), cu.i32(out.stride(0)), cu.i32(w.rows), cu.i32(K), cu.i32(B)
    )
    grid = ((w.rows + WARPS - 1) // WARPS, (B + bt - 1) // bt)
    cu.launch(fn, grid, (32 * WARPS,), args)
    return out


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
    cu.check(x, "x", torch.float32, 2, align=16)
    B, K = x.shape
    if K != w.cols:
        raise ValueError(f"x has {K} columns, weight {w.cols}")
    if x.stride(0) % 4:
        raise ValueError("x row stride must be a multiple of 4 floats")
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
