"""The repacked Q8_0 output head (imp/kernels/cpu/head_q8.py): the bits of gemm_int8_act's VNNI /
AVX2 loop on the file's blocks, for every batch size and row count, odd block counts included;
and a model whose head is Q8_0 serves it from the packed copy (the AVX2 tier's bits:
tests/test_cpu_tiers.py)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from imp.formats.quants import dequantize
from imp.kernels.cpu import gemm_int8_act as qd
from imp.kernels.cpu import head_q8
from tests.test_cpu_kernels import random_matrix

pytestmark = pytest.mark.skipif(not head_q8.DP4, reason="the packed head runs on the VNNI and AVX2 tiers only")


@pytest.mark.parametrize("rows,cols", [(37, 768), (45, 96), (8, 576), (130, 640)])
def test_packed_head_gives_the_file_loops_bits(rows, cols):
    rng = np.random.default_rng(rows + cols)
    w = random_matrix(T.Q8_0, rows, cols, rng)
    p = head_q8.PackedQ8(w)
    x = (rng.standard_normal((37, cols)) * 2).astype(np.float32)
    want = qd.gemm(w, int(T.Q8_0), x, amx=False)
    for a, b in [(0, 37), (0, 1), (5, 7), (2, 5), (9, 13), (1, 9), (3, 19), (0, 16), (4, 33)]:
        got = head_q8.gemm(p, x[a:b])  # tiles of 16 and 8, then 4 rows x 1-4 tokens, leftover rows alone
        np.testing.assert_array_equal(got.view(np.uint32), want[a:b].view(np.uint32), err_msg=f"tokens {a}:{b}")
    ref = qd.reference_gemm(dequantize(w, T.Q8_0, (rows, cols)), x)
    assert np.abs(want - ref).max() / np.abs(ref).max() < 2e-6


def test_packed_layout():
    rng = np.random.default_rng(1)
    w = random_matrix(T.Q8_0, 5, 640, rng)
    p = head_q8.PackedQ8(w)
    assert (p.R, p.K) == (5, 640) and p.wq.ctypes.data % 64 == 0
    blocks = w.reshape(5, 20, 34)
    # VNNI: q + 128 as bytes (vpdpbusd takes unsigned weights); AVX2: q as it is (|q| and q's signs)
    want = blocks[:, :, 2:] ^ 0x80 if head_q8.VNNI else blocks[:, :, 2:]
    np.testing.assert_array_equal(p.wq.reshape(5, 20, 32), want)
    np.testing.assert_array_equal(p.wd.view(np.float16).reshape(5, 20), blocks[:, :, :2].copy().view(np.float16)[..., 0])
    assert p.nbytes == w.nbytes


def test_corrections_are_the_offsets_share():
    xq = np.random.default_rng(2).integers(-127, 128, size=(3, 64), dtype=np.int8)
    cx = np.empty((3, 16), np.int32)
    head_q8.corrections(xq, cx)
    np.testing.assert_array_equal(cx, -128 * xq.astype(np.int32).reshape(3, 16, 4).sum(-1))


def test_smollm2_serves_its_head_packed(smollm2_path):
    """The real SmolLM2 file (Q8_0 tied head, 49,152 x 576): the fused model holds the packed copy
    and its logits, one token or several, are the file loop's bits."""
    from imp.kernels.cpu import gemm_q8_0_amx
    from imp.model.runner import ModelRunner

    if gemm_q8_0_amx.AMX:
        pytest.skip("AMX tiles take Q8_0 heads on this machine")
    model = ModelRunner.load(str(smollm2_path), kv_tokens=64).model
    assert model.packed_head is not None and (model.packed_head.R, model.packed_head.K) == (49152, 576)
    h = np.random.default_rng(3).standard_normal((3, 576)).astype(np.float32)
    w, qt = model.head
    want = qd.gemm(w, qt, h, amx=False)
    np.testing.assert_array_equal(model.head_logits(h), want)
    np.testing.assert_array_equal(model.head_logits(h[1:2]), want[1:2])
