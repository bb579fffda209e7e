"""Q8_0 GEMM on AMX int8 tiles, reading the GGUF's blocks where they lie.

    y[n, r] = sum_b (d_w[r, b] * xd[n, b]) * isum[r, n, b],   isum = sum_k q_w[r, 32b + k] * xq[n, 32b + k]

One `tdpbssd` multiplies a 16-row x 32-byte tile of weights (A: each row's int8
quants of block b, loaded straight from the file with the row stride; no repacking)
by m tokens' 32 activations (B: the activations in AMX's VNNI layout, four
consecutive k of a token in one dword, rearranged once per call; m = 2, 4, 8 or 16,
the narrowest that holds the batch; one token is a B tile as it lies) into 16 x m
exact int32 block sums (C). Those are stored, converted and scaled per block:

    acc[r, t] = fma(float(C[r, t]), d_w[r, b] * xd[t, b], acc[r, t])     b = 0, 1, 2, ...

one IEEE multiply and one fused multiply-add per element and block, in block order,
with nothing else touching acc[r, t]: the bits of y[n, r] do not depend on N, on
the tile a token lands in or on the rows beside it (batch invariance), whatever
vector width the loop compiles to. (They differ from row_dot_loop's VNNI loop, whose
lanes sum four products each; a matrix always takes one route on a machine, see
`gemm` in gemm_int8_act.)

Why: the Gemma 3 and SmolLM2 heads are Q8_0 (262,144 x 640 and 49,152 x 576).
At a decode batch of 8 the VNNI loop spent 13.5 of a ~35 ms Gemma step in the head,
compute-bound; a tile does 16 x 16 x 32 multiply-adds in one instruction. Measured
(`bench/cpu_head.py`, 2 threads, docs/perf-history/2026-12-03-twelfth.md): the Gemma head 13.8
-> 7.2 ms at 8 tokens, 21.8 -> 9.4 at 16, 4.8 at one and 5.3 at two on both routes.

AMX needs the kernel's permission (Linux `arch_prctl(ARCH_REQ_XCOMP_PERM,
XTILEDATA)`, asked once per process, here at import) and the CPU's amx-int8;
`AMX` says whether both hold. The tile instructions are inline asm (LLVM's AMX
intrinsics take a type llvmlite cannot spell); tmm0..tmm7 are named in the asm
and nothing else in the process uses them.
"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from imp.kernels.cpu.float_lanes import F32, HALF, I8, _splat

I64 = ir.IntType(64)
QK = 32
Q8_0_BYTES = 34  # fp16 d, then 32 int8
TM = 16  # rows and tokens of a tile


def _enable() -> bool:
    """amx-int8 on the CPU Numba compiles for, and the kernel's permission for tile data."""
    if os.environ.get("IMP_NO_AMX") or not sys.platform.startswith("linux"):
        return False
    import llvmlite.binding as ll
    import numba

    if numba.config.CPU_NAME not in (None, "host"):
        return False
    f = ll.get_host_cpu_features()
    if not (f.get("amx-int8") and f.get("amx-tile") and f.get("avx512f")):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # SYS_arch_prctl (x86-64) = 158, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18
        if libc.syscall(158, 0x1023, 18) != 0:
            return False
    except (OSError, AttributeError):
        return False
    ll.initialize_native_asmparser()  # inline asm needs it; Numba initialises only the printer
    return True


AMX = _enable()


def _c(v):
    return ir.Constant(I64, v)


def _data(builder, context, aty, ary):
    """An array argument's data pointer as i8*."""
    return builder.bitcast(context.make_array(aty)(context, builder, ary).data, ir.PointerType(I8))


@intrinsic
def _tilecfg(typingctx, cfg):
    def cg(context, builder, sig, args):
        p = _data(builder, context, sig.args[0], args[0])
        builder.asm(ir.FunctionType(ir.VoidType(), [p.type]), "ldtilecfg ($0)", "r,~{memory}", [p], side_effect=True)
        return context.get_dummy_value()
    return types.void(cfg), cg


