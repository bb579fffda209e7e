"""Quantized GEMV / small GEMM on the CPU over GGUF blocks as they lie in the file.

    y[n, r] = sum_k W[r, k] * x[n, k]      W: [R, K] GGUF blocks, x: [N, K] fp32

The activations are quantized first, per block of 32, as llama.cpp's Q8_1
(`quantize_row_q8_1`): xq = round(x / xd) int8, xd = max|x| / 127, and
xs = xd * sum(xq) for the types whose blocks carry a min (Q4_1, Q5_1, Q4_K, Q5_K).
Then each block of a row contributes (Q4_1, as `ggml_vec_dot_q4_1_q8_1`)

    d_w * xd * isum + m_w * xs,      isum = sum_j q_j * xq_j   (exact int32)

K-quants use the same per-32 activations (llama.cpp uses one scale per 256
for them, Q8_K: ours is finer, never coarser). The row loops are LLVM IR
(row_dot_loop.py): per token, 16 float lanes accumulate the blocks in order
0, 1, 2, ... and nothing else touches them, so y[n, r] is bit-identical
whatever N is and whichever rows sit beside it: batch invariance (a prefill
chunk, a batch of decodes and a recompute after preemption all give the same
numbers). No fast-math: LLVM may not reorder that float chain.

Threads: `prange` over output rows (Numba's thread pool, `numba.set_num_threads`).
`nogil=True`: the event loop keeps running while a step computes.

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32), Q4_K, Q5_K, Q6_K (256).
`reference_gemm` is the float64 reference the tests compare against.

`gemm` (a whole matrix: the models' output heads) takes Q8_0 to AMX tiles
(gemm_q8_0_amx.py) where the CPU and kernel allow: a different, equally batch-invariant
sum, so a matrix takes one route for every batch on a machine. The layers'
matrices (`gemm_into`, fused_forward's `_gemm_multi`) stay on the VNNI loops.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from imp.kernels.cpu import gemm_q8_0_amx, predecoded
from imp.kernels.cpu.kinds import Kinds, picker
from imp.kernels.cpu.row_dot_loop import DP4, UNSIGNED_X, VNNI, rowdot, rowsdot

QK = 32  # activation block
# GGML type ids (gguf.GGMLQuantizationType values; kernels import nothing from the formats layer)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
BLOCKS = {  # type -> (elements per block, bytes per block)
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
    Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
}
SUPPORTED = frozenset(BLOCKS)


def row_bytes(qtype: int, k: int) -> int:
    n, size = BLOCKS[qtype]
    assert k % n == 0, (qtype, k)
    return k // n * size


# ---------------------------------------------------------------- activations


# nnan / ninf / nsz only (no reassociation, no contraction): each value is still the one IEEE
# operation it was, so the bits are, while LLVM may vectorize the max and the rounding (1.5x
# faster; a Gemma prefill-512 spent 6 % in here). Activations are finite.
@njit(cache=True, nogil=True, fastmath={"nnan", "ninf", "nsz"})
def quantize_rows(x, xq, xd, xs):
    """x [N, K] fp32 -> xq [N, K] int8, xd [N, K/32] scale, xs [N, K/32] = xd * sum(xq)."""
    N, K = x.shape
    for n in range(N):
        for b in range(K // QK):
            o = b * QK
            amax = np.float32(0.0)
            for j in range(QK):
                amax = max(amax, abs(x[n, o + j]))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
            s = np.int32(0)
            for j in range(QK):
                v = x[n, o + j] * inv
                t = np.int32(abs(v) + np.float32(0.5))  # roundf, half away from 0: 0.5 - v == |v| + 0.5 for v < 0
                q = -t if v < 0 else t
                xq[n, o + j] = q
                s += q
            xd[n, b] = d
            xs[n, b] = d * np.float32(s)


@njit(cache=True, nogil=True)
def widen_rows(xq, xu):
    """xu [N, K] = the int8 bits of xq + 128 (xq ^ 0x80): what the UNSIGNED_X types' kernels
    read (row_dot_loop's docstring)."""
    N, K = xq.shape
    for n in range(N):
        for k in range(K):
            xu[n, k] = xq[n, k] ^ np.int8(-128)


_UX = np.array([qt in UNSIGNED_X for qt in range(16)], np.bool_)  # by GGML type id


@njit(cache=True, nogil=True, inline="always")
def acts_for(qtype, xq, xu):
    """The activation bytes a type's kernel reads: x + 128 for the UNSIGNED_X types, else x."""
    return xu if _UX[qtype] else xq


# ---------------------------------------------------------------- one row . T tokens, per type
# The loops themselves are LLVM IR (row_dot_loop.py): 16 float lanes per token, the
# block decoded once for T tokens. One intrinsic per (type, T); every T gives identical
# bits per token, so how a batch is split into tiles changes nothing.

TILE, MID_TILE, HALF_TILE = 16, 8, 4  # tokens per weight decode: tiles of 16, then 8, 4, one by one
# (measured, one thread, Gemma's prefill-512 matrices: 16 gives 1.15-1.45x the rate of 8,
# and 8 had given ~1.3x the rate of 4: the decode of a Q5_0 / K-quant block pair costs as
# much as several tokens' dots; the smaller tiles keep small decode batches tiled)
_RD = {(qt, t): rowdot(qt, t) for qt in BLOCKS for t in (1, HALF_TILE, MID_TILE, TILE)}


_ROW_ARGS = ("w", "base", "nb", "xq", "xo", "xstride", "xd", "xs", "xb", "xbstride")
_SUPER = {Q4_K: 8, Q5_K: 8, Q6_K: 8}  # the K-quants' loops count 256-element super-blocks
# Row . T tokens through the type's intrinsic for one T, only the model's types compiled (kinds.py)
_pick1, _pick4, _pick8, _pick16 = (
    picker(f"pick_row{t}", {qt: _RD[qt, t] for qt in BLOCKS}, _ROW_ARGS, "nb", _SUPER, t) for t in (1, 4, 8, 16))


@njit(cache=True, nogil=True)
def row_dot16(w, kinds, qtype, base, nb, xq, xo, xstride, xd, xs, xb, xbstride):
    """Row . 16 tokens (token t at xo + t*xstride); nb = 32-blocks per row."""
    return _pick16(kinds, qtype, w, base, nb, xq, xo, xstride, xd, xs, xb, xbstride)


@njit(cache=True, nogil=True)
def row_dot8(w, kinds, qtype, base, nb, xq, xo, xstride, xd, xs, xb, xbstride):
    """Row . 8 tokens (token t at xo + t*xstride); nb = 32-blocks per row."""
    return _pick8(kinds, qtype, w, base, nb, xq, xo, xstride, xd, xs, xb, xbstride)


@njit(cache=True, nogil=True)
def row_dot4(w, kinds, qtype, base, nb, xq, xo, xstride, xd, xs, xb, xbstride):
    """Row . 4 tokens (token t at xo + t*xstride); nb = 32-blocks per row."""
    return _pick4(kinds, qtype, w, base, nb, xq, xo, xstride, xd, xs, xb, xbstride)


@njit(cache=True, nogil=True)
def row_dot(w, kinds, qtype, base, nb, xq, xo, xd, xs, xb):
    """Row . one token: the same per-token arithmetic as row_dot16 / 8 / 4."""
    return _pick1(kinds, qtype, w, base, nb, xq, xo, 0, xd, xs, xb, 0)[0]


ROWS = 4  # weight rows one decode call covers (rows_dot4)
_RS = {(qt, t): rowsdot(qt, ROWS, t) for qt in BLOCKS for t in (1, 2, 3, 4)}


_ROWS_ARGS = ("w", "base", "rbytes", "nb", "xq", "xo", "xstride", "xd", "xs", "xb", "xbstride")
_picks1, _picks2, _picks3, _picks4 = (
    picker(f"pick_rows{t}", {qt: _RS[qt, t] for qt in BLOCKS}, _ROWS_ARGS, "nb", _SUPER, ROWS * t)
    for t in (1, 2, 3, 4))


@njit(cache=True, nogil=True)
def rows_dot4(w, kinds, qtype, base, rbytes, nb, xq, xo, xd, xs, xb):
    """ROWS consecutive rows (row i at base + i * rbytes) . one token: each output the bits
    row_dot gives it, the rows sharing the token's loads and one loop (decode's short rows
    were mostly per-row overhead; measured in PERFORMANCE.md)."""
    return _picks1(kinds, qtype, w, base, rbytes, nb, xq, xo, 0, xd, xs, xb, 0)


@njit(cache=True, nogil=True)
def rows_dot4x2(w, kinds, qtype, base, rbytes, nb, xq, xo, xstride, xd, xs, xb, xbstride):
    """ROWS rows . 2 consecutive tokens, (row i, token t) at i * 2 + t: the bits rows_dot4 gives
    each token, the matrix read once for both."""
    return _picks2(kinds, qtype, w, base, rbytes, nb, xq, xo, xstride, xd, xs, xb, xbstride)


@njit(cache=True, nogil=True)
def rows_dot4x4(w, kinds, qtype, base, rbytes, nb, xq, xo, xstride, xd, xs, xb, xbstride):
    """ROWS rows . 4 consecutive tokens, (row i, token t) at i * 4 + t (see rows_dot4x2)."""
    return _picks4(kinds, qtype, w, base, rbytes, nb, xq, xo, xstride, xd, xs, xb, xbstride)


@njit(cache=True, nogil=True)
def rows_dot4x3(w, kinds, qtype, base, rbytes, nb, xq, xo, xstride, xd, xs, xb, xbstride):
    """ROWS rows . 3 consecutive tokens, (row i, token t) at i * 3 + t (see rows_dot4x2)."""
    return _picks3(kinds, qtype, w, base, rbytes, nb, xq, xo, xstride, xd, xs, xb, xbstride)


@njit(cache=True, nogil=True)
def row_dots(w, kinds, qtype, base, nb, N, xq, xd, xs, out, r, n0=0):
    """out[n, r] = row . token n for tokens n0..N-1 (xq/xd/xs flat): tiles of TILE, then one by one."""
    K = nb * QK
    n = n0
    if not PREDECODE:  # (where the rows are predecoded from 16 tokens on, no caller has 16 here: not compiled)
        while n + TILE <= N:
            y = row_dot16(w, kinds, qtype, base, nb, xq, n * K, K, xd, xs, n * nb, nb)
            for t in range(TILE):
                out[n + t, r] = y[t]
            n += TILE
    if n + MID_TILE <= N:
        y8 = row_dot8(w, kinds, qtype, base, nb, xq, n * K, K, xd, xs, n * nb, nb)
        for t in range(MID_TILE):
            out[n + t, r] = y8[t]
        n += MID_TILE
    if n + HALF_TILE <= N:
        y4 = row_dot4(w, kinds, qtype, base, nb, xq, n * K, K, xd, xs, n * nb, nb)
        for t in range(HALF_TILE):
            out[n + t, r] = y4[t]
        n += HALF_TILE
    while n < N:
        out[n, r] = row_dot(w, kinds, qtype, base, nb, xq, n * K, xd, xs, n * nb)
        n += 1


RB = 8  # weight rows a work item holds (see block_dots)

# Prefill-sized batches: each row decoded once into a scratch, then tiles of predecoded.TILE tokens (the
# row loops' bits; predecoded.py says why). Only the 4-product-lane tiers: the generic loop is other code.
# From how many tokens (measured, one thread, 16,384 x 2,048 from memory, 8 tokens, predecoded / row loops,
# AVX-512 and Haswell code: Q5_0 45 / 38 and 30 / 21 GMAC/s; Q4_K 42 / 45 and 34 / 37; Q6_K 34 / 40 and 24 / 28;
# Q8_0 36 / 44 and 28 / 32; Q4_1 43 / 41 and 29 / 31; from 16 tokens on every type is faster predecoded):
# 8 for the 32-types whose small batches take the 4 rows x 4 tokens loop with a heavy decode, else 16.
PREDECODE, PT = DP4, predecoded.TILE
_PRE_MIN = np.array([8 if qt in (Q4_0, Q5_0, Q5_1) else TILE for qt in range(16)], np.int64)  # by type id
_PDEC_ARGS = ("w", "base", "units", "sw", "ss", "st", "sm", "slot0", "m0")
_pick_dec = picker("pick_pdec", {qt: predecoded.predecode(qt) for qt in BLOCKS}, _PDEC_ARGS, "units", _SUPER, 0)
_PDOT_ARGS = ("sw", "ss", "st", "sm", "slot0", "m0", "units", "xq", "xo", "xstride", "xd", "xs", "xb", "xbstride")
_pick_pdt, _pick_pd1 = (picker(f"pick_pdot{t}", {qt: predecoded.pdot(qt, t) for qt in BLOCKS}, _PDOT_ARGS, "units",
                               _SUPER, t) for t in (PT, 1))


@njit(cache=True, nogil=True)
def predecoded_dots(w, kinds, qtype, base, rbytes, nrows, nb, N, xq, xd, xs, out, c0):
    """block_dots' outputs for a prefill-sized N: the nrows rows decoded once into a scratch
    (predecoded.py), then tiles of PT tokens outside, rows inside, the last tokens one by one."""
    slots, ms = nb // 2 + 1, nb + 8  # pair slots (+ an odd last block) and mins a row
    sw = np.empty(nrows * slots * 64, np.int8)
    ss = np.empty(nrows * slots * 16, np.float32)
    st = np.empty(nrows * slots * 16 if VNNI else 0, np.int32)
    sm = np.empty(nrows * ms, np.float32)
    for i in range(nrows):
        _pick_dec(kinds, qtype, w, base + i * rbytes, nb, sw, ss, st, sm, i * slots, i * ms)
    K = nb * QK
    n = 0
    while n + PT <= N:
        for i in range(nrows):
            y = _pick_pdt(kinds, qtype, sw, ss, st, sm, i * slots, i * ms, nb, xq, n * K, K, xd, xs, n * nb, nb)
            for t in range(PT):
                out[n + t, c0 + i] = y[t]
        n += PT
    while n < N:
        for i in range(nrows):
            out[n, c0 + i] = _pick_pd1(kinds, qtype, sw, ss, st, sm, i * slots, i * ms, nb, xq, n * K, 0, xd, xs,
                                       n * nb, 0)[0]
        n += 1


@njit(cache=True, nogil=True, inline="always")
def _put(out, y, n, c, T):
    """out[n + t, c + j] = y[j * T + t]: a rows_dot4xT result, ROWS rows x T tokens, into place."""
    for j in range(ROWS):
        for t in range(T):
            out[n + t, c + j] = y[j * T + t]


@njit(cache=True, nogil=True)
def block_dots(w, kinds, qtype, base, rbytes, nrows, nb, N, xq, xd, xs, out, c0):
    """out[n, c0 + i] = row i . token n for nrows consecutive rows (row i at base + i * rbytes).

    Token tiles outside, rows inside: a tile's activations (16 x K int8) are read from L2
    once and then from L1 for every row of the block, instead of the whole step's
    activations streaming through L1 once per row (1 byte of L2 traffic per multiply-add
    at prefill). Each output is the same row_dot16 / row_dots call either way: same bits.
    From _PRE_MIN[qtype] tokens (a prefill, a large decode batch) the rows are decoded once
    instead (predecoded_dots): the same bits again."""
    if PREDECODE and N >= _PRE_MIN[qtype]:
        predecoded_dots(w, kinds, qtype, base, rbytes, nrows, nb, N, xq, xd, xs, out, c0)
        return
    K = nb * QK
    n = np.int64(0)  # not a literal 0: row_dots below is compiled (and cached) for int64 n0 either way
    while not PREDECODE and n + TILE <= N:  # the generic tier's tiles of 16 (pruned where PREDECODE)
        for i in range(nrows):
            y = row_dot16(w, kinds, qtype, base + i * rbytes, nb, xq, n * K, K, xd, xs, n * nb, nb)
            for t in range(TILE):
                out[n + t, c0 + i] = y[t]
        n += TILE
    if (qtype >= 12 or qtype == 8) and N - n >= (HALF_TILE if qtype == 14 else MID_TILE):
        # K-quants: a super-block's decode is heavy and 4 rows x 4 tokens of it spill registers (measured:
        # Q6_K 1.7x slower than one row a call at 4 and 8 tokens, Q4_K 1.3x at 8): one row a call for the
        # tiles of 8 (Q6_K: and 4) first, as before. Q8_0 too (its decode is nothing, so 8 tokens a weight
        # load beat 4 rows x 4 tokens twice: Gemma's 262,144 x 640 head at 8 rows 14.6 -> 13.8 ms, 12 rows
        # 19.7 -> 18.9, three alternations; 4 rows the same)
        m = n + (N - n) // HALF_TILE * HALF_TILE if qtype == 14 else n + MID_TILE
        for i in range(nrows):
            row_dots(w, kinds, qtype, base + i * rbytes, nb, m, xq, xd, xs, out, c0 + i, n)
        n = m
    # the last 1-15 tokens (all of a decode batch below 16): ROWS rows a call with up to 4 tokens at once
    # (the matrix read once a call, not once a token; the tokens share each weight load and decode),
    # rows past a multiple of ROWS one by one
    while n < N:
        left = min(N - n, 4)
        i = 0
        while i + ROWS <= nrows:
            rb0 = base + i * rbytes
            if left == 4:
                _put(out, rows_dot4x4(w, kinds, qtype, rb0, rbytes, nb, xq, n * K, K, xd, xs, n * nb, nb), n, c0 + i, 4)
            elif left == 3:
                _put(out, rows_dot4x3(w, kinds, qtype, rb0, rbytes, nb, xq, n * K, K, xd, xs, n * nb, nb), n, c0 + i, 3)
            elif left == 2:
                _put(out, rows_dot4x2(w, kinds, qtype, rb0, rbytes, nb, xq, n * K, K, xd, xs, n * nb, nb), n, c0 + i, 2)
            else:
                _put(out, rows_dot4(w, kinds, qtype, rb0, rbytes, nb, xq, n * K, xd, xs, n * nb), n, c0 + i, 1)
            i += ROWS
        while i < nrows:
            for t in range(n, n + left):
                out[t, c0 + i] = row_dot(w, kinds, qtype, base + i * rbytes, nb, xq, t * K, xd, xs, t * nb)
            i += 1
        n += left


# ---------------------------------------------------------------- GEMM


@njit(parallel=True, cache=True, nogil=True)
def gemm_into(w, woff, kinds, qtype, rbytes, R, K, xq, xu, xd, xs, out, ocol):
    """out[n, ocol + r] = W[r] . x[n] for r < R; W's rows start at byte woff of w (flat uint8);
    x as `quantize` and `widen_rows` give it.

    Work items are blocks of RB rows (block_dots); a weight row is decoded once per tile
    of tokens, from L1."""
    nb = K // QK
    N = xq.shape[0]
    xqf, xdf, xsf = acts_for(qtype, xq, xu).reshape(-1), xd.reshape(-1), xs.reshape(-1)
    for b in prange((R + RB - 1) // RB):
        r0 = np.int64(b) * RB
        block_dots(w, kinds, qtype, woff + r0 * rbytes, rbytes, min(RB, R - r0), nb, N, xqf, xdf, xsf, out, ocol + r0)


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [N, K] fp32 (K % 32 == 0) -> (xq, xd, xs), see `quantize_rows`."""
    assert x.dtype == np.float32 and x.ndim == 2 and x.shape[1] % QK == 0, (x.dtype, x.shape)
    N, K = x.shape
    xq = np.empty((N, K), np.int8)
    xd = np.empty((N, K // QK), np.float32)
    xs = np.empty((N, K // QK), np.float32)
    quantize_rows(np.ascontiguousarray(x), xq, xd, xs)
    return xq, xd, xs


def gemm(w: np.ndarray, qtype: int, x: np.ndarray, amx: bool | None = None, kinds: Kinds | None = None) -> np.ndarray:
    """y [N, R] = W x^T for W the [R, row_bytes] uint8 blocks of a GGUF matrix, x [N, K] fp32.
    amx: Q8_0 on AMX tiles (default: where gemm_q8_0_amx.AMX holds; False: the VNNI loop).
    kinds: the types to compile the loops for (default: qtype's alone; a model passes the set its
    layers use too, so the layers and the head share one compiled kernel)."""
    assert qtype in SUPPORTED and (kinds is None or qtype in kinds), (qtype, kinds)
    assert w.dtype == np.uint8 and w.ndim == 2 and w.flags.c_contiguous, (w.dtype, w.shape)
    R, K = w.shape[0], x.shape[1]
    assert w.shape[1] == row_bytes(qtype, K), (w.shape, qtype, K)
    amx = gemm_q8_0_amx.AMX if amx is None else amx
    assert not amx or gemm_q8_0_amx.AMX, "AMX is not available here"
    xq, xd, xs = quantize(x)
    if amx and qtype == Q8_0:
        out = np.empty((x.shape[0], R), np.float32)
        gemm_q8_0_amx.gemm_q8_0(w.reshape(-1), 0, w.shape[1], R, K, xq, xd, out, 0, numba.get_num_threads())
        return out
    xu = np.empty_like(xq)
    widen_rows(xq, xu)
    out = np.empty((x.shape[0], R), np.float32)
    gemm_into(w.reshape(-1), 0, kinds if kinds is not None else Kinds((qtype,)), qtype, w.shape[1], R, K, xq, xu, xd, xs, out, 0)
    return out


def reference_gemm(w_deq: np.ndarray, x: np.ndarray) -> np.ndarray:
    """float64 reference: the dequantized weights [R, K] times the *quantized* activations
    (xq * xd), so only the kernel's arithmetic is under test, not the activation rounding."""
    xq, xd, _ = quantize(x)
    xh = xq.astype(np.float64) * np.repeat(xd.astype(np.float64), QK, axis=1)  # [N, K]
    return xh @ w_deq.astype(np.float64).T  # [N, R]
