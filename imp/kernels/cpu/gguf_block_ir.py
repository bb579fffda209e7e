"""A GGUF weight block as LLVM IR values: the row loop of `row_dot_loop` calls `decode_unit` once per
unit (a 32-block, or a K-quant super-block of 8) and gets each 32-element group's quants as a
<32 x i8> of unsigned values with the offset that makes them signed (q - offset), its float scale,
its float min (types with one) and, for Q6_K, the two 16-element int scales.

The byte layouts are GGML's (ggml-common.h, as the file stores them): Q4_0 d + 16 nibble bytes,
Q4_1 d, m + 16, Q5_0 d + qh[4] + 16, Q5_1 d, m + qh[4] + 16, Q8_0 d + 32 int8; Q4_K / Q5_K
d, dmin, scales[12] (6-bit scale and min per sub-block, get_scale_min_k4) (+ qh[32]) + qs[128];
Q6_K ql[128], qh[64], scales[16] int8, d. `Emit` holds the loads at byte offsets.
"""

from __future__ import annotations

from llvmlite import ir

I8, I32, I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
F32, HALF = ir.FloatType(), ir.HalfType()
V32B, V32I = ir.VectorType(I8, 32), ir.VectorType(I32, 32)

# GGML type ids (gguf.GGMLQuantizationType values; kernels import nothing from the formats layer)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
UNIT_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q4_K: 144, Q5_K: 176, Q6_K: 210}
SUBS = {Q4_K: 8, Q5_K: 8, Q6_K: 8}  # 32-blocks per unit (1 for the others)
OFFSET = {Q4_0: 8, Q5_0: 16, Q8_0: 128, Q6_K: 32}  # signed weight = quants - offset (0 for the others)