@intrinsic
def _tilerelease(typingctx):
    def cg(context, builder, sig, args):
        builder.asm(ir.FunctionType(ir.VoidType(), []), "tilerelease", "~{memory}", [], side_effect=True)
        return context.get_dummy_value()
    return types.void(), cg


# Four blocks: C_j = A_j . B_j, j = 0..3 (tmm0-3), A_j at $0 + 34 j (row stride $1), B_j at $2+j
# (row stride $6, as wide as a C row), C_j stored at $7+j. Two A and two B registers alternate so
# a load does not wait on the product before it.
_DP4 = ("tilezero %tmm0\n\ttilezero %tmm1\n\ttilezero %tmm2\n\ttilezero %tmm3\n\t"
        "tileloadd ($0,$1,1), %tmm4\n\ttileloadd ($2,$6,1), %tmm6\n\ttdpbssd %tmm6, %tmm4, %tmm0\n\t"
        "tileloadd 34($0,$1,1), %tmm5\n\ttileloadd ($3,$6,1), %tmm7\n\ttdpbssd %tmm7, %tmm5, %tmm1\n\t"
        "tileloadd 68($0,$1,1), %tmm4\n\ttileloadd ($4,$6,1), %tmm6\n\ttdpbssd %tmm6, %tmm4, %tmm2\n\t"
        "tileloadd 102($0,$1,1), %tmm5\n\ttileloadd ($5,$6,1), %tmm7\n\ttdpbssd %tmm7, %tmm5, %tmm3\n\t"
        "tilestored %tmm0, ($7,$6,1)\n\ttilestored %tmm1, ($8,$6,1)\n\t"
        "tilestored %tmm2, ($9,$6,1)\n\ttilestored %tmm3, ($10,$6,1)")
# One block (a row's last nb % 4): A at $0 (stride $1), B at $2 (stride $3), C stored at $4.
_DP1 = ("tilezero %tmm0\n\ttileloadd ($0,$1,1), %tmm4\n\ttileloadd ($2,$3,1), %tmm6\n\t"
        "tdpbssd %tmm6, %tmm4, %tmm0\n\ttilestored %tmm0, ($4,$3,1)")


def _asm(builder, text, ops):
    ft = ir.FunctionType(ir.VoidType(), [o.type for o in ops])
    builder.asm(ft, text, ",".join(["r"] * len(ops)) + ",~{memory}", ops, side_effect=True)


def _vload(builder, p, ty):
    v = builder.load(builder.bitcast(p, ir.PointerType(ty)))
    v.align = 4
    return v


V16F, V16I = ir.VectorType(F32, 16), ir.VectorType(ir.IntType(32), 16)
MS = (1, 2, 4, 8, 16)  # token-tile widths: a batch of N takes the narrowest that holds it (16: tiles of 16)
ROWVEC = (1, 2, 4)  # widths whose epilogue runs vectors of the 16 rows (d_w gathered once for all tokens)


