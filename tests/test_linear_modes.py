"""How `imp.gpu.linear.Linear` picks a kernel per row count, on the CPU (timings faked): the choices that
decide batch invariance. The kernels themselves are checked in the GPU lane (test_gpu_q8, test_gpu_qmm)."""

from __future__ import annotations

import pytest
import torch

from imp.gpu import linear as L
from imp.kernels.cuda import gemv_int8_act
from imp.kernels.cuda.quant_weight import QWeight


def _lin(fmt="Q4_1", dense=False, invariant=False, times=None) -> L.Linear:
    w = QWeight(fmt, 64, 256, {"qs": torch.zeros(1)})
    lin = L.Linear([w], torch.zeros(64, 256) if dense else None, {}, int8_act=True, invariant=invariant)
    times = times or {}
    lin.time_us = lambda name, x, peers, reps=12: times.get((x.shape[0], name), 100.0)  # noqa: ARG005
    return lin


def test_decode_counts_keep_the_one_row_choices_k_split():
    """The int8 GEMV's bits depend on its K split only: once one row picked a split, every other decode
    count up to GEMV_MAX_ROWS picks among the variants with that split, however the others time."""
    times = {(1, "q8s2"): 5.0, (4, "q8r4"): 1.0, (4, "q8s4"): 3.0, (8, "q8r1"): 1.0, (8, "q8s1"): 4.0}
    lin = _lin(times=times)
    assert lin.choose(1) == "q8s2"
    assert lin.choose(4) == "q8s4" and lin.choose(8) == "q8s1"
    assert {gemv_int8_act.VARIANTS[lin.mode(n)][1] for n in (1, 2, 3, 4, 5, 8)} == {gemv_int8_act.WARPS}
    lin2 = _lin(times={(1, "q8r1"): 1.0, (2, "q8s1"): 0.5})
    assert lin2.choose(1) == "q8r1" and lin2.choose(2) in ("q8r1", "q8r2", "q8r4")


def test_default_rows_past_the_gemv_and_prompt_rows():
    dense = _lin(dense=True)
    assert dense.mode(3, prompt=True) == "dense" and dense.mode(9) == "dense"
    assert _lin().mode(3, prompt=True) == "qmm" and _lin().mode(300) == "qmm"


def test_batch_invariant_puts_every_row_on_the_gemm():
    lin = _lin(invariant=True)
    assert {lin.mode(n, p) for n in (1, 2, 8, 9, 64, 512) for p in (False, True)} == {"qmm"}
    assert lin.choose(1) == "qmm" and lin.candidates(4) == ["qmm"] and lin.takes_q8(1)


@pytest.mark.parametrize("fmt,dense", [("BF16", False), ("Q5_K", False), ("Q4_1", True)])
def test_batch_invariant_refuses_what_the_gemm_cannot_take(fmt, dense):
    with pytest.raises(ValueError, match="batch-invariant"):
        _lin(fmt=fmt, dense=dense, invariant=True)


def test_batch_invariant_flag():
    import argparse

    from imp.config import ServerConfig, add_serve_args, config_from_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert config_from_args(p.parse_args(["--batch-invariant"])).batch_invariant
    assert not config_from_args(p.parse_args([])).batch_invariant
    with pytest.raises(ValueError, match="--batch-invariant needs --gpu-activations int8"):
        ServerConfig(batch_invariant=True, gpu_activations="fp32")
