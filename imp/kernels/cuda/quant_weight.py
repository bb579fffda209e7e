"""Quantized weights for the GPU GEMVs: the formats, the repacked layout, the references.

Formats: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K (GGML block layouts) and BF16. At load
the GGUF blocks are *repacked* (same bits, no re-quantization) so that every
load in the kernels is 8 or 16 bytes wide and aligned:

    Q4_0  qs u8 [rows, nb*16]        d f16 [rows, nb]            (nb = cols/32)
    Q4_1  qs u8 [rows, nb*16]        d, m f16 [rows, nb]
    Q8_0  qs i8 [rows, nb*32]        d f16 [rows, nb]
    Q4_K  blocks u8 [rows, ns*144]   (native: d, dmin, scales[12], qs[128]; 144 = 9*16)
    Q6_K  body u8 [rows, ns*208]     d f16 [rows, ns]            (ql, qh, scales; ns = cols/256)
    BF16  w bf16 [rows, cols]

`reference()` dequantizes a repacked weight with torch ops (any device) and
is what the kernel tests compare against; `repack()` is checked against
`imp.formats.quants.dequantize` on the CPU. The kernels: `imp.kernels.cuda.gemv_fp32_act`
(one warp a row, every format) and `imp.kernels.cuda.gemv_bf16_fused` (BF16, two rows a
warp, fused epilogues).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from imp.kernels.cuda import runtime as cu

FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "BF16")
BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q6_K": (256, 210), "BF16": (1, 2)}
BITS = {f: 8.0 * BLOCK[f][1] / BLOCK[f][0] for f in FORMATS}
TILES = (1, 2, 4, 8)  # activation rows per kernel launch (grid.y tiles larger batches)

# CUDA: the 6-bit scale and min of sub-block j (0..7) of a Q4_K super-block, from its first 16 bytes
# (h.x: d, dmin; h.y..h.w: scales[12]) as ggml's get_scale_min_k4 packs them. One copy, prepended to
# every kernel source that reads Q4_K blocks (gemv_fp32_act, gemv_int8_act, gemm_int8_act).
Q4K_SCALE_MIN_SRC = r"""
__device__ __forceinline__ unsigned q4k_byte(const uint4& h, int k) {  // byte k of scales[12]
    const unsigned wd = k < 4 ? h.y : (k < 8 ? h.z : h.w);
    return (wd >> (8 * (k & 3))) & 0xffu;
}
__device__ __forceinline__ void q4k_scale_min(int j, const uint4& h, float& sc, float& mn) {
    if (j < 4) {
        sc = (float)(q4k_byte(h, j) & 63u);
        mn = (float)(q4k_byte(h, j + 4) & 63u);
    } else {
        sc = (float)((q4k_byte(h, j + 4) & 15u) | ((q4k_byte(h, j - 4) >> 6) << 4));
        mn = (float)((q4k_byte(h, j + 4) >> 4) | ((q4k_byte(h, j) >> 6) << 4));
    }
}
"""


def tile_for(B: int) -> int:
    return 1 if B <= 1 else 2 if B == 2 else 4 if B <= 4 else 8


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


def out_for(w: QWeight, n: int, out: torch.Tensor | None, device) -> torch.Tensor:
    """The launchers' output: `out` checked as [n, w.rows] fp32 (a column slice of a wider buffer is
    fine), or a new one on `device`."""
    if out is None:
        return torch.empty(n, w.rows, dtype=torch.float32, device=device)
    cu.check(out, "out", torch.float32, 2)
    if tuple(out.shape) != (n, w.rows):
        raise ValueError(f"out shape {tuple(out.shape)}, expected {(n, w.rows)}")
    return out


def check_x(w: QWeight, x: torch.Tensor) -> tuple[int, int]:
    """(B, K) of the fp32 activations x [B, K] of a GEMV of w, checked: read as float4 (16-byte
    aligned, a row stride of whole float4s), K the weight's columns."""
    cu.check(x, "x", torch.float32, 2, align=16)
    B, K = x.shape
    if K != w.cols:
        raise ValueError(f"x has {K} columns, weight {w.cols}")
    if x.stride(0) % 4:
        raise ValueError("x row stride must be a multiple of 4 floats")
    return B, K


def check_parts(w: QWeight, names, device) -> None:
    """The named parts (None: a format without it) contiguous on the activations' device."""
    for k in names:
        if k is not None and (not w.parts[k].is_contiguous() or w.parts[k].device != device):
            raise ValueError(f"weight part {k} must be contiguous on {device}")


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