@intrinsic
def _panel(typingctx, w, base, rbytes, nb, xv, xo, xdt, xdo, c, acc, nxt, nl, m):
    """One panel (16 rows) x one tile of m tokens (m in MS, see _config), all nb blocks:

        for b in 0 .. nb-1:  C = A_b . B_b (tiles, exact int32)
                             acc[r, t] = fma(float(C[r, t]), d_w[r, b] * xd[t, b], acc[r, t])

    then acc (float32 [16 * m], row-major) stored. One IR loop, so acc lives in vector registers
    across the tile asm (its memory clobber cannot reach an alloca whose address never escapes)
    and only C goes through memory (AMX has no tile -> vector move). Widths in ROWVEC run vectors
    of the 16 rows, one a token (d_w gathered once a block for all), the others vectors of the m
    tokens, one a row (d_w broadcast); the same operations an element either way. A at
    w[base + 34 b + 2] (row
    stride rbytes), B_b at xv[xo + 32 m b] (rows of 4m bytes: vnni_acts's layout, or for m = 1
    the token's quants as they lie), xd at xdt[xdo + m b]; c holds two sets of four C tiles.
    Group g + 1's tiles are issued before group g's epilogue, and the next panel's nl lines at
    w[nxt] are prefetched a share a group: the tile loads alone left the weight stream
    latency-bound (~12 GB/s a thread; with the prefetch ~17)."""
    mv = m.literal_value if isinstance(m, types.IntegerLiteral) else None
    if mv not in MS:
        return None

    def cg(context, builder, sig, args):
        w_, base_, rb, nb_, xv_, xo_, xdt_, xdo_, c_, acc_, nxt_, nl_, _ = args
        i32 = ir.IntType(32)
        W = _data(builder, context, sig.args[0], w_)
        XV = builder.gep(_data(builder, context, sig.args[4], xv_), [xo_])
        XD = builder.gep(builder.bitcast(_data(builder, context, sig.args[6], xdt_), ir.PointerType(F32)), [xdo_])
        C = _data(builder, context, sig.args[8], c_)
        ACC = _data(builder, context, sig.args[9], acc_)
        pf = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [ir.PointerType(I8), i32, i32, i32]))
        fma = builder.module.declare_intrinsic("llvm.fma.v16f32", fnty=ir.FunctionType(V16F, [V16F] * 3))
        rowvec = mv in ROWVEC  # vectors of the 16 rows, one a token; else of the m tokens, one a row
        VF, VI = (V16F, V16I) if rowvec else (ir.VectorType(F32, mv), ir.VectorType(i32, mv))
        fmav = fma if VF.count == 16 else builder.module.declare_intrinsic(
            f"llvm.fma.v{mv}f32", fnty=ir.FunctionType(VF, [VF] * 3))
        nacc = mv if rowvec else TM
        accs = cgutils.alloca_once(builder, VF, size=nacc)
        for r in range(nacc):
            builder.store(ir.Constant(VF, [0.0] * VF.count), builder.gep(accs, [_c(r)]))
        bstep, xdstep, cst = _c(32 * mv), _c(mv), _c(4 * mv)
        A0 = builder.gep(W, [builder.add(base_, _c(2))])
        DW0 = builder.gep(W, [base_])

        def dwat(r, b):
            p = builder.gep(DW0, [builder.add(builder.mul(b, _c(Q8_0_BYTES)), builder.mul(rb, _c(r)))])
            h = builder.load(builder.bitcast(p, ir.PointerType(HALF)))
            h.align = 1
            return h

        def epilogue(b, Cj):
            if not rowvec:  # a vector of m tokens a row
                xd = _vload(builder, builder.gep(XD, [builder.mul(b, xdstep)]), VF)
                for r in range(TM):
                    sc = builder.fmul(builder.fpext(_splat(builder, dwat(r, b), mv), VF), xd)
                    cv = builder.sitofp(_vload(builder, builder.gep(Cj, [_c(4 * mv * r)]), VI), VF)
                    ap = builder.gep(accs, [_c(r)])
                    builder.store(builder.call(fmav, [cv, sc, builder.load(ap)]), ap)
            else:  # 1 or 2 tokens: the 16 rows' d_w gathered once, a vector of the rows a token
                dw = ir.Constant(ir.VectorType(HALF, TM), ir.Undefined)
                for r in range(TM):
                    dw = builder.insert_element(dw, dwat(r, b), ir.Constant(i32, r))
                dwf = builder.fpext(dw, V16F)
                cm = _vload(builder, Cj, ir.VectorType(i32, TM * mv))  # C row-major: [row][token]
                for t in range(mv):
                    ct = cm if mv == 1 else builder.shuffle_vector(
                        cm, cm, ir.Constant(ir.VectorType(i32, TM), [mv * r + t for r in range(TM)]))
                    xd = builder.load(builder.gep(XD, [builder.add(builder.mul(b, xdstep), _c(t))]))
                    sc = builder.fmul(dwf, _splat(builder, xd, TM))
                    ap = builder.gep(accs, [_c(t)])
                    builder.store(builder.call(fma, [builder.sitofp(ct, V16F), sc, builder.load(ap)]), ap)

        def prefetch(b, nblk):
            lo = builder.sdiv(builder.mul(b, nl_), nb_)
            hi = builder.sdiv(builder.mul(builder.add(b, _c(nblk)), nl_), nb_)
            with cgutils.for_range_slice(builder, lo, hi, _c(1)) as (line, _):
                builder.call(pf, [builder.gep(W, [builder.add(nxt_, builder.mul(line, _c(64)))]),
                                  ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])

        def cset(g):
            return builder.gep(C, [builder.mul(builder.and_(g, _c(1)), _c(4096))])

        def dp4(g):
            b = builder.mul(g, _c(4))
            prefetch(b, 4)
            A = builder.gep(A0, [builder.mul(b, _c(Q8_0_BYTES))])
            Bs = [builder.gep(XV, [builder.mul(builder.add(b, _c(j)), bstep)]) for j in range(4)]
            Cg = cset(g)
            _asm(builder, _DP4, [A, rb, *Bs, cst, *[builder.gep(Cg, [_c(1024 * j)]) for j in range(4)]])

        ng = builder.sdiv(nb_, _c(4))
        with builder.if_then(builder.icmp_signed(">", ng, _c(0))):
            dp4(_c(0))
        with cgutils.for_range(builder, ng) as loop:
            g = loop.index
            with builder.if_then(builder.icmp_signed("<", builder.add(g, _c(1)), ng)):
                dp4(builder.add(g, _c(1)))
            Cg = cset(g)
            for j in range(4):
                epilogue(builder.add(builder.mul(g, _c(4)), _c(j)), builder.gep(Cg, [_c(1024 * j)]))
        with cgutils.for_range_slice(builder, builder.mul(ng, _c(4)), nb_, _c(1)) as (b, _):
            prefetch(b, 1)
            _asm(builder, _DP1, [builder.gep(A0, [builder.mul(b, _c(Q8_0_BYTES))]), rb,
                                 builder.gep(XV, [builder.mul(b, bstep)]), cst, C])
            epilogue(b, C)
        if rowvec and mv > 1:  # back to row-major [row][token], as every width leaves acc
            for r in range(TM):
                for t in range(mv):
                    e = builder.extract_element(builder.load(builder.gep(accs, [_c(t)])), ir.Constant(i32, r))
                    builder.store(e, builder.bitcast(builder.gep(ACC, [_c(4 * (mv * r + t))]), ir.PointerType(F32)))
        else:
            for r in range(nacc):
                dst = builder.bitcast(builder.gep(ACC, [_c(4 * VF.count * r)]), ir.PointerType(VF))
                builder.store(builder.load(builder.gep(accs, [_c(r)])), dst).align = 4
        return context.get_dummy_value()
    return types.void(w, base, rbytes, nb, xv, xo, xdt, xdo, c, acc, nxt, nl, m), cg


