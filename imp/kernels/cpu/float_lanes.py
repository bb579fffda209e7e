"""LLVM vector intrinsics for Numba's float work in the CPU forward: 16-lane dot
products, axpy and fp16 stores (attention over the fp16 KV cache, norms).

Why intrinsics: without fast-math Numba (LLVM) may not reorder a float
reduction, so `for j in range(64): s += q[j] * k[j]` runs as 64 dependent adds;
and Numba has no fp16 arrays. Here each call handles 16 lanes as vector IR
(the backend picks AVX-512 / AVX2 / NEON; no x86 intrinsic is named) and fp16
travels as uint16 bits. The quantized matrix loops are in row_dot_loop.py.

Arguments are (array, element offset) pairs; no bounds checks here: the
callers check shapes once per call.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

I8, I32 = ir.IntType(8), ir.IntType(32)


def _vec(builder, context, aryty, ary, off, n: int, elt=I8):
    """Load <n x elt> at ary[off] (unaligned)."""
    data = context.make_array(aryty)(context, builder, ary).data
    p = builder.bitcast(builder.gep(data, [off]), ir.PointerType(ir.VectorType(elt, n)))
    v = builder.load(p)
    v.align = 1
    return v


def _splat(builder, val, n: int):
    """<n x T> with every lane = val (a scalar of type T)."""
    vt = ir.VectorType(val.type, n)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), val, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(I32, n), [0] * n))


# ---------------------------------------------------------------- float lanes (attention, norms)
# 16 lanes at a time. A reduction over them runs as one fixed tree (`reassoc` on this one
# instruction only): the same inputs give the same bits on every call, so what depends on
# the batch (nothing) cannot change a result.

F32, HALF = ir.FloatType(), ir.HalfType()


def _fvec(builder, context, aryty, ary, off):
    """<16 x float> from a float32 array, or from a uint16 array holding fp16 bits."""
    if aryty.dtype == types.uint16 or aryty.dtype == types.int16:
        return builder.fpext(builder.bitcast(_vec(builder, context, aryty, ary, off, 16, ir.IntType(16)),
                                             ir.VectorType(HALF, 16)), ir.VectorType(F32, 16))
    return _vec(builder, context, aryty, ary, off, 16, F32)


def _freduce(builder, v):
    fn = builder.module.declare_intrinsic("llvm.vector.reduce.fadd.v16f32",
                                          fnty=ir.FunctionType(F32, [F32, v.type]))
    # reassoc: a tree instead of 16 dependent adds; fixed, hence deterministic
    return builder.call(fn, [ir.Constant(F32, -0.0), v], fastmath=("reassoc",))


@intrinsic
def fdot16(typingctx, a, aoff, b, boff):
    """sum_j a[aoff + j] * b[boff + j], j < 16; each of a, b float32 or fp16 bits (uint16)."""
    sig = types.float32(a, types.intp, b, types.intp)

    def codegen(context, builder, signature, args):
        x = _fvec(builder, context, signature.args[0], args[0], args[1])
        y = _fvec(builder, context, signature.args[2], args[2], args[3])
        return _freduce(builder, builder.fmul(x, y))

    return sig, codegen


@intrinsic
def faxpy16(typingctx, out, ooff, p, v, voff):
    """out[ooff + j] += p * v[voff + j], j < 16 (out float32; v float32 or fp16 bits)."""
    sig = types.void(out, types.intp, types.float32, v, types.intp)

    def codegen(context, builder, signature, args):
        o = _fvec(builder, context, signature.args[0], args[0], args[1])
        y = _fvec(builder, context, signature.args[3], args[3], args[4])
        r = builder.fadd(o, builder.fmul(_splat(builder, args[2], 16), y))
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        st = builder.store(r, builder.bitcast(builder.gep(data, [args[1]]), ir.PointerType(r.type)))
        st.align = 1
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store16(typingctx, dst, doff, src, soff):
    """dst[doff + j] = src[soff + j] for j < 16, src float32; dst float32, or uint16 holding
    fp16 bits (rounded to nearest even)."""
    sig = types.void(dst, types.intp, src, types.intp)

    def codegen(context, builder, signature, args):
        v = _fvec(builder, context, signature.args[2], args[2], args[3])
        if signature.args[0].dtype in (types.uint16, types.int16):
            v = builder.bitcast(builder.fptrunc(v, ir.VectorType(HALF, 16)), ir.VectorType(ir.IntType(16), 16))
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        st = builder.store(v, builder.bitcast(builder.gep(data, [args[1]]), ir.PointerType(v.type)))
        st.align = 1
        return context.get_dummy_value()

    return sig, codegen


def _lanes_loop(builder, n, body, init):
    """Emit `for c in range(n // 16): carry = body(c * 16, carry)` as an IR loop (n >= 16)."""
    entry = builder.block
    loop = builder.append_basic_block("lanes_loop")
    done = builder.append_basic_block("lanes_done")
    builder.branch(loop)
    builder.position_at_end(loop)
    i = builder.phi(ir.IntType(64))
    carry = builder.phi(init.type)
    nxt = body(i, carry)
    i1 = builder.add(i, ir.Constant(ir.IntType(64), 16))
    i.add_incoming(ir.Constant(ir.IntType(64), 0), entry)
    i.add_incoming(i1, loop)
    carry.add_incoming(init, entry)
    carry.add_incoming(nxt, loop)
    builder.cbranch(builder.icmp_signed("<", i1, n), loop, done)
    builder.position_at_end(done)
    return nxt


@intrinsic
def fdot(typingctx, a, aoff, b, boff, n):
    """sum_j a[aoff + j] * b[boff + j], j < n (n a multiple of 16): 16 lanes of fma, one
    fixed reduction tree at the end; a, b float32 or fp16 bits (uint16)."""
    sig = types.float32(a, types.intp, b, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        v16 = ir.VectorType(F32, 16)
        fma = builder.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(v16, [v16] * 3))

        def body(i, acc):
            x = _fvec(builder, context, signature.args[0], args[0], builder.add(args[1], i))
            y = _fvec(builder, context, signature.args[2], args[2], builder.add(args[3], i))
            return builder.call(fma, [x, y, acc])

        return _freduce(builder, _lanes_loop(builder, args[4], body, ir.Constant(v16, [0.0] * 16)))

    return sig, codegen


@intrinsic
def faxpy(typingctx, out, ooff, p, v, voff, n):
    """out[ooff + j] += p * v[voff + j], j < n (a multiple of 16); v float32 or fp16 bits."""
    sig = types.void(out, types.intp, types.float32, v, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        ps = _splat(builder, args[2], 16)
        data = context.make_array(signature.args[0])(context, builder, args[0]).data

        def body(i, carry):
            o = builder.add(args[1], i)
            r = builder.fadd(_fvec(builder, context, signature.args[0], args[0], o),
                             builder.fmul(ps, _fvec(builder, context, signature.args[3], args[3], builder.add(args[4], i))))
            st = builder.store(r, builder.bitcast(builder.gep(data, [o]), ir.PointerType(r.type)))
            st.align = 1
            return carry

        _lanes_loop(builder, args[5], body, ir.Constant(ir.IntType(64), 0))
        return context.get_dummy_value()

    return sig, codegen


# ---------------------------------------------------------------- exp (activations, softmax)
# Cephes' expf on 16 lanes: n = floor(x log2 e + 1/2), r = x - n ln 2 (ln 2 in two parts, each an
# explicit fma), e^r by a degree-5 polynomial, 2^n through the exponent bits. Within 2 ulp of
# libm's expf, and the same bits on every call and lane: an element's value never depends on the
# rest of its row or on the batch. Why: libm's expf, one element at a time, was most of SiLU's 7.8 µs
# a row (SmolLM2, 1,536 elements) and of the decode softmax.
_EXP_LO, _EXP_HI = -87.33654, 88.37626  # below: 0; above: inf (2^n stays a normal float in between)
_EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _exp16(builder, x):
    b = builder
    v = lambda c: ir.Constant(V16F, [c] * 16)  # noqa: E731
    fma = b.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(V16F, [V16F] * 3))
    lo, hi = b.fcmp_ordered("<", x, v(_EXP_LO)), b.fcmp_ordered(">", x, v(_EXP_HI))
    xc = b.select(lo, v(_EXP_LO), b.select(hi, v(_EXP_HI), x))
    floor = b.module.declare_intrinsic("llvm.floor.v16f32", fnty=ir.FunctionType(V16F, [V16F]))
    n = b.call(floor, [b.call(fma, [xc, v(1.44269504088896341), v(0.5)])])
    r = b.call(fma, [n, v(-0.693359375), xc])
    r = b.call(fma, [n, v(2.12194440e-4), r])
    p = v(_EXP_P[0])
    for c in _EXP_P[1:]:
        p = b.call(fma, [p, r, v(c)])
    y = b.fadd(b.call(fma, [p, b.fmul(r, r), r]), v(1.0))
    e = b.shl(b.add(b.fptosi(n, V16I), ir.Constant(V16I, [127] * 16)), ir.Constant(V16I, [23] * 16))
    out = b.fmul(y, b.bitcast(e, V16F))
    out = b.select(lo, v(0.0), b.select(hi, v(float("inf")), out))
    return b.select(b.fcmp_unordered("uno", x, x), x, out)  # NaN stays NaN


V16F, V16I = ir.VectorType(F32, 16), ir.VectorType(I32, 16)


@intrinsic
def fexp16(typingctx, a, off):
    """a[off + j] = exp(a[off + j]) for j < 16, in place (a float32)."""
    sig = types.void(a, types.intp)

    def codegen(context, builder, signature, args):
        x = _fvec(builder, context, signature.args[0], args[0], args[1])
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        st = builder.store(_exp16(builder, x), builder.bitcast(builder.gep(data, [args[1]]), ir.PointerType(V16F)))
        st.align = 1
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(cache=True, nogil=True)
def exp_span(a, off, n):
    """a[off : off + n] = exp of itself (a flat float32), 16 lanes at a time; a tail of < 16
    through a scratch vector (the same arithmetic: the same bits wherever an element lies)."""
    i = 0
    while i + 16 <= n:
        fexp16(a, off + i)
        i += 16
    if i < n:
        t = np.zeros(16, np.float32)
        for k in range(n - i):
            t[k] = a[off + i + k]
        fexp16(t, 0)
        for k in range(n - i):
            a[off + i + k] = t[k]
