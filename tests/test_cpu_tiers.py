"""Every x86 tier's CPU kernels (issue 32): the AVX2 tier (vpmaddubsw + vpmaddwd) is checked
against the float64 references on its own codegen, and gives the same bits as the VNNI tier
(both sum 4 products a lane, exactly): a model answers the same on an AVX2-only EPYC as on an
AVX-512 Xeon (and matches the float64 reference). Any x86 box with AVX2 can compile for the AVX2 tier (NUMBA_CPU_NAME=haswell with
NUMBA_CPU_FEATURES="": that CPU's own features, no AVX-512), so both run here in subprocesses.

Marked slow: each tier compiles the GEMM kernels for every type in a subprocess (~25 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gguf import GGMLQuantizationType as T

from imp.formats.quants import dequantize
from imp.kernels.cpu import gemm_int8_act as qd
from tests.serverproc import ROOT
from tests.test_cpu_kernels import ATTN_TIER_CASES, random_matrix

pytestmark = pytest.mark.slow

TIERS = {"host": {}, "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}}

_CHILD = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {root!r})
    from gguf import GGMLQuantizationType as T
    from imp.kernels.cpu import gemm_int8_act as qd, row_dot_loop
    from tests.test_cpu_kernels import TYPES, random_matrix
    out = {{"dot": np.array(row_dot_loop.DOT)}}
    for qt in TYPES:
        rng = np.random.default_rng(int(qt))
        w = random_matrix(qt, 37, 768, rng)
        x = (rng.standard_normal((19, 768)) * 2).astype(np.float32)
        out[qt.name] = qd.gemm(w, int(qt), x, amx=False)   # tiles of 16 + 2 + 1 rows
        out[qt.name + "_1"] = qd.gemm(w, int(qt), x[3:4], amx=False)
        if qt == T.Q8_0 and row_dot_loop.DP4:  # the repacked head's loop (imp/kernels/cpu/head_q8.py)
            from imp.kernels.cpu import head_q8
            p = head_q8.PackedQ8(w)
            out["packed"], out["packed_1"] = head_q8.gemm(p, x), head_q8.gemm(p, x[3:4])
            out["packed_2"] = head_q8.gemm(p, x[5:7])   # every tile width (AVX2: 1 row x 4, 3, 2, 1 tokens)
    from imp.kernels.cpu import paged_attention
    from tests.test_cpu_kernels import ATTN_TIER_CASES, _attn_case
    for i, (N, H, Hkv, D, starts, window) in enumerate(ATTN_TIER_CASES):
        qkv, kc, vc, nblocks, bs, pos, tables, row_tab = _attn_case(N, H, Hkv, D, starts, "f16", i)
        o = np.empty((N, H * D), np.float32)
        paged_attention.attention(qkv, H, Hkv, D, 1, kc, vc, nblocks, bs, pos, tables, row_tab, window,
                                  np.float32(D ** -0.5), o)
        o1 = np.empty((1, H * D), np.float32)   # the last row alone (one head an item)
        paged_attention.attention(qkv[-1:].copy(), H, Hkv, D, 1, kc, vc, nblocks, bs, pos[-1:].copy(), tables,
                                  row_tab[-1:].copy(), window, np.float32(D ** -0.5), o1)
        out[f"attn{{i}}"], out[f"attn{{i}}_1"] = o, o1
    np.savez({path!r}, **out)
""")


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx2" in f.read()
    except OSError:
        return False


def _host_is_avx2() -> bool:
    from imp.kernels.cpu import row_dot_loop

    return str(row_dot_loop.DOT) == "avx2"


def _run(*tiers: str, tmp_path) -> list[dict]:
    """Each tier's child, all at once: a child compiles on one core (Numba), and the test waited ~90 s for the two
    in turn on a 2-core box."""
    procs = []
    for tier in tiers:
        path = tmp_path / f"{tier}.npz"
        env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
        env.update(TIERS[tier])
        procs.append((path, subprocess.Popen([sys.executable, "-c", _CHILD.format(root=str(ROOT), path=str(path))],
                                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             text=True)))
    out = []
    for path, p in procs:
        _, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        out.append(dict(np.load(path)))
    return out


@pytest.mark.skipif(not _has_avx2(), reason="the AVX2 tier needs an x86 CPU with AVX2")
def test_avx2_tier_gives_the_vnni_tiers_bits(tmp_path):
    if _host_is_avx2():
        # no VNNI tier here to compare with, and the host's own tier is AVX2: tests/test_cpu_kernels.py (float64
        # references, batch invariance, attention) and tests/test_head_q8.py (the packed head's tile widths) run
        # on it already; the child would compile every type again for ~150 s on a 2-vCPU EPYC
        pytest.skip("the host's tier is AVX2: its kernels are the ones tests/test_cpu_kernels.py checks")
    host, avx2 = _run("host", "avx2", tmp_path=tmp_path)
    assert str(avx2.pop("dot")) == "avx2"
    host_dot = str(host.pop("dot"))
    for name, rows in (("packed", slice(None)), ("packed_1", slice(None)), ("packed_2", slice(5, 7))):
        # the packed Q8_0 head: the file loop's bits on the tier, whatever the batch
        file_loop = "Q8_0" + ("_1" if name == "packed_1" else "")
        np.testing.assert_array_equal(avx2.pop(name), avx2[file_loop][rows], err_msg=name)
        if name in host:
            np.testing.assert_array_equal(host.pop(name), host[file_loop][rows], err_msg=name)
    for i, case in enumerate(ATTN_TIER_CASES):  # attention: the same bits on both tiers, and batch invariant
        a, a1 = avx2.pop(f"attn{i}"), avx2.pop(f"attn{i}_1")
        np.testing.assert_array_equal(a1[0], a[-1], err_msg=f"attn{i} {case}: a row alone")
        np.testing.assert_array_equal(a, host.pop(f"attn{i}"), err_msg=f"attn{i} {case}")
        np.testing.assert_array_equal(a1, host.pop(f"attn{i}_1"), err_msg=f"attn{i}_1 {case}")
        # (the float64 reference for attention: tests/test_cpu_kernels.py, on the host's tier)
    for name, got in avx2.items():
        if host_dot in ("vnni", "avx2"):  # the same 4-product lanes: the same bits
            np.testing.assert_array_equal(got, host[name], err_msg=name)
        else:
            np.testing.assert_allclose(got, host[name], rtol=1e-5, atol=1e-5, err_msg=name)
        if not name.endswith("_1"):  # batch invariant on the tier itself, and the float64 reference
            np.testing.assert_array_equal(avx2[name + "_1"][0], got[3], err_msg=name)
            qt = getattr(T, name)
            rng = np.random.default_rng(int(qt))  # the child's inputs, drawn again
            w = random_matrix(qt, 37, 768, rng)
            x = (rng.standard_normal((19, 768)) * 2).astype(np.float32)
            ref = qd.reference_gemm(dequantize(w, qt, (37, 768)), x)
            assert np.abs(got - ref).max() / np.abs(ref).max() < 2e-6, name
