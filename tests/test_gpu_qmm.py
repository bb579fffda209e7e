"""The int8 tensor-core GEMM (`imp.kernels.cuda.gemm_int8_act`, not wired into the runner yet) against the float64
reference of the int8-activation product, every format, K not a multiple of 256 for the 32-blocks,
token counts across the 64-row tiles; and against the dp4a GEMV on the same activations. Marked `gpu`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from imp.kernels.cuda.quant_weight import repack
from tests.fixtures.synth_raw import random_blocks

pytestmark = pytest.mark.gpu

FMT_T = {"Q4_0": T.Q4_0, "Q4_1": T.Q4_1, "Q8_0": T.Q8_0, "Q4_K": T.Q4_K, "Q6_K": T.Q6_K}
BE = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256}


def _gpu_ok() -> bool:
    from imp.kernels.cuda import runtime

    return runtime.available()


if not _gpu_ok():
    pytest.skip("needs CUDA and CuPy", allow_module_level=True)


@pytest.mark.parametrize("fmt", list(FMT_T))
@pytest.mark.parametrize("rows,cols", [(64, 256), (203, 576), (130, 1536)])
@pytest.mark.parametrize("M", [1, 9, 64, 100, 300])
def test_qmm_matches_reference_and_the_gemv(fmt, rows, cols, M):
    from imp.kernels.cuda import gemm_int8_act, gemv_int8_act, quantize_act_int8

    if cols % BE[fmt]:
        pytest.skip("K-quants need K a multiple of 256")
    rng = np.random.default_rng(rows + cols + M)
    w = repack(random_blocks(FMT_T[fmt], rows * cols // BE[fmt], cols ** -0.5, rng), fmt, rows, cols)
    x = torch.randn(M, cols, generator=torch.Generator().manual_seed(M)) * 2
    ref = gemv_int8_act.reference(w, x)
    wd, xa = w.to("cuda"), quantize_act_int8.quantize(x.to("cuda"))
    big = torch.full((M, rows + 24), float("nan"), device="cuda")
    out = gemm_int8_act.qmm(wd, xa, big[:, 8:8 + rows])
    assert not torch.isnan(out).any()
    rel = float((out.double().cpu() - ref).norm() / ref.norm())
    assert rel < 1e-5, rel
    assert torch.isnan(big[:, :8]).all() and torch.isnan(big[:, 8 + rows:]).all()
    gv = gemv_int8_act.gemv(wd, xa, rows=1)
    assert float((out - gv).double().norm() / gv.double().norm()) < 1e-5


@pytest.mark.parametrize("fmt", list(FMT_T))
@pytest.mark.parametrize("M", [1, 9, 64, 100, 300])
def test_every_tile_is_correct_writes_its_slice_and_gives_the_same_bits(fmt, M):
    """The launcher picks a tile by shape (`gemm_int8_act.pick_tile`): every tile must pass the reference and the
    slice-only write, and all must give identical bits (so the pick never changes a token)."""
    from imp.kernels.cuda import gemm_int8_act, gemv_int8_act, quantize_act_int8

    for rows, cols in [(203, 576), (130, 1536), (64, 256)]:
        if cols % BE[fmt]:
            continue
        rng = np.random.default_rng(rows + cols)
        w = repack(random_blocks(FMT_T[fmt], rows * cols // BE[fmt], cols ** -0.5, rng), fmt, rows, cols)
        x = torch.randn(M, cols, generator=torch.Generator().manual_seed(M)) * 2
        ref = gemv_int8_act.reference(w, x)
        wd, xa = w.to("cuda"), quantize_act_int8.quantize(x.to("cuda"))
        outs = []
        for t in gemm_int8_act.TILES:
            big = torch.full((M, rows + 24), float("nan"), device="cuda")
            o = gemm_int8_act.qmm(wd, xa, big[:, 8:8 + rows], tile=t)
            rel = float((o.double().cpu() - ref).norm() / ref.norm())
            assert rel < 1e-5, (rows, cols, t, rel)
            assert torch.isnan(big[:, :8]).all() and torch.isnan(big[:, 8 + rows:]).all(), (rows, cols, t)
            outs.append(o.clone())
        assert all(torch.equal(outs[0], o) for o in outs[1:]), (rows, cols)