class Emit:
    """IR helpers bound to one builder: loads at byte offsets, splats, constants."""

    def __init__(self, builder, wptr):
        self.b, self.w = builder, wptr  # w: i8* to the row's first byte

    def at(self, off, ty):
        p = self.b.bitcast(self.b.gep(self.w, [off]), ir.PointerType(ty))
        v = self.b.load(p)
        v.align = 1
        return v

    def f16(self, off):
        return self.b.fpext(self.at(off, HALF), F32)

    def byte(self, off):
        return self.at(off, I8)

    def c(self, n, v, ty=I8):
        return ir.Constant(ir.VectorType(ty, n), [v] * n)

    def splat(self, val, n):
        vt = ir.VectorType(val.type, n)
        v = self.b.insert_element(ir.Constant(vt, ir.Undefined), val, ir.Constant(I32, 0))
        return self.b.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(I32, n), [0] * n))

    def nibbles16(self, off):
        """16 bytes -> <32 x i8>: low nibbles are elements 0..15, high 16..31."""
        q = self.at(off, ir.VectorType(I8, 16))
        lo, hi = self.b.and_(q, self.c(16, 15)), self.b.lshr(q, self.c(16, 4))
        return self.b.shuffle_vector(lo, hi, ir.Constant(V32I, list(range(32))))

    def bits32(self, off, shift: int, mask: int):
        """(32 bytes at off >> shift) & mask."""
        v = self.at(off, V32B)
        if shift:
            v = self.b.lshr(v, self.c(32, shift))
        return self.b.and_(v, self.c(32, mask))

    def fifth_bits(self, off):
        """u32 at off -> <32 x i8>, lane j = bit j << 4 (Q5_0 / Q5_1): byte j//8 of the u32
        in lane j (one byte shuffle), tested against 1 << (j % 8) (vptestmb + masked move),
        not 32 variable shifts of i32 lanes (which cost Q5_0 three times Q4_1's time)."""
        b = self.b
        q4 = self.at(off, ir.VectorType(I8, 4))
        spread = b.shuffle_vector(q4, ir.Constant(ir.VectorType(I8, 4), ir.Undefined),
                                  ir.Constant(V32I, [j // 8 for j in range(32)]))
        bit = b.and_(spread, ir.Constant(V32B, [1 << (j % 8) for j in range(32)]))
        on = b.icmp_unsigned("!=", bit, self.c(32, 0))
        return b.select(on, self.c(32, 16), self.c(32, 0))


def scale_min_k4(e: Emit, o, j: int):
    """Q4_K / Q5_K 6-bit scale and min of sub-block j (ggml's get_scale_min_k4), as float."""
    b = e.b

    def q(i):
        return b.zext(e.byte(b.add(o, ir.Constant(I64, 4 + i))), I32)

    if j < 4:
        sc, mn = b.and_(q(j), ir.Constant(I32, 63)), b.and_(q(j + 4), ir.Constant(I32, 63))
    else:
        hi6 = ir.Constant(I32, 6)
        sc = b.or_(b.and_(q(j + 4), ir.Constant(I32, 15)), b.shl(b.lshr(q(j - 4), hi6), ir.Constant(I32, 4)))
        mn = b.or_(b.lshr(q(j + 4), ir.Constant(I32, 4)), b.shl(b.lshr(q(j), hi6), ir.Constant(I32, 4)))
    return b.uitofp(sc, F32), b.uitofp(mn, F32)


def decode_unit(e: Emit, qtype: int, o):
    """The unit at byte o -> [(quants <32 x i8> as unsigned 0..2^bits-1, offset, float scale,
    float min or None, int lane scales or None)]; the signed weight is quants - offset."""
    b = e.b

    def off(k):
        return b.add(o, ir.Constant(I64, k))

    if qtype == Q8_0:  # int8 -> unsigned by flipping the sign bit: q + 128
        return [(b.xor(e.at(off(2), V32B), e.c(32, 0x80)), OFFSET[Q8_0], e.f16(o), None, None)]
    if qtype in (Q4_0, Q4_1):
        q = e.nibbles16(off(2 if qtype == Q4_0 else 4))
        if qtype == Q4_0:
            return [(q, OFFSET[Q4_0], e.f16(o), None, None)]
        return [(q, 0, e.f16(o), e.f16(off(2)), None)]
    if qtype in (Q5_0, Q5_1):
        qh, qs = (2, 6) if qtype == Q5_0 else (4, 8)
        q = b.or_(e.nibbles16(off(qs)), e.fifth_bits(off(qh)))
        if qtype == Q5_0:
            return [(q, OFFSET[Q5_0], e.f16(o), None, None)]
        return [(q, 0, e.f16(o), e.f16(off(2)), None)]
    if qtype in (Q4_K, Q5_K):
        d, dmin = e.f16(o), e.f16(off(2))
        out = []
        for j in range(8):
            sc, mn = scale_min_k4(e, o, j)
            if qtype == Q4_K:
                q = e.bits32(off(16 + 32 * (j // 2)), 4 * (j % 2), 15)
            else:
                q = e.bits32(off(48 + 32 * (j // 2)), 4 * (j % 2), 15)
                q = b.or_(q, b.shl(e.bits32(off(16), j, 1), e.c(32, 4)))
            out.append((q, 0, b.fmul(d, sc), b.fneg(b.fmul(dmin, mn)), None))
        return out
    if qtype == Q6_K:
        d = e.f16(off(208))
        out = []
        for g in range(8):
            h, qi = g // 4, g % 4
            ql = e.bits32(off(64 * h + 32 * (qi & 1)), 4 * (qi >> 1), 15)
            qh = e.bits32(off(128 + 32 * h), 2 * qi, 3)
            q = b.or_(ql, b.shl(qh, e.c(32, 4)))
            sa, sb = (b.sext(e.byte(off(192 + 2 * g + k)), I32) for k in (0, 1))
            out.append((q, OFFSET[Q6_K], d, None, (sa, sb)))  # elements 0..15 scale sa, 16..31 sb
        return out
    raise NotImplementedError(qtype)
