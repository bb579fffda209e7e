"""CPU quantized kernels (imp/kernels/cpu/gemm_int8_act.py) against their float64 references,
for every supported GGML type and odd shapes, and their batch invariance."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from imp.formats.quants import dequantize
from imp.kernels.cpu import gemm_int8_act as qd

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]
QUANTIZABLE = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}  # gguf.quants writes these
SCALE_FIELDS = {T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}  # f16 fields of random k-quant blocks


def random_matrix(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """[rows, row_bytes] uint8 GGUF blocks: real quantization where gguf can, else random
    bytes with sane f16 scales (every bit pattern of the quants is then exercised)."""
    if qtype in QUANTIZABLE:
        return gq.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for off in SCALE_FIELDS[qtype]:
        b[:, off:off + 2] = rng.uniform(-0.05, 0.05, len(b)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,cols,n", [(1, 256, 1), (7, 512, 3), (33, 768, 5), (130, 256, 64)])
def test_gemm_matches_float64_reference(qtype, rows, cols, n):
    rng = np.random.default_rng(rows * 100 + int(qtype))
    w = random_matrix(qtype, rows, cols, rng)
    x = (rng.standard_normal((n, cols)) * rng.uniform(0.1, 3.0, (n, 1))).astype(np.float32)
    x[:, :32] = 0.0  # an all-zero activation block: scale 0, no NaN
    got = qd.gemm(w, int(qtype), x)
    ref = qd.reference_gemm(dequantize(w, qtype, (rows, cols)), x)
    assert got.shape == (n, rows) and got.dtype == np.float32
    err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6)
    assert err < 2e-6, err
    # the activation rounding itself stays small against fp32 activations
    exact = x.astype(np.float64) @ dequantize(w, qtype, (rows, cols)).astype(np.float64).T
    assert np.abs(got - exact).max() / max(np.abs(exact).max(), 1e-6) < 0.05


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gemm_rows_are_batch_invariant(qtype):
    rng = np.random.default_rng(int(qtype))
    w = random_matrix(qtype, 45, 512, rng)
    x = rng.standard_normal((29, 512)).astype(np.float32)  # tiles of 16, 8, 4 and one
    together = qd.gemm(w, int(qtype), x)
    for i in (0, 5, 13, 16, 28):
        alone = qd.gemm(w, int(qtype), x[i:i + 1])
        np.testing.assert_array_equal(alone[0], together[i])
    # 4 + 2, 8 + 3, 16 + 1, and small decode batches of 2 and 3 (their tokens in one call, the matrix read once)
    for a, b in ((3, 9), (2, 13), (1, 18), (0, 2), (4, 7), (20, 27)):
        np.testing.assert_array_equal(qd.gemm(w, int(qtype), x[a:b]), together[a:b])


def test_q8_0_vnni_route_where_amx_would_take_it():
    """`gemm` takes Q8_0 to AMX tiles where it can (tests/test_cpu_amx.py); the layers' Q8_0
    matrices stay on the VNNI loop, checked here on every machine."""
    rng = np.random.default_rng(8)
    w = random_matrix(T.Q8_0, 45, 512, rng)
    x = rng.standard_normal((29, 512)).astype(np.float32)
    together = qd.gemm(w, int(T.Q8_0), x, amx=False)
    ref = qd.reference_gemm(dequantize(w, T.Q8_0, (45, 512)), x)
    assert np.abs(together - ref).max() / np.abs(ref).max() < 2e-6
    for a, b in ((5, 6), (0, 2), (3, 9), (2, 13), (1, 18)):
        np.testing.assert_array_equal(qd.gemm(w, int(T.Q8_0), x[a:b], amx=False), together[a:b])


def test_quantize_rows_matches_q8_1():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    x[1, 32:64] = 0.0
    xq, xd, xs = qd.quantize(x)
    blocks = x.reshape(3, 3, 32)
    d = np.abs(blocks).max(-1) / 127
    np.testing.assert_allclose(xd, d, rtol=1e-6)
    assert np.abs(xq).max() <= 127 and (xq[1, 32:64] == 0).all() and xd[1, 1] == 0
    np.testing.assert_allclose(xq.reshape(3, 3, 32) * d[..., None], blocks, atol=d.max() / 2 + 1e-7)
    np.testing.assert_allclose(xs, xd * xq.reshape(3, 3, 32).sum(-1), rtol=1e-6)


def test_gemm_rejects_bad_shapes():
    w = np.zeros((4, 20 * 8), np.uint8)  # Q4_1, K = 256
    with pytest.raises(AssertionError):
        qd.gemm(w, int(T.Q4_1), np.zeros((1, 512), np.float32))
    with pytest.raises(AssertionError):
        qd.gemm(w, int(T.Q4_1), np.zeros((1, 256), np.float64))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("cols", [32, 96, 160])
def test_odd_block_counts(qtype, cols):
    """Rows of an odd number of 32-blocks: the paired loop's last block runs on its own, in the
    row loops (6 tokens) and in the predecoded scratch's last slot (21 tokens: a prefill's batch)."""
    rng = np.random.default_rng(cols + int(qtype))
    w = random_matrix(qtype, 9, cols, rng)
    x = rng.standard_normal((21, cols)).astype(np.float32)
    ref = qd.reference_gemm(dequantize(w, qtype, (9, cols)), x)
    for n in (6, 21):
        got = qd.gemm(w, int(qtype), x[:n])
        assert np.abs(got - ref[:n]).max() / np.abs(ref[:n]).max() < 2e-6
        np.testing.assert_array_equal(qd.gemm(w, int(qtype), x[5:6])[0], got[5])
        np.testing.assert_array_equal(qd.gemm(w, int(qtype), x[n - 1:n])[0], got[n - 1])


# ---------------------------------------------------------------- attention (paged_attention.py)


def _attn_case(N, H, Hkv, D, starts, kv_dtype, seed):
    """Rows of len(starts) sequences (sequence i: positions starts[i] .. , N // len rows each)
    over a shuffled paged cache; returns the kernel's arguments and each row's key slots."""
    from imp.kernels.cpu import paged_attention  # noqa: F401

    rng = np.random.default_rng(seed)
    bs, nblocks, L = 16, 96, 2
    per = N // len(starts)
    W = (H + 2 * Hkv) * D
    qkv = rng.standard_normal((N, W)).astype(np.float32)
    kc = rng.standard_normal(L * nblocks * bs * Hkv * D).astype(np.float16)
    vc = rng.standard_normal(L * nblocks * bs * Hkv * D).astype(np.float16)
    if kv_dtype == "f16":
        kc, vc = kc.view(np.uint16), vc.view(np.uint16)
    else:
        kc, vc = kc.astype(np.float32), vc.astype(np.float32)
    perm = rng.permutation(nblocks).astype(np.int64)
    tabs, row_tab, pos, off = [], [], [], 0
    for i, s in enumerate(starts):
        nb = (s + per + bs - 1) // bs
        tabs.append(perm[off:off + nb])
        row_tab += [sum(len(t) for t in tabs[:-1])] * per
        pos += list(range(s, s + per))
        off += nb
    return qkv, kc, vc, nblocks, bs, np.array(pos, np.int64), np.concatenate(tabs), np.array(row_tab, np.int64)


def _attn_reference(qkv, H, Hkv, D, l, kc, vc, nblocks, bs, pos, tables, row_tab, window, scale):
    def f64(c):
        return (c.view(np.float16) if c.dtype == np.uint16 else c).astype(np.float64).reshape(-1, nblocks * bs, Hkv, D)[l]

    kf, vf = f64(kc), f64(vc)
    out = np.zeros((qkv.shape[0], H * D))
    for n, p in enumerate(pos):
        lo = max(0, p - window + 1) if window else 0
        slots = np.array([tables[row_tab[n] + t // bs] * bs + t % bs for t in range(lo, p + 1)])
        for h in range(H):
            g = h // (H // Hkv)
            s = kf[slots, g] @ qkv[n, h * D:(h + 1) * D].astype(np.float64) * scale
            w = np.exp(s - s.max())
            out[n, h * D:(h + 1) * D] = (w / w.sum()) @ vf[slots, g]
    return out


# attention shapes whose bits tests/test_cpu_tiers.py compares between the AVX2 and the host tier
ATTN_TIER_CASES = [(40, 4, 1, 256, [0], 0), (36, 9, 3, 64, [5, 40], 0), (18, 10, 2, 32, [0, 1], 0),
                   (20, 6, 1, 80, [3, 17], 7)]


@pytest.mark.parametrize("kv_dtype", ["f16", "f32"])
@pytest.mark.parametrize("N,H,Hkv,D,starts,window", [
    (64, 4, 1, 256, [0], 0),          # Gemma 3's shape, a prefill (head-group items)
    (1, 4, 1, 256, [300], 0),         # its decode (one head an item)
    (36, 9, 3, 64, [5, 40], 0),       # SmolLM2's groups of 3, two sequences
    (20, 6, 1, 80, [3, 17], 7),       # D not a multiple of 64, a sliding window
    (18, 10, 2, 32, [0, 1], 0),       # groups of 5: an item of 4 heads and one of 1
])
def test_attention_matches_float64_reference(N, H, Hkv, D, starts, window, kv_dtype):
    from imp.kernels.cpu import paged_attention

    args = _attn_case(N, H, Hkv, D, starts, kv_dtype, N + H + D)
    qkv, kc, vc, nblocks, bs, pos, tables, row_tab = args
    scale = np.float32(D ** -0.5)
    out = np.empty((N, H * D), np.float32)
    paged_attention.attention(qkv, H, Hkv, D, 1, kc, vc, nblocks, bs, pos, tables, row_tab, window, scale, out)
    ref = _attn_reference(qkv, H, Hkv, D, 1, kc, vc, nblocks, bs, pos, tables, row_tab, window, float(scale))
    assert np.abs(out - ref).max() / np.abs(ref).max() < 2e-6
    # batch invariance: each row alone (one-head items) gives the step's bits (head-group items)
    for n in (0, N // 2, N - 1):
        alone = np.empty((1, H * D), np.float32)
        paged_attention.attention(qkv[n:n + 1].copy(), H, Hkv, D, 1, kc, vc, nblocks, bs, pos[n:n + 1].copy(),
                           tables, row_tab[n:n + 1].copy(), window, scale, alone)
        np.testing.assert_array_equal(alone[0], out[n])


# ---------------------------------------------------------------- exp (float_lanes.exp_span)


def test_exp_span_is_within_one_ulp_and_keeps_specials_and_tails():
    from imp.kernels.cpu.float_lanes import exp_span

    x = np.concatenate([np.linspace(-87, 88, 100_003, dtype=np.float32),
                        np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, -90.0, 89.0], np.float32)])
    y = x.copy()
    exp_span(y, 0, y.size)
    ref = np.exp(x[:-7].astype(np.float64))
    ulp = np.abs(y[:-7] - ref) / np.spacing(ref.astype(np.float32))
    assert ulp.max() <= 1.0, ulp.max()
    assert np.isnan(y[-7]) and y[-6] == np.inf and y[-5] == 0.0 and y[-4] == 1.0 and y[-3] == 1.0
    assert y[-2] == 0.0 and y[-1] == np.inf
    # a span's tail (< 16 lanes) and any offset: the same bits as the element gets anywhere
    for off, n in ((3, 37), (0, 5), (17, 16)):
        z = x.copy()
        exp_span(z, off, n)
        np.testing.assert_array_equal(z[off:off + n], y[off:off + n])
        np.testing.assert_array_equal(z[:off], x[:off])
        np.testing.assert_array_equal(z[off + n:], x[off + n:])
