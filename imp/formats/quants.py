"""Dequantization of GGUF tensor data to float32, in vectorized numpy.

Every function takes the raw block bytes of a tensor as a uint8 array (any
shape; what `gguf.GGUFReader` gives is `[rows, bytes_per_row]`) and returns a
flat float32 array of the logical elements, in file order. `dequantize()`
dispatches on the GGML type and reshapes to the logical numpy shape (the
reverse of GGUF's ne[] order: `[rows, cols]` for a matrix).

Block layouts follow ggml-quants.c; each function carries a short layout
note. All of them work on `[n_blocks, type_size]` uint8 views, so one call
processes the whole tensor with no Python loop over blocks. We keep our own
copies (rather than calling `gguf.quants`) so the loader's behaviour does not
shift with the gguf package version; the tests compare against it.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

QK_K = 256


class UnsupportedQuantError(ValueError):
    """A tensor uses a GGML type this loader cannot dequantize."""

    def __init__(self, tensor: str, qtype: object):
        name = getattr(qtype, "name", str(qtype))
        super().__init__(f"tensor {tensor!r}: unsupported GGML quant type {name}")
        self.tensor = tensor
        self.qtype = qtype


def _blocks(data: np.ndarray, qtype: T) -> np.ndarray:
    """[n_blocks, type_size] uint8 view of the raw bytes."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    assert raw.size % type_size == 0, (raw.size, type_size, qtype)
    return raw.reshape(-1, type_size)


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> [n, 1] float32 (little-endian half)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes -> [n, 32]: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


# ---------------------------------------------------------------- plain floats