@njit(cache=True, nogil=True)
def vnni_acts(xq, xd, xv, xdt):
    """xq [N, K] int8, xd [N, K/32] -> xv [T, K/32, 8, 4m] (AMX's VNNI layout for tiles of m
    tokens: token t of tile T at dword t of each row, k = 4i..4i+3 of block b in row i) and
    xdt [T, K/32, m]; padding tokens are 0."""
    N, K = xq.shape
    nb = K // QK
    m = xdt.shape[2]
    for tt in range(xv.shape[0]):
        for b in range(nb):
            for t in range(m):
                n = tt * m + t
                if n < N:
                    xdt[tt, b, t] = xd[n, b]
                    for i in range(8):
                        for j in range(4):
                            xv[tt, b, i, t * 4 + j] = xq[n, b * QK + i * 4 + j]
                else:
                    xdt[tt, b, t] = 0.0
                    for i in range(8):
                        for j in range(4):
                            xv[tt, b, i, t * 4 + j] = 0


@njit(cache=True, nogil=True, inline="always")
def _config(cfg, m):
    """Tiles for 16 weight rows x m tokens: C (tmm0-3) 16 x 4m bytes, A (tmm4-5) 16 x 32,
    B (tmm6-7) 8 x 4m. m = 1: one token, whose activations are a B tile as they lie (four
    consecutive k a row); otherwise tiles of m tokens from vnni_acts."""
    cfg[:] = 0
    cfg[0] = 1  # palette 1; colsb (u16) at 16 + 2i, rows (u8) at 48 + i
    for i in range(8):
        cfg[16 + 2 * i] = 32 if i in (4, 5) else 4 * m
        cfg[48 + i] = 8 if i >= 6 else TM


