"""Every decoder layer of one step in one Numba call, over the GGUF blocks and a paged fp16 KV cache.

Why one call: at batch 1 a SmolLM2 step is ~200 matrix-vector products of
20-200 µs each; dispatching them one by one from Python (torch or Numba, ~5-10 µs
a call with its argument checks) would cost as much as the math. Here Python
calls once per step; inside, each layer is

    h = rms_norm(x) ; qkv = h Wqkv (+ b) ; q, k = qk_norm(q, k) ; rope(q, k)
    write k, v at the rows' cache slots (fp16)
    a = softmax(q K^T * scale) V      over each row's own context (its block table)
    x += post_norm(a Wo) ; h = rms_norm(x) ; x += post_norm(W2 (act(h Wg) * h Wu))

with the llama / qwen2 / qwen3 / gemma3 differences as flags and absent vectors
(`fo[l, i] < 0`). The matrix products are gemm_int8_act's per-row dots (prange over
output rows, in blocks of RB rows); attention is paged_attention's (a prange over rows and query-head groups).

Batch invariance: a row's numbers never depend on the other rows of the step.
Each GEMV output is one fixed chain (gemm_int8_act.py); norms, RoPE and the
activation are per row; attention for a row at position p reads keys 0..p (or
its window) from the cache in position order, after every row of the step has
written its own k/v — a prefill chunk, a decode and a recompute after
preemption run exactly the same code on the same inputs.

Layouts (N rows in the step, L layers):
    blob   uint8 [file bytes]          the memory-mapped GGUF
    mats   int64 [L, 7, 4]             (byte offset, rows, bytes per row, GGML type) of
                                       attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down
    fv     float32 [*], fo int64 [L, 7] float vectors and their offsets (-1: absent) for
                                       attn_norm, q_norm, k_norm, post_attn_norm, ffn_norm,
                                       post_ffn_norm, qkv bias
    x      float32 [N, d]              the residual stream, updated in place
    kc, vc uint16 [L * blocks * block_size * Hkv * D]   fp16 bits (or float32: same code)
    tables int64 [*], row_tab int64 [N] each row's block table (offset into tables)
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from imp.kernels.cpu.float_lanes import exp_span, fdot, store16
from imp.kernels.cpu import gemm_int8_act as qd
from imp.kernels.cpu.gemm_int8_act import RB, acts_for, block_dots, quantize_rows, widen_rows
from imp.kernels.cpu.paged_attention import attention

NORM, QNORM, KNORM, POST_ATTN, FFN_NORM, POST_FFN, BIAS = range(7)
SILU, GELU_TANH = 0, 1
# Rows from which the per-row work (norms, activation quantization, RoPE, the activation)
# is split over the threads: a parallel region costs ~6 us to start (measured, OpenMP layer,
# 2 threads), more than a decode row's work, while a Gemma prefill-512 spent ~0.9 s in it
# on one core. Each row runs the same code either way, so the choice changes no bits.
PAR_ROWS = 8


@njit(cache=True, nogil=True, inline="always")
def _sumsq(x, off, n):
    return fdot(x, off, x, off, n)


@njit(cache=True, nogil=True)
def _rms_norm_rows(x, w, wo, eps, out):
    """out[n] = x[n] / rms(x[n]) * w[wo : wo + d] (out may be x)."""
    N, d = x.shape
    xf, of = x.reshape(-1), out.reshape(-1)
    for n in range(N):
        r = np.float32(1.0) / np.float32(math.sqrt(_sumsq(xf, n * d, d) / np.float32(d) + eps))
        for i in range(d):
            of[n * d + i] = x[n, i] * r * w[wo + i]


@njit(parallel=True, cache=True, nogil=True)
def _norm_par(x, w, wo, eps, out):
    for n in prange(x.shape[0]):
        _rms_norm_rows(x[n:n + 1], w, wo, eps, out[n:n + 1])


@njit(cache=True, nogil=True)
def _norm_rows(x, w, wo, eps, out):
    """_rms_norm_rows, split over the threads for a prefill-size step."""
    if x.shape[0] >= PAR_ROWS:
        _norm_par(x, w, wo, eps, out)
    else:
        _rms_norm_rows(x, w, wo, eps, out)


@njit(cache=True, nogil=True)
def _head_norm(v, off, D, w, wo, eps):
    """In place: one head of D values at v[off] (flat), RMS-normed, times w[wo : wo + D]."""
    r = np.float32(1.0) / np.float32(math.sqrt(_sumsq(v, off, D) / np.float32(D) + eps))
    for i in range(D):
        v[off + i] = v[off + i] * r * w[wo + i]


@njit(cache=True, nogil=True)
def _rope(v, off, D, c, s, p, neox):
    """Rotate one head at v[off] (flat) by the cos/sin row p: adjacent pairs (llama) or halves (NEOX)."""
    half = D // 2
    for i in range(half):
        cs, sn = c[p, i], s[p, i]
        a = off + (i if neox else 2 * i)
        b = a + (half if neox else 1)
        x0, x1 = v[a], v[b]
        v[a] = x0 * cs - x1 * sn
        v[b] = x1 * cs + x0 * sn


@njit(cache=True, nogil=True, inline="always")
def _qkv_post_row(qkv, fv, fo, l, H, Hkv, D, eps, c, s, pos, neox, kc, vc, nblocks, bs, slots, n):
    """Row n of the fresh q|k|v: bias, per-head norms (qwen3, gemma3), RoPE on q and k heads,
    then k and v written to the row's cache slot (fp16 bits or fp32)."""
    Wq = qkv.shape[1]
    qf = qkv.reshape(-1)
    if fo[l, BIAS] >= 0:
        for i in range(Wq):
            qkv[n, i] += fv[fo[l, BIAS] + i]
    for hh in range(H + Hkv):  # q heads then k heads
        off = n * Wq + hh * D
        nw = fo[l, QNORM] if hh < H else fo[l, KNORM]
        if nw >= 0:
            _head_norm(qf, off, D, fv, nw, eps)
        _rope(qf, off, D, c, s, pos[n], neox)
    base = (l * nblocks * bs + slots[n]) * Hkv * D
    for g in range(Hkv):
        for cc in range(D // 16):
            store16(kc, base + g * D + 16 * cc, qf, n * Wq + (H + g) * D + 16 * cc)
            store16(vc, base + g * D + 16 * cc, qf, n * Wq + (H + Hkv + g) * D + 16 * cc)


@njit(parallel=True, cache=True, nogil=True)
def _qkv_post_par(qkv, fv, fo, l, H, Hkv, D, eps, c, s, pos, neox, kc, vc, nblocks, bs, slots):
    for n in prange(qkv.shape[0]):  # rows write distinct cache slots
        _qkv_post_row(qkv, fv, fo, l, H, Hkv, D, eps, c, s, pos, neox, kc, vc, nblocks, bs, slots, n)


@njit(parallel=True, cache=True, nogil=True)
def _gemm_multi(blob, kinds, mats, l, m0, m1, xq, xu, xd, xs, out):
    """out[n, :] = concatenation over matrices m0..m1-1 of layer l of W_m x[n] (one prange over
    blocks of RB rows, a block never straddling two matrices); x as _quantize gives it, each
    matrix reading the bytes its type takes (gemm_int8_act.acts_for)."""
    N, K = xq.shape
    nb = K // 32
    nblk = 0
    for m in range(m0, m1):
        nblk += (mats[l, m, 1] + RB - 1) // RB
    xqf, xuf, xdf, xsf = xq.reshape(-1), xu.reshape(-1), xd.reshape(-1), xs.reshape(-1)
    for bi in prange(nblk):
        m, b, col = m0, np.int64(bi), np.int64(0)
        while b >= (mats[l, m, 1] + RB - 1) // RB:  # which matrix, which block of it
            b -= (mats[l, m, 1] + RB - 1) // RB
            col += mats[l, m, 1]
            m += 1
        r0 = b * RB
        block_dots(blob, kinds, mats[l, m, 3], mats[l, m, 0] + r0 * mats[l, m, 2], mats[l, m, 2],
                   min(RB, mats[l, m, 1] - r0), nb, N, acts_for(mats[l, m, 3], xqf, xuf), xdf, xsf, out, col + r0)


@njit(parallel=True, cache=True, nogil=True)
def _lora_add(inp, out, mats, l, m0, m1, lo, la, lb, lscale, row_slot):
    """out[n, matrix m's columns] += scale * B (A inp[n]) for each row n with an adapter slot
    (imp.model.lora's packing). Per row in a fixed order: batch invariance holds. One prange
    over rows: at decode the work is ~r * (in + out) multiply-adds, nothing to split."""
    N, K = inp.shape
    for n in prange(N):
        s = row_slot[n]
        if s < 0:
            continue
        col = 0
        for m in range(m0, m1):
            rows = mats[l, m, 1]
            r = lo[s, l, m, 2]
            if r > 0:
                oa, ob = lo[s, l, m, 0], lo[s, l, m, 1]
                kin = K  # every matrix of the group reads the same input row
                t = np.empty(r, np.float32)
                for i in range(r):
                    acc = np.float32(0.0)
                    for k in range(kin):
                        acc += la[oa + i * kin + k] * inp[n, k]
                    t[i] = acc * lscale[s]
                for j in range(rows):
                    acc = np.float32(0.0)
                    for i in range(r):
                        acc += lb[ob + j * r + i] * t[i]
                    out[n, col + j] += acc
            col += rows


@njit(parallel=True, cache=True, nogil=True)
def _quantize_par(h, xq, xu, xd, xs):
    N = h.shape[0]
    for n in prange(N):
        quantize_rows(h[n:n + 1], xq[n:n + 1], xd[n:n + 1], xs[n:n + 1])
        widen_rows(xq[n:n + 1], xu[n:n + 1])


@njit(cache=True, nogil=True)
def _quantize(h):
    """h [N, K] -> (xq, xu, xd, xs): gemm_int8_act.quantize_rows, then widen_rows."""
    N, K = h.shape
    xq = np.empty((N, K), np.int8)
    xu = np.empty((N, K), np.int8)
    xd = np.empty((N, K // 32), np.float32)
    xs = np.empty((N, K // 32), np.float32)
    if N >= PAR_ROWS:
        _quantize_par(h, xq, xu, xd, xs)
    else:
        quantize_rows(h, xq, xd, xs)
        widen_rows(xq, xu)
    return xq, xu, xd, xs


@njit(cache=True, nogil=True, inline="always")
def _post_norm_add_row(x, y, fv, fo, l, which, eps, n):
    if fo[l, which] >= 0:
        _rms_norm_rows(y[n:n + 1], fv, fo[l, which], eps, y[n:n + 1])
    for i in range(x.shape[1]):
        x[n, i] += y[n, i]


@njit(parallel=True, cache=True, nogil=True)
def _post_norm_add_par(x, y, fv, fo, l, which, eps):
    for n in prange(x.shape[0]):
        _post_norm_add_row(x, y, fv, fo, l, which, eps, n)


@njit(cache=True, nogil=True)
def _post_norm_add(x, y, fv, fo, l, which, eps):
    """x += rms_norm(y) * w (gemma3's post norms) or x += y when the layer has none."""
    if x.shape[0] >= PAR_ROWS:
        _post_norm_add_par(x, y, fv, fo, l, which, eps)
        return
    for n in range(x.shape[0]):
        _post_norm_add_row(x, y, fv, fo, l, which, eps, n)


@njit(cache=True, nogil=True, inline="always")
def _act_row(gu, a, dff, act, n):
    """a[n] = act(gate) * up: the exponent's argument per element, then one 16-lane exp over the
    row (float_lanes.exp_span), then the quotient (each element the same IEEE operations as before
    but for the exp itself: ~1 ulp of libm's expf)."""
    for i in range(dff):
        gv = gu[n, i]
        if act == SILU:
            a[n, i] = -gv
        else:  # gelu, tanh approximation (gemma3), as x * sigmoid(2z): 0.5 (1 + tanh z) = 1 / (1 + e^-2z);
            # one exp instead of tanhf (glibc's tanhf measured 33 ns an element: 0.6 s of a Gemma prefill-512)
            a[n, i] = np.float32(-1.5957691216057308) * (gv + np.float32(0.044715) * gv * gv * gv)
    exp_span(a.reshape(-1), n * dff, dff)
    for i in range(dff):
        a[n, i] = gu[n, i] / (np.float32(1.0) + a[n, i]) * gu[n, dff + i]


@njit(parallel=True, cache=True, nogil=True)
def _act_par(gu, a, dff, act):
    for n in prange(gu.shape[0]):
        _act_row(gu, a, dff, act, n)


@njit(cache=True, nogil=True)
def _act_rows(gu, a, dff, act):
    """a = act(gate) * up, per row."""
    if gu.shape[0] >= PAR_ROWS:
        _act_par(gu, a, dff, act)
        return
    for n in range(gu.shape[0]):
        _act_row(gu, a, dff, act, n)


@njit(cache=True, nogil=True)
def forward_layers(blob, mats, fv, fo, sliding, x, pos, slots, tables, row_tab,
                   cos_g, sin_g, cos_l, sin_l, kc, vc, nblocks, bs,
                   H, Hkv, D, window, neox, act, eps, scale, lo, la, lb, lscale, row_slot, kinds):
    """Run every layer over the step's rows (see the module docstring); x [N, d] in place.
    lo, la, lb, lscale, row_slot: the LoRA adapters (imp.model.lora) and each row's slot
    (-1 = none; lo with 0 slots when no adapter is loaded). kinds: the GGML types of mats
    (imp.kernels.cpu.kinds: only their loops are compiled)."""
    lora = lo.shape[0] > 0
    N, d = x.shape
    L = mats.shape[0]
    h = np.empty((N, d), np.float32)
    Wq = (H + 2 * Hkv) * D
    qkv = np.empty((N, Wq), np.float32)
    attn = np.empty((N, H * D), np.float32)
    y = np.empty((N, d), np.float32)
    dff = mats[0, 4, 1]
    gu = np.empty((N, 2 * dff), np.float32)
    a = np.empty((N, dff), np.float32)
    # the matrix ranges as int64 values, not literals: a literal argument makes Numba compile
    # _gemm_multi (and _lora_add) once per call site, 4 x ~14 s of a cold boot's ~100 s
    m_qkv, m_o, m_gu, m_down, m_end = np.int64(0), np.int64(3), np.int64(4), np.int64(6), np.int64(7)
    for l in range(L):
        _norm_rows(x, fv, fo[l, NORM], eps, h)
        xq, xu, xd, xs = _quantize(h)
        _gemm_multi(blob, kinds, mats, l, m_qkv, m_o, xq, xu, xd, xs, qkv)
        if lora:
            _lora_add(h, qkv, mats, l, m_qkv, m_o, lo, la, lb, lscale, row_slot)
        c, s = (cos_l, sin_l) if sliding[l] else (cos_g, sin_g)
        if N >= PAR_ROWS:
            _qkv_post_par(qkv, fv, fo, l, H, Hkv, D, eps, c, s, pos, neox, kc, vc, nblocks, bs, slots)
        else:
            for n in range(N):
                _qkv_post_row(qkv, fv, fo, l, H, Hkv, D, eps, c, s, pos, neox, kc, vc, nblocks, bs, slots, n)
        attention(qkv, H, Hkv, D, l, kc, vc, nblocks, bs, pos, tables, row_tab,
                   window if sliding[l] else 0, scale, attn)
        xq, xu, xd, xs = _quantize(attn)
        _gemm_multi(blob, kinds, mats, l, m_o, m_gu, xq, xu, xd, xs, y)
        if lora:
            _lora_add(attn, y, mats, l, m_o, m_gu, lo, la, lb, lscale, row_slot)
        _post_norm_add(x, y, fv, fo, l, np.int64(POST_ATTN), eps)
        _norm_rows(x, fv, fo[l, FFN_NORM], eps, h)
        xq, xu, xd, xs = _quantize(h)
        _gemm_multi(blob, kinds, mats, l, m_gu, m_down, xq, xu, xd, xs, gu)
        if lora:
            _lora_add(h, gu, mats, l, m_gu, m_down, lo, la, lb, lscale, row_slot)
        _act_rows(gu, a, dff, act)
        xq, xu, xd, xs = _quantize(a)
        _gemm_multi(blob, kinds, mats, l, m_down, m_end, xq, xu, xd, xs, y)
        if lora:
            _lora_add(a, y, mats, l, m_down, m_end, lo, la, lb, lscale, row_slot)
        _post_norm_add(x, y, fv, fo, l, np.int64(POST_FFN), eps)


def compile_layer_parts(blob, kinds, mats, fv, fo, d, cos_g, sin_g, kc, vc, nblocks, bs, H, Hkv, D, window, neox, act,
                        eps, scale, lo, la, lb, lscale):
    """Compile much of what forward_layers calls, with zero rows (nothing runs, nothing is written):
    first the row loops block_dots calls, last-called first, then forward_layers' callees after its
    first _gemm_multi; each called with the types forward_layers and block_dots give it (the arrays
    they make are C-contiguous like these, the scalars int64 / float32 like these), so the disk
    cache then holds what they will look up. Why: a cold boot compiles the forward in one child
    process (imp.precompile), ~40 s for Gemma on 2 cores; a second child compiling these meanwhile
    takes ~15 s off it, while the first is busy with the steps before (tokenizer, norms,
    quantization, block_dots itself). tests/test_precompile.py checks that the forward's child
    then compiles none of them."""
    qt, u8, f1 = mats[0, 0, 3], np.empty(0, np.int8), np.empty(0, np.float32)
    o, out = np.int64(0), np.empty((0, 1), np.float32)
    qd.row_dot(blob, kinds, qt, o, o, u8, o, f1, f1, o)
    qd.rows_dot4(blob, kinds, qt, o, o, o, u8, o, f1, f1, o)
    for fn in (qd.rows_dot4x2, qd.rows_dot4x3, qd.rows_dot4x4):
        fn(blob, kinds, qt, o, o, o, u8, o, o, f1, f1, o, o)
    for fn in (qd.row_dot4, qd.row_dot8) if qd.PREDECODE else (qd.row_dot4, qd.row_dot8, qd.row_dot16):
        fn(blob, kinds, qt, o, o, u8, o, o, f1, f1, o, o)
    qd.row_dots(blob, kinds, qt, o, o, o, u8, f1, f1, out, o, o)
    qd.predecoded_dots(blob, kinds, qt, o, o, o, o, o, u8, f1, f1, out, o)  # block_dots' first callee
    z = np.empty(0, np.int64)
    f2 = np.empty((0, d), np.float32)
    qkv = np.empty((0, (H + 2 * Hkv) * D), np.float32)
    attn = np.empty((0, H * D), np.float32)
    dff = mats[0, 4, 1]
    gu = np.empty((0, 2 * dff), np.float32)
    a = np.empty((0, dff), np.float32)
    l, m0, m1 = np.int64(0), np.int64(0), np.int64(3)
    _lora_add(f2, qkv, mats, l, m0, m1, lo, la, lb, lscale, z)
    _qkv_post_par(qkv, fv, fo, l, H, Hkv, D, eps, cos_g, sin_g, z, neox, kc, vc, nblocks, bs, z)
    attention(qkv, H, Hkv, D, l, kc, vc, nblocks, bs, z, z, z, window, scale, attn)
    _post_norm_add(f2, f2.copy(), fv, fo, l, np.int64(POST_ATTN), eps)
    _act_rows(gu, a, dff, act)