def deq_f32(data: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(data).view(np.float32).reshape(-1).astype(np.float32, copy=False)


def deq_f16(data: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(data).view(np.float16).reshape(-1).astype(np.float32)


def deq_bf16(data: np.ndarray) -> np.ndarray:
    # bf16 is the high half of an fp32: shift into place.
    u16 = np.ascontiguousarray(data).view(np.uint16).reshape(-1)
    return (u16.astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------- 32-wide blocks


def deq_q8_0(data: np.ndarray) -> np.ndarray:
    # d:f16 | qs:int8[32]          x = d * q
    b = _blocks(data, T.Q8_0)
    return (_f16(b[:, :2]) * b[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)


def deq_q4_0(data: np.ndarray) -> np.ndarray:
    # d:f16 | qs:u8[16]            x = d * (q - 8)
    b = _blocks(data, T.Q4_0)
    q = _nibbles(b[:, 2:]).astype(np.int8) - 8
    return (_f16(b[:, :2]) * q.astype(np.float32)).reshape(-1)


def deq_q4_1(data: np.ndarray) -> np.ndarray:
    # d:f16 | m:f16 | qs:u8[16]    x = d * q + m
    b = _blocks(data, T.Q4_1)
    q = _nibbles(b[:, 4:]).astype(np.float32)
    return (_f16(b[:, :2]) * q + _f16(b[:, 2:4])).reshape(-1)


def _fifth_bit(qh4: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of a little-endian u32 -> [n, 32] bit j of it, shifted to 0x10."""
    qh = np.ascontiguousarray(qh4).view("<u4")  # [n, 1]
    bits = (qh >> np.arange(32, dtype=np.uint32)) & 1
    return (bits << 4).astype(np.uint8)


def deq_q5_0(data: np.ndarray) -> np.ndarray:
    # d:f16 | qh:u32 | qs:u8[16]   q = nibble | bit_j(qh) << 4;  x = d * (q - 16)
    b = _blocks(data, T.Q5_0)
    q = (_nibbles(b[:, 6:]) | _fifth_bit(b[:, 2:6])).astype(np.int8) - 16
    return (_f16(b[:, :2]) * q.astype(np.float32)).reshape(-1)


def deq_q5_1(data: np.ndarray) -> np.ndarray:
    # d:f16 | m:f16 | qh:u32 | qs:u8[16]   x = d * q + m
    b = _blocks(data, T.Q5_1)
    q = (_nibbles(b[:, 8:]) | _fifth_bit(b[:, 4:8])).astype(np.float32)
    return (_f16(b[:, :2]) * q + _f16(b[:, 2:4])).reshape(-1)


IQ4_NL_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)


def deq_iq4_nl(data: np.ndarray) -> np.ndarray:
    # d:f16 | qs:u8[16]            x = d * kvalues[nibble]   (non-linear 4-bit grid)
    b = _blocks(data, T.IQ4_NL)
    return (_f16(b[:, :2]) * IQ4_NL_VALUES[_nibbles(b[:, 2:])]).reshape(-1)


# ---------------------------------------------------------------- k-quants (256-wide super-blocks)


def _k_scale_min(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K packed 6-bit scales and mins: [n, 12] -> ([n, 8], [n, 8]).

    bytes 0..3: low 6 bits = scale 0..3, top 2 bits = high bits of scale 4..7
    bytes 4..7: low 6 bits = min 0..3,   top 2 bits = high bits of min 4..7
    bytes 8..11: low nibble = low bits of scale 4..7, high nibble = of min 4..7
    """
    a, m, hi = sc12[:, 0:4], sc12[:, 4:8], sc12[:, 8:12]
    sc = np.concatenate([a & 0x3F, (hi & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([m & 0x3F, (hi >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 128] -> [n, 8, 32]: each 32-byte chunk gives sub-block 2i (low) and 2i+1 (high)."""
    n = qs.shape[0]
    c = qs.reshape(n, 4, 1, 32)
    return np.concatenate([c & 0x0F, c >> 4], axis=2).reshape(n, 8, 32)


def deq_q4_k(data: np.ndarray) -> np.ndarray:
    # d:f16 | dmin:f16 | scales:u8[12] | qs:u8[128]; 8 sub-blocks of 32
    # x = d * sc[j] * q - dmin * m[j]
    b = _blocks(data, T.Q4_K)
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc)[:, :, None]
    dm = (_f16(b[:, 2:4]) * mn)[:, :, None]
    q = _k_nibbles(b[:, 16:]).astype(np.float32)
    return (d * q - dm).reshape(n * QK_K)


def deq_q5_k(data: np.ndarray) -> np.ndarray:
    # d | dmin | scales[12] | qh:u8[32] | qs:u8[128]; bit j of qh[l] is the 5th bit
    # of element l of sub-block j.
    b = _blocks(data, T.Q5_K)
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc)[:, :, None]
    dm = (_f16(b[:, 2:4]) * mn)[:, :, None]
    qh = b[:, 16:48][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]  # [n, 8, 32]
    q = (_k_nibbles(b[:, 48:]) | ((qh & 1) << 4)).astype(np.float32)
    return (d * q - dm).reshape(n * QK_K)


def deq_q6_k(data: np.ndarray) -> np.ndarray:
    # ql:u8[128] | qh:u8[64] | scales:i8[16] | d:f16; two halves of 128 elements.
    # In each half: ql[0:32] low/high nibbles -> elements 0..31 / 64..95,
    # ql[32:64] -> 32..63 / 96..127; qh[0:32] bit pairs 0,2,4,6 -> quarters 0..3.
    b = _blocks(data, T.Q6_K)
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 1, 64)
    ql = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 2, 4, 32)  # quarters 0,1,2,3
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
    q = (ql | ((qh & 3) << 4)).astype(np.int8) - 32  # [n, 2, 4, 32]
    sc = b[:, 192:208].view(np.int8).astype(np.float32)  # 16 scales, one per 16 elements
    d = (_f16(b[:, 208:210]) * sc).reshape(n, 16, 1)
    return (d * q.reshape(n, 16, 16).astype(np.float32)).reshape(n * QK_K)


def deq_q2_k(data: np.ndarray) -> np.ndarray:
    # scales:u8[16] (low nibble scale, high nibble min) | qs:u8[64] | d:f16 | dmin:f16
    # each 128-element half: qs[32] bytes, 2-bit fields at shift 0,2,4,6 give 4 x 32.
    b = _blocks(data, T.Q2_K)
    n = b.shape[0]
    scales = b[:, :16]
    qs = b[:, 16:80].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]
    q = (qs & 3).reshape(n, 16, 16).astype(np.float32)
    dl = (_f16(b[:, 80:82]) * (scales & 0x0F).astype(np.float32))[:, :, None]
    ml = (_f16(b[:, 82:84]) * (scales >> 4).astype(np.float32))[:, :, None]
    return (dl * q - ml).reshape(n * QK_K)


def deq_q3_k(data: np.ndarray) -> np.ndarray:
    # hmask:u8[32] | qs:u8[64] | scales:u8[12] (16 x 6-bit, offset 32) | d:f16
    # q = 2 low bits from qs, minus 4 when the hmask bit is CLEAR.
    b = _blocks(data, T.Q3_K)
    n = b.shape[0]
    sc = b[:, 96:108]
    lo = np.concatenate([sc[:, 0:8] & 0x0F, sc[:, 0:8] >> 4], axis=-1)  # scales 0..15 low bits
    hi = (sc[:, 8:12][:, None, :] >> np.array([0, 2, 4, 6], np.uint8)[None, :, None]) & 3
    s = (lo | (hi.reshape(n, 16) << 4)).astype(np.int8) - 32
    d = (_f16(b[:, 108:110]) * s.astype(np.float32))[:, :, None]  # [n, 16, 1]
    ql = (b[:, 32:96].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
    hm = (b[:, 0:32][:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [n, 8, 32]
    q = ql.reshape(n, 8, 32).astype(np.int8) - ((1 - hm) << 2).astype(np.int8)
    return (d * q.reshape(n, 16, 16).astype(np.float32)).reshape(n * QK_K)


def deq_iq4_xs(data: np.ndarray) -> np.ndarray:
    # d:f16 | scales_h:u16 | scales_l:u8[4] | qs:u8[128]; 8 sub-blocks of 32 with
    # 6-bit scales (offset 32), values through the IQ4_NL grid.
    b = _blocks(data, T.IQ4_XS)
    n = b.shape[0]
    sh = np.ascontiguousarray(b[:, 2:4]).view("<u2")  # [n, 1]
    sh = (sh >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [n, 8]
    sl = b[:, 4:8]
    sl = np.stack([sl & 0x0F, sl >> 4], axis=-1).reshape(n, 8)
    s = (sl | (sh.astype(np.uint8) << 4)).astype(np.int8) - 32
    d = (_f16(b[:, 0:2]) * s.astype(np.float32))[:, :, None]
    qs = b[:, 8:].reshape(n, 8, 16)
    q = IQ4_NL_VALUES[np.concatenate([qs & 0x0F, qs >> 4], axis=-1)]  # [n, 8, 32]
    return (d * q).reshape(n * QK_K)


DEQUANT = {
    T.F32: deq_f32,
    T.F16: deq_f16,
    T.BF16: deq_bf16,
    T.Q8_0: deq_q8_0,
    T.Q4_0: deq_q4_0,
    T.Q4_1: deq_q4_1,
    T.Q5_0: deq_q5_0,
    T.Q5_1: deq_q5_1,
    T.Q2_K: deq_q2_k,
    T.Q3_K: deq_q3_k,
    T.Q4_K: deq_q4_k,
    T.Q5_K: deq_q5_k,
    T.Q6_K: deq_q6_k,
    T.IQ4_NL: deq_iq4_nl,
    T.IQ4_XS: deq_iq4_xs,
}


def dequantize(data: np.ndarray, qtype: T, shape: tuple[int, ...], name: str = "?") -> np.ndarray:
    """Raw tensor data -> float32 array of numpy `shape` (row-major, last dim = ne[0])."""
    fn = DEQUANT.get(qtype)
    if fn is None:
        raise UnsupportedQuantError(name, qtype)
    out = fn(data)
    assert out.size == int(np.prod(shape)), (name, out.size, shape)
    return out.reshape(shape)
