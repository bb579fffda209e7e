"""Q8_0 on AMX tiles (imp/kernels/cpu/gemm_q8_0_amx.py), where the CPU has amx-int8 and the kernel grants
tile data: against the float64 reference, batch-invariant over every token-tile width (1, 2, 4,
8, 16 and padded tiles), partial 16-row panels and block counts that leave the 4-block groups a
remainder; and `gemm`'s routing (AMX by default there, the VNNI loop on request)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gq

from imp.formats.quants import dequantize
from imp.kernels.cpu import gemm_q8_0_amx
from imp.kernels.cpu import gemm_int8_act as qd

pytestmark = pytest.mark.skipif(not gemm_q8_0_amx.AMX, reason="no AMX int8 (or no tile-data permission) here")


def _matrix(rows, cols, seed):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * rng.uniform(0.01, 2.0, (rows, 1)).astype(np.float32)
    return gq.quantize(w, T.Q8_0)


@pytest.mark.parametrize("rows,cols,n", [(1, 32, 1), (16, 64, 2), (37, 96, 3), (50, 160, 8),
                                         (129, 576, 17), (64, 640, 64), (300, 128, 5)])
def test_amx_matches_float64_reference(rows, cols, n):
    w = _matrix(rows, cols, rows + cols)
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((n, cols)) * rng.uniform(0.1, 3.0, (n, 1))).astype(np.float32)
    x[:, :32] = 0.0  # an all-zero activation block: scale 0
    got = qd.gemm(w, int(T.Q8_0), x, amx=True)
    ref = qd.reference_gemm(dequantize(w, T.Q8_0, (rows, cols)), x)
    assert got.shape == (n, rows) and got.dtype == np.float32
    assert np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6) < 2e-6
    vnni = qd.gemm(w, int(T.Q8_0), x, amx=False)  # the other route: the same sums, other rounding
    assert np.abs(got - vnni).max() / max(np.abs(ref).max(), 1e-6) < 2e-6


def test_amx_rows_are_batch_invariant():
    w = _matrix(45, 576, 1)  # 3 panels (the last of 13 rows), 18 blocks: 4 groups and 2 left
    x = np.random.default_rng(2).standard_normal((40, 576)).astype(np.float32)
    together = qd.gemm(w, int(T.Q8_0), x, amx=True)  # tiles of 16, 16, 8 (padded)
    for i in (0, 1, 7, 15, 16, 31, 39):
        np.testing.assert_array_equal(qd.gemm(w, int(T.Q8_0), x[i:i + 1], amx=True)[0], together[i])
    for a, b in ((0, 2), (3, 6), (4, 8), (9, 14), (1, 17), (20, 40), (5, 38)):  # tiles of 2, 4, 8, 16
        np.testing.assert_array_equal(qd.gemm(w, int(T.Q8_0), x[a:b], amx=True), together[a:b])
    # and the rows beside: a matrix of the first 16 rows gives those rows' bits
    np.testing.assert_array_equal(qd.gemm(np.ascontiguousarray(w[:16]), int(T.Q8_0), x, amx=True), together[:, :16])


def test_gemm_routes_q8_0_to_amx_by_default():
    w = _matrix(33, 256, 3)
    x = np.random.default_rng(4).standard_normal((3, 256)).astype(np.float32)
    np.testing.assert_array_equal(qd.gemm(w, int(T.Q8_0), x), qd.gemm(w, int(T.Q8_0), x, amx=True))
    assert not np.array_equal(qd.gemm(w, int(T.Q8_0), x, amx=False), qd.gemm(w, int(T.Q8_0), x, amx=True))
