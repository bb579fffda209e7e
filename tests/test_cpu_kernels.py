"""CPU quantized kernels (imp/kernels/cpu_qdot.py) against their float64 references,
for every supported GGML type and odd shapes, and their batch invariance."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from imp.formats.quants import dequantize
from imp.kernels import cpu_qdot as qd

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
    x = rng.standard_normal((17, 512)).astype(np.float32)
    together = qd.gemm(w, int(qtype), x)
    for i in (0, 5, 13, 16):
        alone = qd.gemm(w, int(qtype), x[i:i + 1])
        np.testing.assert_array_equal(alone[0], together[i])
    np.testing.assert_array_equal(qd.gemm(w, int(qtype), x[3:9]), together[3:9])


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
    """Rows of an odd number of 32-blocks: the paired loop's last block runs on its own."""
    rng = np.random.default_rng(cols + int(qtype))
    w = random_matrix(qtype, 9, cols, rng)
    x = rng.standard_normal((6, cols)).astype(np.float32)
    got = qd.gemm(w, int(qtype), x)
    ref = qd.reference_gemm(dequantize(w, qtype, (9, cols)), x)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-6
    np.testing.assert_array_equal(qd.gemm(w, int(qtype), x[5:6])[0], got[5])
