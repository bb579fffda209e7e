"""Weight rows decoded once per GEMM into a scratch buffer, then dotted with few tokens a call:
row_dot_loop's arithmetic, bit for bit, with the decode out of the token loop.

Why: a prefill GEMM decodes each weight block (Q5_0's fifth bits, a K-quant's scales) once per
tile of tokens, so the tile is large (16 tokens) to spread that cost; but 16 tokens keep 16
accumulators of 16 float lanes live, which on the AVX2 tier (16 registers of 8 lanes) is 32
registers and spills every step. Measured on a Zen 4 compiling for Haswell, one thread, a
1,024 x 640 matrix at 512 tokens: Q8_0 (decode is nothing) 30.4 GMAC/s in tiles of 16 and
34.2 in tiles of 4; Q5_0 27.5-28.4 in tiles of 16, 27.0 in tiles of 4 (its decode then counts).
Here the decode happens once for all the step's tokens, and the tiles are as small as the
registers want (`TILE`): the same matrices then ran at 35.6 (Q5_0) and 35.9 (Q8_0) GMAC/s, and
with AVX-512 Q5_0 went 40.6 -> 54.9 GMAC/s.

Scratch, per row (a work item's rows one after another), in slots of one pair of 32-blocks
(a K-quant super-block is 4 slots):

    sw  int8   [slots, 64]   the weights as _pair_prep hands them to _pair_step (signed where
                             the type has an offset, else the unsigned quants)
    ss  f32    [slots, 16]   the pair's lane scales (_pair_prep's ws)
    st  i32    [slots, 16]   VNNI and an offset: the accumulator start (-128 x sum of 4 weights)
    sm  f32    [steps + 1, MW] the loop step's mins (types with a min)

and a last slot for a 32-type row's odd last block (32 weights, its scale in ss[slot, 0], its
start in st[slot, :8], its min in sm[steps, 0]). `pdot` then runs row_dot_loop's loop over it:
the same _pair_step / _mins_step / odd-block arithmetic on the same values, so each output is
the bits row_dot gives it (tests/test_cpu_kernels.py, tests/test_cpu_tiers.py).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from imp.kernels.cpu import isa
from imp.kernels.cpu.gguf_block_ir import (F32, I8, I32, I64, OFFSET, Q4_1, Q4_K, Q5_1, Q5_K, SUBS, UNIT_BYTES, Emit,
                                           decode_unit)
from imp.kernels.cpu.row_dot_loop import (V8I, V16F, V16I, VNNI, _dpbusd, _mins_step, _pair_prep, _pair_step,
                                          _prefetch, _sdot, _Tok, chain_loop, odd_tail, row_outputs, single_lanes,
                                          tail_min)

V64B, V32B = ir.VectorType(I8, 64), ir.VectorType(I8, 32)
# tokens a pdot call takes. Measured (Zen 4, one thread, 2,048 x 1,024 at 512 tokens, GMAC/s for Q5_0 /
# Q4_K / Q6_K): AVX-512 tiles of 4 61 / 59 / 61, of 8 64 / 59 / 62, of 16 55 / 50 / 47; Haswell code tiles
# of 2 36 / 43 / 36, of 3 35-36 / 42 / 35, of 4 36 / 41-42 / 35, of 6 32-33 / 39 / 35.
TILE = 8 if isa.ZMM else 4


def _c(v):
    return ir.Constant(I64, v)


def _at(b, data, off, ty):
    """A pointer to ty at element off of data."""
    return b.bitcast(b.gep(data, [off]), ir.PointerType(ty))


def _store(b, v, data, off):
    st = b.store(v, _at(b, data, off, v.type))
    st.align = 1


def _load(b, data, off, ty):
    v = b.load(_at(b, data, off, ty))
    v.align = 1
    return v


def _shape(qtype: int):
    """(32-type: pairs a step; pairs a step; mins a step; has a min)."""
    subs = SUBS.get(qtype, 1)
    pair32 = subs == 1
    return pair32, 1 if pair32 else subs // 2, 2 if pair32 else subs, qtype in (Q4_1, Q5_1, Q4_K, Q5_K)


def _count_loop(b, n, body, name):
    """for u in range(n): body(u) (n may be 0)."""
    entry = b.block
    loop, done = b.append_basic_block(name), b.append_basic_block(name + "_done")
    b.cbranch(b.icmp_signed(">", n, _c(0)), loop, done)
    b.position_at_end(loop)
    u = b.phi(I64)
    body(u)
    u1 = b.add(u, _c(1))
    u.add_incoming(_c(0), entry)
    u.add_incoming(u1, b.block)
    b.cbranch(b.icmp_signed("<", u1, n), loop, done)
    b.position_at_end(done)


def _decode_codegen(qtype: int):
    pair32, PPS, MW, has_min = _shape(qtype)
    ubytes = UNIT_BYTES[qtype]

    def codegen(context, builder, sig, args):
        w, base, units, sw, ss, st, sm, slot0, m0 = args
        at = sig.args
        b = builder
        wd, swd, ssd, std, smd = (context.make_array(at[i])(context, b, args[i]).data for i in (0, 3, 4, 5, 6))
        e = Emit(b, b.gep(wd, [base]))
        steps = b.ashr(units, _c(1)) if pair32 else units

        def step(u):
            o = b.mul(u, _c(2 * ubytes if pair32 else ubytes))
            groups = decode_unit(e, qtype, o)
            if pair32:
                groups += decode_unit(e, qtype, b.add(o, _c(ubytes)))
            _prefetch(b, e, o)  # the file's rows stream from memory once, as in the row loops
            for j in range(PPS):
                slot = b.add(slot0, b.add(b.mul(u, _c(PPS)), _c(j)))
                uv, start, ws, _ = _pair_prep(b, e, groups[2 * j], groups[2 * j + 1])
                _store(b, uv, swd, b.mul(slot, _c(64)))
                _store(b, ws, ssd, b.mul(slot, _c(16)))
                if start is not None:
                    _store(b, start, std, b.mul(slot, _c(16)))
            if has_min:
                minsv = ir.Constant(ir.VectorType(F32, MW), ir.Undefined)
                for j, g in enumerate(groups):
                    minsv = b.insert_element(minsv, g[3], ir.Constant(I32, j))
                _store(b, minsv, smd, b.add(m0, b.mul(u, _c(MW))))

        _count_loop(b, steps, step, "predecode")
        if pair32:  # the odd last block: the weights _single_step's _products would use
            tail, done = b.append_basic_block("pre_tail"), b.append_basic_block("pre_done")
            b.cbranch(b.icmp_signed("!=", b.and_(units, _c(1)), _c(0)), tail, done)
            b.position_at_end(tail)
            last = b.sub(units, _c(1))
            ((uv, off, sc, mn, _),) = decode_unit(e, qtype, b.mul(last, _c(ubytes)))
            slot = b.add(slot0, steps)
            wv = b.sub(uv, e.c(32, off)) if off else uv
            _store(b, wv, swd, b.mul(slot, _c(64)))
            _store(b, sc, ssd, b.mul(slot, _c(16)))
            if off and VNNI:
                _store(b, _dpbusd(b, e.c(32, 128), wv), std, b.mul(slot, _c(16)))
            if has_min:
                _store(b, mn, smd, b.add(m0, b.mul(steps, _c(MW))))
            b.branch(done)
            b.position_at_end(done)
        return context.get_dummy_value()

    return codegen


def _dot_codegen(qtype: int, T: int):
    pair32, PPS, MW, has_min = _shape(qtype)
    MV = ir.VectorType(F32, MW)
    off = OFFSET.get(qtype, 0)

    def codegen(context, builder, sig, args):
        sw, ss, st, sm, slot0, m0, units, xq, xo, xstride, xd, xs, xb, xbstride = args
        at = sig.args
        b = builder
        swd, ssd, std, smd, qdata, ddata, sdata = (context.make_array(at[i])(context, b, args[i]).data
                                                   for i in (0, 1, 2, 3, 7, 10, 11))
        e = Emit(b, swd)
        fma = b.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(V16F, [V16F] * 3))
        toks = [_Tok(b, qdata, ddata, sdata, xo, xstride, xb, xbstride, t) for t in range(T)]
        steps = b.ashr(units, _c(1)) if pair32 else units
        zero_m = ir.Constant(MV, [0.0] * MW)

        def step(u, acc_v, mac_v):
            first = b.mul(u, _c(2 if pair32 else SUBS.get(qtype, 1)))
            for j in range(PPS):
                slot = b.add(slot0, b.add(b.mul(u, _c(PPS)), _c(j)))
                uv = _load(b, swd, b.mul(slot, _c(64)), V64B)
                ws = _load(b, ssd, b.mul(slot, _c(16)), V16F)
                start = _load(b, std, b.mul(slot, _c(16)), V16I) if off and VNNI else None
                prep = (uv, start, ws, bool(off) and not VNNI)
                blk = b.add(first, _c(2 * j))
                for t in range(T):
                    acc_v[t] = _pair_step(b, e, toks[t], prep, blk, acc_v[t], fma)
            if has_min:
                minsv = _load(b, smd, b.add(m0, b.mul(u, _c(MW))), MV)
                for t in range(T):
                    mac_v[t] = _mins_step(b, toks[t], minsv, first, mac_v[t])
            return acc_v, mac_v

        def tail(last, tacc, tmac):  # row_dot_loop's odd last block (_single_step) on the decoded weights
            slot = b.add(slot0, steps)
            wv = _load(b, swd, b.mul(slot, _c(64)), V32B)
            sc = _load(b, ssd, b.mul(slot, _c(16)), F32)
            start8 = _load(b, std, b.mul(slot, _c(16)), V8I) if off and VNNI else None
            mn = _load(b, smd, b.add(m0, b.mul(steps, _c(MW))), F32) if has_min else None
            for t in range(T):
                xv = toks[t].x(last, 32)
                if start8 is not None:
                    p8 = b.sub(_dpbusd(b, xv, wv), start8)
                elif off:
                    p8 = _sdot(b, e, wv, xv)
                else:
                    p8 = _dpbusd(b, wv, xv)
                tacc[t] = single_lanes(b, e, toks[t], p8, sc, last, tacc[t], fma)
                if has_min:
                    tmac[t] = tail_min(b, toks[t], mn, last, tmac[t], zero_m)
            return tacc, tmac

        acc_f, mac_f = chain_loop(b, steps, T, MV if has_min else None, step, "pdot_loop")
        if pair32:
            acc_f, mac_f = odd_tail(b, units, acc_f, mac_f, tail, "pdot_tail")
        return context.make_tuple(b, sig.return_type, row_outputs(b, acc_f, mac_f))

    return codegen


_CACHE: dict = {}


def predecode(qtype: int):
    """Intrinsic (w, base, units, sw, ss, st, sm, slot0, m0) -> None: the row at byte base of w
    (units 32-blocks, or super-blocks for K-types) into the scratch at slot slot0, mins at m0."""
    if ("dec", qtype) not in _CACHE:
        gen = _decode_codegen(qtype)

        def typer(typingctx, w, base, units, sw, ss, st, sm, slot0, m0):
            ip = types.intp
            return types.void(w, ip, ip, sw, ss, st, sm, ip, ip), gen

        typer.__name__ = f"predecode_q{qtype}"
        _CACHE["dec", qtype] = intrinsic(typer)
    return _CACHE["dec", qtype]


def pdot(qtype: int, T: int):
    """Intrinsic (sw, ss, st, sm, slot0, m0, units, xq, xo, xstride, xd, xs, xb, xbstride) ->
    UniTuple(float32, T): the decoded row at slot0 . T tokens, row_dot_loop.rowdot's bits."""
    if ("dot", qtype, T) not in _CACHE:
        gen = _dot_codegen(qtype, T)

        def typer(typingctx, sw, ss, st, sm, slot0, m0, units, xq, xo, xstride, xd, xs, xb, xbstride):
            ip = types.intp
            return types.UniTuple(types.float32, T)(sw, ss, st, sm, ip, ip, ip, xq, ip, ip, xd, xs, ip, ip), gen

        typer.__name__ = f"pdot_q{qtype}_t{T}"
        _CACHE["dot", qtype, T] = intrinsic(typer)
    return _CACHE["dot", qtype, T]

