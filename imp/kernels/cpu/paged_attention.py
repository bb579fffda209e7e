"""Attention over the paged KV cache for the fused CPU forward, the query heads of one KV
head sharing each key and value load.

Why: the one-query loop (one fdot per key, then one faxpy per key into the output row)
ran at ~8 GMAC/s on 2 threads, a fifth of a Gemma 3 prefill-512 (0.62 s): each key was
converted from fp16 once per query head, and each faxpy loaded and stored the whole
output row per key. Here a work item is a row and up to 4 query heads of one KV head
(grouped-query attention: Gemma 3 has 4 query heads per KV head, SmolLM2 3):

    scores   s[g, j] = (q_g . k_j) * scale      one key load + fp16 convert for all g
    softmax  p[g, j] = exp(s[g, j] - max_j s[g, j]),  tot_g = sum_j p[g, j] (key order)
    values   o_g     = (sum_j p[g, j] v_j) / tot_g   4 x 16 output lanes per head held in
                                                     registers across all keys

Batch invariance: every (row, head) runs the same sequence of IEEE operations whether
its item holds 1 or 4 heads: a dot is one 16-lane fma chain over D in order then one
fixed reduction tree (float_lanes.fdot's), an output lane is one fma chain over the keys in
position order starting from 0. Grouping only interleaves independent chains, so a
decode (items of one head, to keep both threads busy on one row) and a prefill (items
of a head group) give identical bits for the same row, as do all other rows of a step.
The cache writes of every row of the step come before (fused_forward).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from imp.kernels.cpu import isa
from imp.kernels.cpu.float_lanes import F32, HALF, _freduce, _fvec, _splat, _vec, exp_span

V16, V8 = ir.VectorType(F32, 16), ir.VectorType(F32, 8)
I64 = ir.IntType(64)
HEADS = 4  # query heads per work item at most (4 x 4 x 16-lane accumulators in the value loop)
GROUP_PAIRS = 16  # (row, KV head) pairs from which items hold a head group (a constant: no
# thread count read inside a kernel, which would also keep Numba from caching it)


def _fma(builder):
    return builder.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(V16, [V16] * 3))


def _loop(builder, start, stop, step, carries, body, name):
    """Emit `for i in range(start, stop, step)` (at least one trip) with loop-carried values;
    body(i, carries) -> new carries. Returns the carries after the loop."""
    entry = builder.block
    loop = builder.append_basic_block(name)
    done = builder.append_basic_block(name + "_done")
    builder.branch(loop)
    builder.position_at_end(loop)
    i = builder.phi(I64)
    phis = [builder.phi(c.type) for c in carries]
    nxt = body(i, phis)
    end = builder.block
    i1 = builder.add(i, step)
    i.add_incoming(start, entry)
    i.add_incoming(i1, end)
    for p, c, n in zip(phis, carries, nxt):
        p.add_incoming(c, entry)
        p.add_incoming(n, end)
    builder.cbranch(builder.icmp_signed("<", i1, stop), loop, done)
    builder.position_at_end(done)
    return nxt


def _fdots(G: int, CW: int):
    """(q, qo, qstride, k, ko, n) -> G dots q[qo + g*qstride : +n] . k[ko : +n], the key chunk
    loaded once for the G queries. Each dot: CW 16-lane fma chains (chunk c into chain c % CW,
    n % (16*CW) == 0), added pairwise, then one fixed reduction tree: CW = 4 keeps 4 G chains
    in flight (one chain ran at a third of the fma rate, latency-bound)."""

    def typer(typingctx, q, qo, qstride, k, ko, n):
        sig = types.UniTuple(types.float32, G)(q, types.intp, types.intp, k, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            qa, qo_, qs_, ka, ko_, n_ = args
            fma = _fma(builder)
            qoffs = [builder.add(qo_, builder.mul(ir.Constant(I64, g), qs_)) for g in range(G)]

            def body(i, accs):
                new = []
                for w in range(CW):
                    iw = builder.add(i, ir.Constant(I64, 16 * w))
                    kv = _fvec(builder, context, signature.args[3], ka, builder.add(ko_, iw))
                    new += [builder.call(fma, [_fvec(builder, context, signature.args[0], qa, builder.add(qoffs[g], iw)),
                                               kv, accs[w * G + g]]) for g in range(G)]
                return new

            zero = ir.Constant(V16, [0.0] * 16)
            accs = _loop(builder, ir.Constant(I64, 0), n_, ir.Constant(I64, 16 * CW), [zero] * (G * CW), body, "fdots")
            outs = []
            for g in range(G):
                a = [accs[w * G + g] for w in range(CW)]
                while len(a) > 1:
                    a = [builder.fadd(a[2 * t], a[2 * t + 1]) for t in range(len(a) // 2)]
                outs.append(_freduce(builder, a[0]))
            return context.make_tuple(builder, signature.return_type, outs)

        return sig, codegen

    typer.__name__ = f"fdots{G}x{CW}"
    return intrinsic(typer)


def _pv(G: int, CW: int):
    """(out, oo, ostride, p, po, pstride, v, voff, nk, n): for g < G, out[oo + g*ostride + e] =
    sum_{j < nk} p[po + g*pstride + j] * v[voff[j] + e] for e < n (n % (16*CW) == 0), each
    lane one fma chain over j from 0; CW 16-lane chunks per pass, so G*CW chains in flight."""

    def typer(typingctx, out, oo, ostride, p, po, pstride, v, voff, nk, n):
        ip = types.intp
        sig = types.void(out, ip, ip, p, ip, ip, v, voff, ip, ip)

        def codegen(context, builder, signature, args):
            oa, oo_, os_, pa, po_, ps_, va, vo, nk_, n_ = args
            fma = _fma(builder)
            pdata = context.make_array(signature.args[3])(context, builder, pa).data
            odata = context.make_array(signature.args[0])(context, builder, oa).data
            vodata = context.make_array(signature.args[7])(context, builder, vo).data
            zero = ir.Constant(V16, [0.0] * 16)

            def chunk(c, _):
                def key(j, accs):
                    off = builder.load(builder.gep(vodata, [j]))
                    vv = [_fvec(builder, context, signature.args[6], va, builder.add(off, builder.add(c, ir.Constant(I64, 16 * w))))
                          for w in range(CW)]
                    new = []
                    for g in range(G):
                        pg = builder.load(builder.gep(pdata, [builder.add(builder.add(po_, builder.mul(ir.Constant(I64, g), ps_)), j)]))
                        pb = _splat(builder, pg, 16)
                        new += [builder.call(fma, [pb, vv[w], accs[g * CW + w]]) for w in range(CW)]
                    return new

                accs = _loop(builder, ir.Constant(I64, 0), nk_, ir.Constant(I64, 1), [zero] * (G * CW), key, "pv_keys")
                for g in range(G):
                    for w in range(CW):
                        o = builder.add(builder.add(oo_, builder.mul(ir.Constant(I64, g), os_)), builder.add(c, ir.Constant(I64, 16 * w)))
                        st = builder.store(accs[g * CW + w], builder.bitcast(builder.gep(odata, [o]), ir.PointerType(V16)))
                        st.align = 4
                return [ir.Constant(I64, 0)]

            _loop(builder, ir.Constant(I64, 0), n_, ir.Constant(I64, 16 * CW), [ir.Constant(I64, 0)], chunk, "pv_chunks")
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = f"pv{G}x{CW}"
    return intrinsic(typer)


def _fvec8(builder, context, aryty, ary, off):
    """<8 x float> from a float32 array, or from a uint16 array holding fp16 bits."""
    if aryty.dtype == types.uint16 or aryty.dtype == types.int16:
        return builder.fpext(builder.bitcast(_vec(builder, context, aryty, ary, off, 8, ir.IntType(16)),
                                             ir.VectorType(HALF, 8)), V8)
    return _vec(builder, context, aryty, ary, off, 8, F32)


def _fdots_halves(G: int):
    """_fdots(G, 4)'s dots, bit for bit, scheduled for 16 vector registers of 8 lanes (AVX2):
    there its 4 x G 16-lane chains are 8 x G registers and spilled (a Gemma prefill-512 spent
    26 % of its time in attention on the AVX2 tier, 12 % with AVX-512). Every lane of a chain
    is its own fma sequence, so lanes 0..7 and 8..15 can run as separate passes, two heads a
    pass (8 registers of accumulators); the passes' halves then meet in the same pairwise add
    and reduction tree. The key chunk is loaded and converted once per pass instead of once."""

    def typer(typingctx, q, qo, qstride, k, ko, n):
        sig = types.UniTuple(types.float32, G)(q, types.intp, types.intp, k, types.intp, types.intp)

        def codegen(context, builder, signature, args):
            qa, qo_, qs_, ka, ko_, n_ = args
            fma = builder.module.declare_intrinsic("llvm.fma.v8f32", fnty=ir.FunctionType(V8, [V8] * 3))
            qoffs = [builder.add(qo_, builder.mul(ir.Constant(I64, g), qs_)) for g in range(G)]
            zero = ir.Constant(V8, [0.0] * 8)
            halves = {}
            for p0 in range(0, G, 2):
                gs = list(range(p0, min(G, p0 + 2)))
                for h in (0, 1):
                    def body(i, accs, gs=gs, h=h):
                        new = []
                        for w in range(4):  # chunk c of the 64 goes to chain c, as _fdots(G, 4)
                            iw = builder.add(i, ir.Constant(I64, 16 * w + 8 * h))
                            kv = _fvec8(builder, context, signature.args[3], ka, builder.add(ko_, iw))
                            new += [builder.call(fma, [_fvec8(builder, context, signature.args[0], qa,
                                                              builder.add(qoffs[g], iw)), kv, accs[w * len(gs) + x]])
                                    for x, g in enumerate(gs)]
                        return new

                    accs = _loop(builder, ir.Constant(I64, 0), n_, ir.Constant(I64, 64), [zero] * (4 * len(gs)),
                                 body, f"fdots_h{p0}_{h}")
                    for x, g in enumerate(gs):
                        a = [accs[w * len(gs) + x] for w in range(4)]
                        halves[g, h] = builder.fadd(builder.fadd(a[0], a[1]), builder.fadd(a[2], a[3]))
            outs = [_freduce(builder, builder.shuffle_vector(halves[g, 0], halves[g, 1], ir.Constant(ir.VectorType(
                ir.IntType(32), 16), list(range(16))))) for g in range(G)]
            return context.make_tuple(builder, signature.return_type, outs)

        return sig, codegen

    typer.__name__ = f"fdots{G}_halves"
    return intrinsic(typer)


# The 16-lane chains of a dot (CW = 4 for D % 64 == 0, else 1) set its bits on every tier; with
# 16 registers of 8 lanes (AVX2, isa.ZMM False) the dots of 2-4 heads run as _fdots_halves (one
# head's 4 chains fit: 8 registers, and a decode's one-head items kept their speed that way:
# Haswell code, one row of Gemma at 340 keys 19.9 us, as halves 25.8), and the value loop keeps at
# most 4 16-lane chunks in flight (its bits do not depend on CW: one fma chain a lane).
if isa.ZMM:
    _d1, _d2, _d3, _d4 = (_fdots(g, 4) for g in (1, 2, 3, 4))
else:
    _d1, (_d2, _d3, _d4) = _fdots(1, 4), (_fdots_halves(g) for g in (2, 3, 4))
_d1n, _d2n, _d3n, _d4n = (_fdots(g, 1) for g in (1, 2, 3, 4))
_p1, _p2, _p3, _p4 = (_pv(g, 4 if isa.ZMM else max(1, 4 // g)) for g in (1, 2, 3, 4))
_p1n, _p2n, _p3n, _p4n = (_pv(g, 1) for g in (1, 2, 3, 4))


@njit(cache=True, nogil=True, inline="always")
def _scores_w(cnt, qf, qo, D, kc, koff, nk, scale, sc, d1, d2, d3, d4):
    for j in range(nk):
        ko = koff[j]
        if cnt == 4:
            s = d4(qf, qo, D, kc, ko, D)
            sc[0, j], sc[1, j], sc[2, j], sc[3, j] = s[0] * scale, s[1] * scale, s[2] * scale, s[3] * scale
        elif cnt == 3:
            s = d3(qf, qo, D, kc, ko, D)
            sc[0, j], sc[1, j], sc[2, j] = s[0] * scale, s[1] * scale, s[2] * scale
        elif cnt == 2:
            s = d2(qf, qo, D, kc, ko, D)
            sc[0, j], sc[1, j] = s[0] * scale, s[1] * scale
        else:
            sc[0, j] = d1(qf, qo, D, kc, ko, D)[0] * scale


@njit(cache=True, nogil=True)
def _scores(cnt, qf, qo, D, kc, koff, nk, scale, sc):
    """sc[g, j] = (q_g . k_j) * scale for the item's cnt heads (q_g at qo + g*D); the chain
    layout depends on D only (a model constant), never on cnt."""
    if D % 64 == 0:
        _scores_w(cnt, qf, qo, D, kc, koff, nk, scale, sc, _d1, _d2, _d3, _d4)
    else:
        _scores_w(cnt, qf, qo, D, kc, koff, nk, scale, sc, _d1n, _d2n, _d3n, _d4n)


@njit(cache=True, nogil=True, inline="always")
def _values_w(cnt, of, oo, D, scf, so, stride, vc, koff, nk, p1, p2, p3, p4):
    if cnt == 4:
        p4(of, oo, D, scf, so, stride, vc, koff, nk, D)
    elif cnt == 3:
        p3(of, oo, D, scf, so, stride, vc, koff, nk, D)
    elif cnt == 2:
        p2(of, oo, D, scf, so, stride, vc, koff, nk, D)
    else:
        p1(of, oo, D, scf, so, stride, vc, koff, nk, D)


@njit(cache=True, nogil=True)
def _values(cnt, of, oo, D, scf, so, stride, vc, koff, nk):
    """of[oo + g*D : +D] = sum_j p[g, j] v_j for the item's cnt heads (p at scf[so + g*stride])."""
    if D % 64 == 0:
        _values_w(cnt, of, oo, D, scf, so, stride, vc, koff, nk, _p1, _p2, _p3, _p4)
    else:
        _values_w(cnt, of, oo, D, scf, so, stride, vc, koff, nk, _p1n, _p2n, _p3n, _p4n)


