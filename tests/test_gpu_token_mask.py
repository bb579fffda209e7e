"""The token-mask CUDA kernel (imp/kernels/cuda/token_mask.py) against its torch reference and the
CPU path of imp.constrain.apply_mask. Marked `gpu`; skips cleanly without CUDA or CuPy.

Inputs are fresh random logits and random bitmasks (never all-ones or all-zeros, which
would hide a wrong bit order), vocabularies that are and are not multiples of 32, rows
maps with skipped entries, strided logits, and one capture into a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from imp.kernels.cuda import token_mask

DEV = "cuda"


def _skip_without_gpu():
    from imp.kernels.cuda import runtime

    if not runtime.available():
        pytest.skip("needs CUDA and CuPy")


def _inputs(R: int, V: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, V, generator=g)
    words = (V + 31) // 32
    bm = torch.randint(-2**31, 2**31 - 1, (k, words), dtype=torch.int32, generator=g)
    bm[0, 0] = 0x0000FFFF  # a word with a known half-and-half pattern: catches a reversed bit order
    return logits, bm


@pytest.mark.gpu
@pytest.mark.parametrize("V", [32, 77, 1000, 49152, 151_936, 262_144])
@pytest.mark.parametrize("R", [1, 3, 32])
def test_token_mask_all_rows(R, V):
    _skip_without_gpu()
    logits, bm = _inputs(R, V, R, R * 7 + V)
    want = token_mask.reference(logits, bm)
    got = logits.to(DEV)
    token_mask.apply_token_mask(got, bm.to(DEV))
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got[0, :32].isinf().cpu(), torch.arange(32) >= 16)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [77, 49152])
def test_token_mask_rows_map_skips_and_neighbours(V):
    _skip_without_gpu()
    R, k = 9, 4
    logits, bm = _inputs(R, V, k, V)
    rows = torch.tensor([7, -1, 2, 100], dtype=torch.int32)  # -1: skipped; 100 >= R: ignored, not written
    want = token_mask.reference(logits, bm, rows)
    got = logits.to(DEV)
    token_mask.apply_token_mask(got, bm.to(DEV), rows.to(DEV))
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want)
    for r in (0, 1, 3, 4, 5, 6, 8):  # unconstrained neighbours untouched
        assert torch.equal(got[r].cpu(), logits[r])


@pytest.mark.gpu
def test_token_mask_strided_logits_and_wide_bitmask():
    """Logits as a column slice of a wider buffer (row stride > V), a bitmask with spare words."""
    _skip_without_gpu()
    R, V, pad = 5, 1000, 24
    big = torch.randn(R, V + pad, device=DEV)
    logits = big[:, :V]
    _, bm = _inputs(R, V, R, 3)
    bm = torch.cat([bm, torch.zeros(R, 2, dtype=torch.int32)], dim=1)  # extra words: ignored
    want = token_mask.reference(logits.cpu(), bm)
    tail = big[:, V:].clone()
    token_mask.apply_token_mask(logits, bm.to(DEV))
    torch.cuda.synchronize()
    assert torch.equal(logits.cpu(), want)
    assert torch.equal(big[:, V:], tail)  # nothing written past V


@pytest.mark.gpu
def test_token_mask_matches_the_cpu_path_and_softmax_zero():
    _skip_without_gpu()
    from imp.constrain import apply_mask

    R, V = 6, 49152
    logits, bm = _inputs(R, V, 3, 11)
    rows = [4, 0, 5]
    cpu = logits.clone()
    apply_mask(cpu, bm, rows)
    gpu = logits.to(DEV)
    apply_mask(gpu, bm, rows)  # CPU bitmask and list rows: copied over by apply_mask
    torch.cuda.synchronize()
    assert torch.equal(gpu.cpu(), cpu)
    p = torch.softmax(gpu, dim=-1)
    assert torch.all(p[gpu.isinf()] == 0)


@pytest.mark.gpu
def test_token_mask_in_a_cuda_graph():
    """Captured once over fixed buffers, replayed with new bitmask contents and rows."""
    _skip_without_gpu()
    R, V = 8, 49152
    words = (V + 31) // 32
    logits = torch.zeros(R, V, device=DEV)
    bm = torch.zeros(R, words, dtype=torch.int32, device=DEV)
    rows = torch.full((R,), -1, dtype=torch.int32, device=DEV)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compile + first launch) outside the capture
        token_mask.apply_token_mask(logits, bm, rows)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token_mask.apply_token_mask(logits, bm, rows)
    for seed in range(3):
        src, host_bm = _inputs(R, V, R, 100 + seed)
        host_rows = torch.tensor([r if r % (seed + 2) else -1 for r in range(R)], dtype=torch.int32)
        logits.copy_(src)
        bm.copy_(host_bm)
        rows.copy_(host_rows)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(logits.cpu(), token_mask.reference(src, host_bm, host_rows))


@pytest.mark.gpu
def test_token_mask_checks_its_arguments():
    _skip_without_gpu()
    logits = torch.zeros(2, 64, device=DEV)
    with pytest.raises(ValueError):
        token_mask.apply_token_mask(logits, torch.zeros(2, 1, dtype=torch.int32, device=DEV))  # too few words
    with pytest.raises(ValueError):
        token_mask.apply_token_mask(logits, torch.zeros(2, 2, dtype=torch.int64, device=DEV))  # dtype
    with pytest.raises(ValueError):
        token_mask.apply_token_mask(logits, torch.zeros(3, 2, dtype=torch.int32, device=DEV))  # rows != R
    with pytest.raises(ValueError):
        token_mask.apply_token_mask(logits, torch.zeros(2, 2, dtype=torch.int32))  # CPU bitmask
    with pytest.raises(ValueError):
        token_mask.apply_token_mask(logits.half(), torch.zeros(2, 2, dtype=torch.int32, device=DEV))
