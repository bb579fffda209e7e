"""One weight row of GGUF blocks dotted with T int8-quantized tokens, as one LLVM loop.

Why a hand-built loop: written in Numba, each 32-block would end in a horizontal
reduction of its products (8 shuffles + adds) before its scale is applied, and
Numba types scalar integer math as int64 (a plain block loop measured 1.6-3.7
GB/s of weights on 2 threads). Here the loop keeps 16 float32 lanes per token:
a block's products land in int32 lanes — where the CPU has VNNI, two
consecutive blocks share one zmm vpdpbusd (lanes 0..7 one block, 8..15 the
next, 4 products a lane; unsigned quants x signed activations, and a type
with signed weights stores q + offset and subtracts offset * sum(x), exactly);
with AVX2 alone the same 4-product lanes from vpmaddubsw + vpmaddwd by ones (signed
weights as |w| against x carrying w's sign, llama.cpp's AVX2 route: exact, so the AVX2
tier gives the VNNI tier's bits, tests/test_cpu_tiers.py; SmolLM2 through HTTP on the AVX2
tier +25 % at 1 stream, +15 % at 8 against the pair route it replaced); elsewhere 16 lanes
of pairs per block (vpmovsxbw + vpmaddwd; the same generic
IR lowers to NEON) — are converted, scaled by the block's d_w * xd and added
lane-wise (one fma); the lanes are reduced once, at the end of the row. The
weight block is decoded once for all T tokens. Measured on this box (1 thread,
SmolLM2 ffn_gate 1536 x 576 Q4_1, T = 1): plain Numba block loop 0.63 ms, one
intrinsic per block with its own reduction 0.21 ms, this loop with vpmaddwd
0.10 ms, with vpdpbusd 0.085-0.089 ms; T = 4 costs 1.9-2.1x T = 1 for 4 tokens.

    acc_t[lane] = fma(float(lanesum_t[lane]), d_w * xd_t[b], acc_t[lane])   per 32-block b
    mac_t[b % MW] += m_w * xs_t[b]        (types with a min; MW blocks a loop step: 2 or 8)
    y_t          = tree_sum(acc_t) + tree_sum(mac_t)

Every token's arithmetic is the same sequence of IEEE operations whatever T is
(no fast-math flag but `reassoc` on the final 16-lane tree, which is a fixed
shuffle tree), so the T = 16, 8, 4 and 1 variants give identical bits: what makes
the GEMM batch invariant (tests/test_cpu_kernels.py checks it).

The weight blocks are read and decoded into IR values by `gguf_block_ir.decode_unit`.

`rowdot(qtype, T)` returns a Numba intrinsic (a row of any length: an odd
last 32-block runs after the paired loop)
    (w, base, units, xq, xo, xstride, xd, xs, xb, xbstride) -> UniTuple(float32, T)
w: flat uint8 blocks, row at byte `base`, `units` blocks (32-types) or
super-blocks (K-types); token t's int8 values at xq[xo + t * xstride], its
per-32 scales at xd/xs[xb + t * xbstride].

Where VNNI, the types whose weights carry an offset (`UNSIGNED_X`: Q4_0, Q5_0, Q8_0,
Q6_K) read the activations as unsigned bytes, x + 128 (the int8 bits of x ^ 0x80, made
once per quantization by gemm_int8_act.widen_rows), rather than flipping them per token and
row inside the loop (Gemma's prefill GEMMs ~7 % faster, docs/perf-history/2026-12-02-eleventh.md).
Every block's integer dot is the same exact int32 either way, so the bits are.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from imp.kernels.cpu import isa
from imp.kernels.cpu.gguf_block_ir import (F32, I8, I32, I64, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, SUBS,
                                           UNIT_BYTES, V32B, V32I, Emit, decode_unit)

V16F, V16I, V8I = ir.VectorType(F32, 16), ir.VectorType(I32, 16), ir.VectorType(I32, 8)


DOT = isa.DOT  # the int8 dot: "vnni", "avx2" or "generic" (isa.py)
VNNI = DOT == "vnni"
DP4 = DOT in ("vnni", "avx2")  # the 4-product-lane loops (pairs of 32-blocks in 16 lanes)
# bytes ahead of a row's read offset. A decode call reads 4 consecutive rows (a few KB) and a thread's
# rows are consecutive, so the distance must clear the rows in flight: 1,024 (the first value) prefetched
# inside the same call's rows and left one thread at 16 GB/s on the Gemma head (a pure stream: 42);
# 8,192: 23-26 GB/s a thread, one-stream decode +22 % (Gemma) / +33 % (SmolLM2); 4,096 and 16,384 a
# little less; prefill unchanged (docs/perf-history/2026-12-02-eighth.md)
PREFETCH = 8192

# the types whose kernels take unsigned activations (x + 128): see the module docstring
UNSIGNED_X = frozenset((Q4_0, Q5_0, Q8_0, Q6_K)) if VNNI else frozenset()


def _pairsum(b, wv, xv):
    """<32 x i8> . <32 x i8> (both signed) -> <16 x i32>, lane k = w[2k] x[2k] + w[2k+1] x[2k+1]
    (vpmovsxbw + vpmaddwd)."""
    p = b.mul(b.sext(wv, V32I), b.sext(xv, V32I))
    ev = b.shuffle_vector(p, ir.Constant(V32I, ir.Undefined), ir.Constant(V16I, list(range(0, 32, 2))))
    od = b.shuffle_vector(p, ir.Constant(V32I, ir.Undefined), ir.Constant(V16I, list(range(1, 32, 2))))
    return b.add(ev, od)


V16S = ir.VectorType(ir.IntType(16), 16)


def _maddubs(b, uv, xv):
    """AVX2: unsigned <32 x i8> . signed <32 x i8> -> <8 x i32>, lane k = products 4k..4k+3, as
    vpdpbusd sums them (vpmaddubsw pairs into i16, vpmaddwd by ones pairs those)."""
    f1 = b.module.declare_intrinsic("llvm.x86.avx2.pmadd.ub.sw", fnty=ir.FunctionType(V16S, [V32B, V32B]))
    f2 = b.module.declare_intrinsic("llvm.x86.avx2.pmadd.wd", fnty=ir.FunctionType(V8I, [V16S, V16S]))
    return b.call(f2, [b.call(f1, [uv, xv]), ir.Constant(V16S, [1] * 16)])


def _sdot(b, e, wv, xv):
    """AVX2: signed <32 x i8> weights . signed activations (|x| <= 127) -> <8 x i32> 4-product
    lanes: |w| (unsigned, 128 for -128) against x with w's sign (vpabsb, vpsignb), llama.cpp's
    AVX2 route; exact."""
    absf = b.module.declare_intrinsic("llvm.abs.v32i8", fnty=ir.FunctionType(V32B, [V32B, ir.IntType(1)]))
    sgn = b.module.declare_intrinsic("llvm.x86.avx2.psign.b", fnty=ir.FunctionType(V32B, [V32B, V32B]))
    return _maddubs(b, b.call(absf, [wv, ir.Constant(ir.IntType(1), 0)]), b.call(sgn, [xv, wv]))


def _dpbusd(b, uv, xv):
    """unsigned <32 x i8> . signed <32 x i8> -> <8 x i32>, lane k = sum of 4 products (one vpdpbusd;
    AVX2: _maddubs)."""
    if not VNNI:
        return _maddubs(b, uv, xv)
    fn = b.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.256", fnty=ir.FunctionType(V8I, [V8I] * 3))
    return b.call(fn, [ir.Constant(V8I, [0] * 8), b.bitcast(uv, V8I), b.bitcast(xv, V8I)])


def _halves(b, v64, f):
    """f over the two <32 x i8> halves of a <64 x i8>, the <8 x i32> results as one <16 x i32>."""
    lo = b.shuffle_vector(v64[0], v64[0], ir.Constant(V32I, list(range(32))))
    hi = b.shuffle_vector(v64[0], v64[0], ir.Constant(V32I, list(range(32, 64))))
    lo2 = b.shuffle_vector(v64[1], v64[1], ir.Constant(V32I, list(range(32))))
    hi2 = b.shuffle_vector(v64[1], v64[1], ir.Constant(V32I, list(range(32, 64))))
    return b.shuffle_vector(f(lo, lo2), f(hi, hi2), ir.Constant(V16I, list(range(16))))


def _products(b, e, uv, offset: int, lanes, xv):
    """The int32 lane sums of one group for one token: exact, in either instruction set. With
    VNNI and an offset, xv is the token's unsigned x + 128 (UNSIGNED_X)."""
    if DP4:
        if offset and VNNI:  # signed weights ws = quants - offset against x + 128, less 128 * (sum of the 4 ws)
            ws = b.sub(uv, e.c(32, offset))
            p = b.sub(_dpbusd(b, xv, ws), _dpbusd(b, e.c(32, 128), ws))
        elif offset:  # AVX2: signed weights against signed x
            p = _sdot(b, e, b.sub(uv, e.c(32, offset)), xv)
        else:
            p = _dpbusd(b, uv, xv)
        if lanes is not None:  # lanes 0..3 hold elements 0..15, 4..7 the rest
            p = b.mul(p, b.shuffle_vector(e.splat(lanes[0], 4), e.splat(lanes[1], 4), ir.Constant(V8I, list(range(8)))))
        return p
    wv = b.sub(uv, e.c(32, offset)) if offset else uv
    p = _pairsum(b, wv, xv)
    if lanes is not None:  # pair-lanes 0..7 hold elements 0..15, 8..15 the rest
        p = b.mul(p, b.shuffle_vector(e.splat(lanes[0], 8), e.splat(lanes[1], 8), ir.Constant(V16I, list(range(16)))))
    return p


