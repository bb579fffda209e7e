"""The long-context decode attention (`imp.kernels.cuda.paged_decode_split`: a CTA per KV head and its G query heads,
keys split over S CTAs and merged) against the float64 reference and against `paged_decode`, the kernel it would
replace: every group size the models here have (1, 3, 4, 8), head dims 64 / 128 / 256, fp32 and bf16 caches, zero
and one-token contexts beside long ones, split counts from 1 to more rounds than a context has. Outputs poisoned with
NaN first. GPU tests are marked and skip without CUDA and CuPy; the split count's rule runs everywhere."""

from __future__ import annotations

import pytest
import torch

from imp.kernels.cuda import paged_decode_split as ps
from tests.test_gpu_kernels import DEV, _poison, _rel, _skip_without_gpu


def test_the_split_count_fills_the_sms_twice_and_never_splits_past_the_context():
    assert ps.splits(1, 8, 132, 32768) == 32  # 8 CTAs a stream: 33 wanted, 32 at most
    assert ps.splits(16, 8, 132, 32768) == 3  # 128 CTAs: 3 fill 264
    assert ps.splits(64, 8, 132, 32768) == 1
    assert ps.splits(1, 8, 132, 256) == 4  # 4 rounds of 64 keys in the longest context
    assert ps.splits(1, 1, 132, 100) == 1
    assert ps.round_keys(128, 4) == 8 * 2 * 2 and ps.round_keys(64, 1) == 8 * 4 * 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,Hkv,D,bs,lens,S", [
    (1, 9, 3, 64, 16, [1], 1),
    (3, 9, 3, 64, 16, [17, 300, 64], 4),
    (5, 32, 8, 128, 16, [130, 1, 513, 0, 1000], 3),
    (2, 8, 8, 128, 32, [2000, 33], 7),
    (1, 32, 8, 128, 16, [9000], 32),  # the 8B's shape at a long context, one stream
    (2, 4, 1, 256, 16, [4100, 5], 16),  # Gemma 3's: one KV head, D 256
    (2, 64, 8, 128, 16, [3000, 700], 5),  # G = 8
    (4, 9, 3, 64, 16, [0, 0, 2, 40], 64),  # more splits than rounds: empty partials
])
def test_split_decode_is_the_reference_and_paged_decode(dtype, B, H, Hkv, D, bs, lens, S):
    _skip_without_gpu()
    from imp.kernels.cuda import paged_decode_attention as pa
    from imp.kernels.cuda import quantize_act_int8

    torch.manual_seed(B * 1000 + H + S)
    nblocks = max(200, sum(-(-L // bs) for L in lens) + 8)
    kc = torch.randn(nblocks, bs, Hkv, D, device=DEV).to(dtype)
    vc = torch.randn(nblocks, bs, Hkv, D, device=DEV).to(dtype)
    maxb = max((L + bs - 1) // bs for L in lens) + 2
    bt = torch.stack([torch.randperm(nblocks, device=DEV)[:maxb] for _ in range(B)]).to(torch.int32)
    ln = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(B, (H + 2 * Hkv) * D, device=DEV) * 2  # a fused qkv row: q is its first H*D
    out = _poison(B, H * D)
    ps.paged_decode_split(q, kc, vc, bt, ln, H, n_splits=S, out=out)
    ref = pa.reference(q, kc, vc, bt, ln, H)
    for i, L in enumerate(lens):
        if L == 0:
            assert (out[i] == 0).all()
    assert _rel(out, ref) < 1e-5
    assert _rel(out, pa.paged_decode(q, kc, vc, bt, ln, H)) < 1e-5
    # the int8 output for an int8 O projection: this kernel's output quantized by the one rule
    xa, want = ps.paged_decode_split(q, kc, vc, bt, ln, H, n_splits=S, q8=True), quantize_act_int8.quantize(out)
    assert torch.equal(xa.xq, want.xq) and torch.equal(xa.xds, want.xds)
    # reused work buffers (a graph's), larger than needed
    work = (torch.full((B * H * S + 7, 2), float("nan"), device=DEV), torch.full((B * H * S + 7, D), float("nan"),
                                                                                   device=DEV))
    out2 = _poison(B, H * D)
    ps.paged_decode_split(q, kc, vc, bt, ln, H, n_splits=S, out=out2, work=work)
    assert torch.equal(out, out2)


@pytest.mark.gpu
def test_split_decode_is_captured_by_a_graph_and_serves_any_context_length():
    """One capture at S = 8, replayed at lengths from 0 to 6,000: the graph holds the grid, the lengths are data."""
    _skip_without_gpu()
    from imp.kernels.cuda import paged_decode_attention as pa

    B, H, Hkv, D, bs = 2, 32, 8, 128, 16
    kc = torch.randn(500, bs, Hkv, D, device=DEV).to(torch.bfloat16)
    vc = torch.randn(500, bs, Hkv, D, device=DEV).to(torch.bfloat16)
    bt = torch.stack([torch.randperm(500, device=DEV)[:400] for _ in range(B)]).to(torch.int32)
    ln = torch.zeros(B, dtype=torch.int32, device=DEV)
    q = torch.randn(B, H * D, device=DEV)
    out = torch.empty(B, H * D, device=DEV)
    work = (torch.empty(B * H * 8, 2, device=DEV), torch.empty(B * H * 8, D, device=DEV))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ps.paged_decode_split(q, kc, vc, bt, ln, H, n_splits=8, out=out, work=work)  # compile before capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ps.paged_decode_split(q, kc, vc, bt, ln, H, n_splits=8, out=out, work=work)
    for lens in ([0, 1], [6000, 17], [513, 4096]):
        ln.copy_(torch.tensor(lens, dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        assert _rel(out, pa.reference(q, kc, vc, bt, ln, H)) < 1e-5 if max(lens) else (out == 0).all()