@njit(parallel=True, cache=True, nogil=True)
def attention(qkv, H, Hkv, D, l, kc, vc, nblocks, bs, pos, tables, row_tab, window, scale, out):
    """out[n, h*D : (h+1)*D] = softmax over keys j of row n's context of (q . k_j) * scale, times
    v_j; q from qkv [N, (H + 2 Hkv) D], keys of layer l read through row n's block table."""
    N, W = qkv.shape
    qf, of = qkv.reshape(-1), out.reshape(-1)
    grp = H // Hkv
    # heads per item: a group (up to HEADS) when the step has enough (row, KV head) pairs to
    # share out, else one (a decode row of a 1-KV-head model would run on one thread); the
    # bits are the same either way
    hs = min(grp, HEADS) if N * Hkv >= GROUP_PAIRS else 1
    per_g = (grp + hs - 1) // hs
    items = N * Hkv * per_g
    maxl = 1
    for n in range(N):
        maxl = max(maxl, pos[n] + 1)
    if window > 0:
        maxl = min(maxl, window)
    scores = np.empty((items, hs, maxl), np.float32)  # one allocation per call, not per item
    koffs = np.empty((items, maxl), np.int64)
    sflat = scores.reshape(-1)
    layer0 = l * nblocks * bs
    for i in prange(items):
        n, rest = i // (Hkv * per_g), i % (Hkv * per_g)
        g, c = rest // per_g, rest % per_g
        h0 = g * grp + c * hs
        cnt = min(hs, grp - c * hs)
        p = pos[n]
        lo = max(0, p - window + 1) if window > 0 else 0
        nk = p - lo + 1
        koff = koffs[i]
        tab = row_tab[n]
        j = 0
        for blk in range(lo // bs, p // bs + 1):  # keys lo..p in position order, block by block
            first = max(lo, blk * bs)
            last = min(p, blk * bs + bs - 1)
            base = ((layer0 + tables[tab + blk] * bs - blk * bs) * Hkv + g) * D  # + t * Hkv * D for key t
            for t in range(first, last + 1):
                koff[j] = base + t * Hkv * D
                j += 1
        sc = scores[i]
        qo = n * W + h0 * D
        _scores(cnt, qf, qo, D, kc, koff, nk, np.float32(scale), sc)
        tots = np.empty(HEADS, np.float32)
        for hh in range(cnt):
            m = np.float32(-np.inf)
            for j in range(nk):
                m = max(m, sc[hh, j])
            for j in range(nk):
                sc[hh, j] = sc[hh, j] - m
            exp_span(sflat, (i * hs + hh) * maxl, nk)  # 16 lanes at a time (float_lanes)
            tot = np.float32(0.0)
            for j in range(nk):  # in key order, as before
                tot += sc[hh, j]
            tots[hh] = tot
        oo = n * H * D + h0 * D
        _values(cnt, of, oo, D, scores.reshape(-1), i * hs * maxl, maxl, vc, koff, nk)
        for hh in range(cnt):
            inv = np.float32(1.0) / tots[hh]
            for e in range(D):
                of[oo + hh * D + e] = of[oo + hh * D + e] * inv