@njit(cache=True, nogil=True)
def panels(w, woff, rbytes, R, p0, p1, nb, N, xq, xd, xv, xdt, out, ocol):
    """out[n, ocol + r] = row r . token n for the rows of 16-row panels p0..p1-1 (a thread's share:
    one tile configuration and one set of buffers for all of them). A last panel of fewer than 16
    rows runs on a copy padded with zero rows (the tiles' loads would read past the matrix)."""
    m = xdt.shape[2]
    cfg = np.empty(64, np.uint8)
    c = np.empty(8 * TM * TM, np.int32)
    acc = np.empty(TM * TM, np.float32)
    xvf, xdtf, xqf, xdf = xv.reshape(-1), xdt.reshape(-1), xq.reshape(-1), xd.reshape(-1)
    nl = (TM * rbytes + 63) // 64
    _config(cfg, m)
    _tilecfg(cfg)
    for p in range(p0, p1):
        r0 = p * TM
        nr = min(TM, R - r0)
        src, base = w, woff + r0 * rbytes
        nxt = base + TM * rbytes if p + 1 < p1 else base  # (the last panel: its own lines, harmless)
        if nr < TM:
            src = np.zeros(TM * rbytes, np.uint8)
            src[: nr * rbytes] = w[base : base + nr * rbytes]
            base, nxt = 0, 0
        if m == 1:
            _panel(src, base, rbytes, nb, xqf, 0, xdf, 0, c, acc, nxt, nl, 1)
            for r in range(nr):
                out[0, ocol + r0 + r] = acc[r]
            continue
        for tt in range(xv.shape[0]):
            xo, xdo = tt * nb * 32 * m, tt * nb * m
            pn, pl = (nxt, nl) if tt == 0 else (base, 0)
            if m == 2:
                _panel(src, base, rbytes, nb, xvf, xo, xdtf, xdo, c, acc, pn, pl, 2)
            elif m == 4:
                _panel(src, base, rbytes, nb, xvf, xo, xdtf, xdo, c, acc, pn, pl, 4)
            elif m == 8:
                _panel(src, base, rbytes, nb, xvf, xo, xdtf, xdo, c, acc, pn, pl, 8)
            else:
                _panel(src, base, rbytes, nb, xvf, xo, xdtf, xdo, c, acc, pn, pl, 16)
            for t in range(min(m, N - tt * m)):
                for r in range(nr):
                    out[tt * m + t, ocol + r0 + r] = acc[r * m + t]
    _tilerelease()


CHUNK = 64  # panels a work item at most (1,024 rows): enough to amortise its set-up


@njit(parallel=True, cache=True, nogil=True)
def gemm_q8_0(w, woff, rbytes, R, K, xq, xd, out, ocol, threads):
    """out[n, ocol + r] = W[r] . x[n] for a Q8_0 matrix of R rows at byte woff of w (flat uint8),
    x [N, K] as gemm_int8_act.quantize gives it (int8 quants, a float32 scale a block of 32);
    threads: numba.get_num_threads() (a global read would keep this from Numba's disk cache)."""
    N = xq.shape[0]
    nb = K // QK
    m = 1 if N == 1 else 2 if N == 2 else 4 if N <= 4 else 8 if N <= 8 else TM
    T = 0 if N == 1 else (N + m - 1) // m
    xv = np.empty((T, nb, 8, 4 * m), np.int8)
    xdt = np.empty((T, nb, m), np.float32)
    if N > 1:
        vnni_acts(xq, xd, xv, xdt)
    P = (R + TM - 1) // TM
    # work items of at most CHUNK panels, at least ~4 a thread so the threads balance
    chunk = max(1, min(CHUNK, P // (4 * threads)))
    for i in prange((P + chunk - 1) // chunk):
        p0 = np.int64(i) * chunk
        panels(w, woff, rbytes, R, p0, min(P, p0 + chunk), nb, N, xq, xd, xv, xdt, out, ocol)