def _prefetch(b, e, o):
    """Software prefetch PREFETCH bytes ahead in the weight stream (the hardware prefetcher
    alone left a cold 96 MB step ~15 % slower, measured A/B on SmolLM2; the distance: see PREFETCH)."""
    pf = b.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [ir.PointerType(I8), I32, I32, I32]))
    b.call(pf, [b.gep(e.w, [b.add(o, ir.Constant(I64, PREFETCH))]), ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def _dpbusd512(b, uv, xv, acc=None):
    """acc + unsigned <64 x i8> . signed <64 x i8> -> <16 x i32> (one zmm vpdpbusd; acc 0 if None;
    AVX2: two _maddubs)."""
    if not VNNI:
        p = _halves(b, (uv, xv), lambda u, x: _maddubs(b, u, x))
        return p if acc is None else b.add(acc, p)
    fn = b.module.declare_intrinsic("llvm.x86.avx512.vpdpbusd.512", fnty=ir.FunctionType(V16I, [V16I] * 3))
    return b.call(fn, [acc if acc is not None else ir.Constant(V16I, [0] * 16), b.bitcast(uv, V16I), b.bitcast(xv, V16I)])


class _Tok:
    """Per-token addressing inside the loop: token t's x block and scale pointers."""

    def __init__(self, b, qdata, ddata, sdata, xo, xstride, xb, xbstride, t):
        self.b, self.qdata, self.ddata, self.sdata = b, qdata, ddata, sdata
        self.tq = b.add(xo, b.mul(ir.Constant(I64, t), xstride))
        self.tb = b.add(xb, b.mul(ir.Constant(I64, t), xbstride))

    def x(self, blk, n: int):
        b = self.b
        p = b.bitcast(b.gep(self.qdata, [b.add(self.tq, b.mul(blk, ir.Constant(I64, 32)))]),
                      ir.PointerType(ir.VectorType(I8, n)))
        v = b.load(p)
        v.align = 1
        return v

    def xd(self, blk):
        return self.b.load(self.b.gep(self.ddata, [self.b.add(self.tb, blk)]))

    def xd2(self, blk):
        """<2 x float>: the scales of blocks blk and blk + 1."""
        p = self.b.bitcast(self.b.gep(self.ddata, [self.b.add(self.tb, blk)]), ir.PointerType(ir.VectorType(F32, 2)))
        v = self.b.load(p)
        v.align = 4
        return v

    def xs(self, blk):
        return self.b.load(self.b.gep(self.sdata, [self.b.add(self.tb, blk)]))


def _pair_prep(b, e, ga, gb):
    """What two consecutive 32-blocks give every token of the tile, computed once per decode:
    (weights <64 x i8>, accumulator start <16 x i32> or None, the lanes' float weight scales
    <16 x float>). lanes 0..7 are the first block, 8..15 the second (the mins: _mins_step).

    A type with an offset (signed weight = quants - offset) takes the activations unsigned
    instead (x + 128, stored so: UNSIGNED_X) against the signed weights, and starts each lane's
    accumulator at -128 * (sum of its 4 weights): the same exact integer dot as before, with
    one vpdpbusd a token instead of two and a subtraction. Q6_K's 16-element int scales move
    into the float lane scales (d * sc, exact in fp32) instead of an int32 multiply a token."""
    (ua, off, sa, _, la), (ub, _, sb, _, lb) = ga, gb
    uv = b.shuffle_vector(ua, ub, ir.Constant(ir.VectorType(I32, 64), list(range(64))))
    start, signed = None, False
    if off:
        uv = b.sub(uv, e.c(64, off))  # signed weights (wrapping i8: Q8_0's are its own bytes)
        if VNNI:
            start = b.sub(ir.Constant(V16I, [0] * 16), _dpbusd512(b, e.c(64, 128), uv))
        else:  # AVX2: the activations stay signed (no x + 128: vpmaddubsw would saturate)
            signed = True
    if la is not None:  # Q6_K: 16-element scales, 4 lanes each, times d
        parts = [e.splat(b.fmul(sa, b.sitofp(v, F32)), 4) for v in (la[0], la[1])]
        parts += [e.splat(b.fmul(sb, b.sitofp(v, F32)), 4) for v in (lb[0], lb[1])]
        lo = b.shuffle_vector(parts[0], parts[1], ir.Constant(V8I, list(range(8))))
        hi = b.shuffle_vector(parts[2], parts[3], ir.Constant(V8I, list(range(8))))
        ws = b.shuffle_vector(lo, hi, ir.Constant(V16I, list(range(16))))
    else:
        ws = b.shuffle_vector(e.splat(sa, 8), e.splat(sb, 8), ir.Constant(V16I, list(range(16))))
    return uv, start, ws, signed


def _pair_step(b, e, tok: _Tok, prep, blk, acc, fma):
    """Two consecutive 32-blocks (blk, blk + 1) for one token in one zmm vpdpbusd (see
    _pair_prep). Returns the new acc (the mins are _mins_step's)."""
    uv, start, ws, signed = prep
    xv = tok.x(blk, 64)
    if start is not None:  # unsigned activations (x + 128, as stored: UNSIGNED_X) . signed weights
        p = _dpbusd512(b, xv, uv, start)
    elif signed:  # AVX2: signed weights . signed activations
        p = _halves(b, (uv, xv), lambda w, x: _sdot(b, e, w, x))
    else:  # unsigned weights . signed activations
        p = _dpbusd512(b, uv, xv)
    # the token's two block scales, [xd_blk x 8 | xd_blk+1 x 8]: one 8-byte load and a permute
    xd2 = tok.xd2(blk)
    xdv = b.shuffle_vector(xd2, ir.Constant(ir.VectorType(F32, 2), ir.Undefined), ir.Constant(V16I, [0] * 8 + [1] * 8))
    return b.call(fma, [b.sitofp(p, V16F), b.fmul(ws, xdv), acc])


def _single_step(b, e, tok: _Tok, g, blk, acc, fma):
    """One 32-block for one token, into 16 float lanes (vpmaddwd; or vpdpbusd into lanes 0..7)."""
    uv, off, sc, mn, lanes = g
    xv = tok.x(blk, 32)
    if DP4:
        return single_lanes(b, e, tok, _products(b, e, uv, off, lanes, xv), sc, blk, acc, fma)
    p = _products(b, e, uv, off, lanes, xv)  # <16 x i32>
    sv = e.splat(b.fmul(sc, tok.xd(blk)), 16)
    return b.call(fma, [b.sitofp(p, V16F), sv, acc])


def single_lanes(b, e, tok: _Tok, p8, sc, blk, acc, fma):
    """A lone 32-block's <8 x i32> lane sums into lanes 0..7 of acc (8..15 take 0 x 0), scaled by
    sc * the token's xd (the 4-product tiers; predecoded.py's odd last block too)."""
    p = b.shuffle_vector(p8, ir.Constant(V8I, [0] * 8), ir.Constant(V16I, list(range(16))))
    s8 = e.splat(b.fmul(sc, tok.xd(blk)), 8)
    sv = b.shuffle_vector(s8, ir.Constant(ir.VectorType(F32, 8), [0.0] * 8), ir.Constant(V16I, list(range(16))))
    return b.call(fma, [b.sitofp(p, V16F), sv, acc])


def tail_min(b, tok: _Tok, mn, blk, mac, zero_m):
    """A lone last block's min times the token's xs, into lane 0 of the mins (the even blocks' lane)."""
    return b.fadd(mac, b.insert_element(zero_m, b.fmul(mn, tok.xs(blk)), ir.Constant(I32, 0)))


def chain_loop(b, steps, C: int, MV, step, name: str):
    """`for u in range(steps)` over C chains of 16 float lanes (and, where MV is a vector type, C
    chains of mins), all starting from zero: step(u, accs, macs) -> (accs, macs) emits one loop
    step. Returns the chains after the loop (zero when steps is 0)."""
    zero_v = ir.Constant(V16F, [0.0] * 16)
    zero_m = ir.Constant(MV, [0.0] * MV.count) if MV is not None else None
    entry = b.block
    loop, after = b.append_basic_block(name), b.append_basic_block(name + "_after")
    b.cbranch(b.icmp_signed(">", steps, ir.Constant(I64, 0)), loop, after)
    b.position_at_end(loop)
    u = b.phi(I64)
    accs = [b.phi(V16F) for _ in range(C)]
    macs = [b.phi(MV) for _ in range(C)] if MV is not None else []
    acc_v, mac_v = step(u, list(accs), list(macs))
    loop_end = b.block

    def zero_or_stepped(acc_phis, mac_phis):
        # the loop head's chains and the loop exit's alike: zero from the entry (no step ran),
        # the last step's values from the loop
        for c in range(C):
            acc_phis[c].add_incoming(zero_v, entry)
            acc_phis[c].add_incoming(acc_v[c], loop_end)
            if mac_phis:
                mac_phis[c].add_incoming(zero_m, entry)
                mac_phis[c].add_incoming(mac_v[c], loop_end)

    u1 = b.add(u, ir.Constant(I64, 1))
    u.add_incoming(ir.Constant(I64, 0), entry)
    u.add_incoming(u1, loop_end)
    zero_or_stepped(accs, macs)
    b.cbranch(b.icmp_signed("<", u1, steps), loop, after)
    b.position_at_end(after)
    acc_p = [b.phi(V16F) for _ in range(C)]
    mac_p = [b.phi(MV) for _ in range(C)] if MV is not None else []
    zero_or_stepped(acc_p, mac_p)
    return acc_p, mac_p


def odd_tail(b, units, acc_p, mac_p, tail, name: str):
    """A 32-type row's odd last block: where units is odd, (accs, macs) = tail(last, accs, macs)
    on the chains; returns the chains either way (phis)."""
    tblock, done = b.append_basic_block(name), b.append_basic_block(name + "_done")
    before = b.block
    b.cbranch(b.icmp_signed("!=", b.and_(units, ir.Constant(I64, 1)), ir.Constant(I64, 0)), tblock, done)
    b.position_at_end(tblock)
    tacc, tmac = tail(b.sub(units, ir.Constant(I64, 1)), list(acc_p), list(mac_p))
    tail_end = b.block
    b.branch(done)
    b.position_at_end(done)
    acc_f, mac_f = [], []
    for c in range(len(acc_p)):
        a_ = b.phi(V16F)
        a_.add_incoming(acc_p[c], before)
        a_.add_incoming(tacc[c], tail_end)
        acc_f.append(a_)
        if mac_p:
            m_ = b.phi(mac_p[c].type)
            m_.add_incoming(mac_p[c], before)
            m_.add_incoming(tmac[c], tail_end)
            mac_f.append(m_)
    return acc_f, mac_f


def row_outputs(b, acc_f, mac_f):
    """Each chain's result: its 16 lanes' fixed tree, plus its mins' fixed tree where it has mins."""
    outs = [lane_sum(b, a) for a in acc_f]
    if mac_f:
        mv = mac_f[0].type
        mred = b.module.declare_intrinsic(f"llvm.vector.reduce.fadd.v{mv.count}f32", fnty=ir.FunctionType(F32, [F32, mv]))
        outs = [b.fadd(o, b.call(mred, [ir.Constant(F32, -0.0), m], fastmath=("reassoc",))) for o, m in zip(outs, mac_f)]
    return outs


def lane_sum(b, acc):
    """A row's 16 float lanes summed as one fixed tree (`reassoc` on this instruction alone): the
    last operation of every row loop (here and head_q8's), so the same lanes give the same bits."""
    red = b.module.declare_intrinsic("llvm.vector.reduce.fadd.v16f32", fnty=ir.FunctionType(F32, [F32, V16F]))
    return b.call(red, [ir.Constant(F32, -0.0), acc], fastmath=("reassoc",))


def _mins_step(b, tok: _Tok, minsv, first, mac):
    """mac (<MW x float>) += the loop step's MW block mins * the token's xs of those blocks: one
    load and one fma a token, the lanes summed once at the end of the row (a fixed tree), instead
    of MW dependent scalar multiply-adds (Q4_K: 8 a super-block a token, ~2/3 of its vector work)."""
    mw = minsv.type.count
    p = b.bitcast(b.gep(tok.sdata, [b.add(tok.tb, first)]), ir.PointerType(ir.VectorType(F32, mw)))
    xsv = b.load(p)
    xsv.align = 4
    vt = ir.VectorType(F32, mw)
    fn = b.module.declare_intrinsic(f"llvm.fma.v{mw}f32", fnty=ir.FunctionType(vt, [vt] * 3))
    return b.call(fn, [minsv, xsv, mac])


def _codegen(qtype: int, T: int, R: int = 1):
    """The IR of R weight rows (row i at byte base + i * rstride) dotted with T tokens: R * T
    independent chains in one loop, output (row i, token t) at index i * T + t. Each chain is
    the same sequence of operations whatever R and T are (the token's loads are shared
    between rows by LLVM, the arithmetic is not)."""
    subs = SUBS.get(qtype, 1)
    ubytes = UNIT_BYTES[qtype]
    # With VNNI two consecutive blocks share one zmm vpdpbusd: a loop step covers a pair of
    # 32-type blocks (an odd last block runs after the loop) or a whole K-type super-block.
    pair32 = DP4 and subs == 1
    has_min = qtype in (Q4_1, Q5_1, Q4_K, Q5_K)
    MW = subs * (2 if pair32 else 1)  # blocks a loop step covers: the lanes of the mins' sum
    MV = ir.VectorType(F32, MW)
    C = R * T  # chains, row-major

    def codegen(context, builder, sig, args):
        if R == 1:
            w, base, units, xq, xo, xstride, xd, xs, xb, xbstride = args
            rstride, aty = ir.Constant(I64, 0), sig.args
        else:
            w, base, rstride, units, xq, xo, xstride, xd, xs, xb, xbstride = args
            aty = sig.args[:2] + sig.args[3:]
        wdata = context.make_array(aty[0])(context, builder, w).data
        qdata = context.make_array(aty[3])(context, builder, xq).data
        ddata = context.make_array(aty[6])(context, builder, xd).data
        sdata = context.make_array(aty[7])(context, builder, xs).data
        b = builder
        es = [Emit(b, b.gep(wdata, [b.add(base, b.mul(rstride, ir.Constant(I64, i)))])) for i in range(R)]
        # an explicit fused multiply-add: one rounding, the same on every call (not a fast-math contraction)
        fma = b.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(V16F, [V16F] * 3))
        toks = [_Tok(b, qdata, ddata, sdata, xo, xstride, xb, xbstride, t) for t in range(T)]
        steps = b.ashr(units, ir.Constant(I64, 1)) if pair32 else units
        zero_m = ir.Constant(MV, [0.0] * MW)

        def step(u, acc_v, mac_v):
            if pair32:
                o = b.mul(u, ir.Constant(I64, 2 * ubytes))
                first = b.mul(u, ir.Constant(I64, 2))
            else:
                o = b.mul(u, ir.Constant(I64, ubytes))
                first = b.mul(u, ir.Constant(I64, subs))
            for i, e in enumerate(es):
                if pair32:
                    groups = decode_unit(e, qtype, o) + decode_unit(e, qtype, b.add(o, ir.Constant(I64, ubytes)))
                else:
                    groups = decode_unit(e, qtype, o)
                _prefetch(b, e, o)
                if DP4:
                    for j in range(0, len(groups), 2):
                        blk = b.add(first, ir.Constant(I64, j))
                        prep = _pair_prep(b, e, groups[j], groups[j + 1])
                        for t in range(T):
                            acc_v[i * T + t] = _pair_step(b, e, toks[t], prep, blk, acc_v[i * T + t], fma)
                else:
                    for j, g in enumerate(groups):
                        blk = b.add(first, ir.Constant(I64, j))
                        for t in range(T):
                            acc_v[i * T + t] = _single_step(b, e, toks[t], g, blk, acc_v[i * T + t], fma)
                if has_min:  # the step's mins as one vector, once for the T tokens
                    minsv = ir.Constant(MV, ir.Undefined)
                    for j, g in enumerate(groups):
                        minsv = b.insert_element(minsv, g[3], ir.Constant(I32, j))
                    for t in range(T):
                        mac_v[i * T + t] = _mins_step(b, toks[t], minsv, first, mac_v[i * T + t])
            return acc_v, mac_v

        def tail(last, tacc, tmac):
            for i, e in enumerate(es):
                (g,) = decode_unit(e, qtype, b.mul(last, ir.Constant(I64, ubytes)))
                for t in range(T):
                    c = i * T + t
                    tacc[c] = _single_step(b, e, toks[t], g, last, tacc[c], fma)
                    if has_min:
                        tmac[c] = tail_min(b, toks[t], g[3], last, tmac[c], zero_m)
            return tacc, tmac

        acc_f, mac_f = chain_loop(b, steps, C, MV if has_min else None, step, "rowdot_loop")
        if pair32:  # the odd last block of a 32-type row
            acc_f, mac_f = odd_tail(b, units, acc_f, mac_f, tail, "rowdot_tail")
        return context.make_tuple(b, sig.return_type, row_outputs(b, acc_f, mac_f))

    return codegen


_CACHE: dict = {}


def rowdot(qtype: int, T: int):
    """The intrinsic for (GGML type, tokens per weight decode); units must be >= 1."""
    key = (qtype, T)
    if key not in _CACHE:
        gen = _codegen(qtype, T)

        def typer(typingctx, w, base, units, xq, xo, xstride, xd, xs, xb, xbstride):
            ip = types.intp
            return types.UniTuple(types.float32, T)(w, ip, ip, xq, ip, ip, xd, xs, ip, ip), gen

        typer.__name__ = f"rowdot_q{qtype}_t{T}"
        _CACHE[key] = intrinsic(typer)
    return _CACHE[key]


def rowsdot(qtype: int, R: int, T: int = 1):
    """The intrinsic for R consecutive rows . T tokens (small decode batches): R * T independent
    chains in one loop, each the same arithmetic as `rowdot(qtype, T)` gives that token, so the
    same bits (the rows share the tokens' loads and the loop's overhead: a short row of a decode
    GEMV was mostly overhead; the tokens share the weights' loads: 2 or 3 tokens one at a time
    read the matrix 2 or 3 times). Rows at byte base + i * rstride; returns UniTuple(float32,
    R * T), (row i, token t) at i * T + t."""
    key = ("rows", qtype, R, T)
    if key not in _CACHE:
        gen = _codegen(qtype, T, R)

        def typer(typingctx, w, base, rstride, units, xq, xo, xstride, xd, xs, xb, xbstride):
            ip = types.intp
            return types.UniTuple(types.float32, R * T)(w, ip, ip, ip, xq, ip, ip, xd, xs, ip, ip), gen

        typer.__name__ = f"rowsdot_q{qtype}_r{R}_t{T}"
        _CACHE[key] = intrinsic(typer)
    return _CACHE[key]
