"""The long-context decode attention (`imp.kernels.cuda.paged_decode_split`: a CTA per KV head and its G query heads,
a row's keys in segments dealt to S CTAs and merged in order) against the float64 reference and against
`paged_decode`, the kernel it would replace: every group size the models here have (1, 3, 4, 8), head dims
64 / 128 / 256, fp32 and bf16 caches, zero and one-token contexts beside long ones, split counts from 1 to more than a
row has segments; a row's bits the same alone, batched and at any S (batch invariance); one graph capture serving
every length. Outputs poisoned with NaN first. GPU tests are marked and skip without CUDA and CuPy; the rules for the
segment length and the split count run everywhere."""

from __future__ import annotations

import pytest
import torch

from imp.kernels.cuda import paged_decode_split as ps
from tests.test_gpu_kernels import DEV, _poison, _rel, _skip_without_gpu


def test_segments_and_splits_follow_the_context_and_fill_the_sms():
    assert ps.seg_keys_for(32768) == 512 and ps.seg_keys_for(8192) == 256 and ps.seg_keys_for(131072) == 2048
    assert ps.seg_keys_for(40000) % 128 == 0 and -(-40000 // ps.seg_keys_for(40000)) <= 64
    assert ps.splits(1, 8, 132, 64) == 33  # 8 CTAs a stream: 33 fill 264
    assert ps.splits(16, 8, 132, 64) == 3
    assert ps.splits(64, 8, 132, 64) == 1
    assert ps.splits(1, 8, 132, 4) == 4  # never more than the segments a row can have


def _case(B, H, Hkv, D, bs, lens, dtype, seed):
    torch.manual_seed(seed)
    nblocks = max(200, sum(-(-L // bs) for L in lens) + 8)
    kc = torch.randn(nblocks, bs, Hkv, D, device=DEV).to(dtype)
    vc = torch.randn(nblocks, bs, Hkv, D, device=DEV).to(dtype)
    maxb = max((L + bs - 1) // bs for L in lens) + 2
    bt = torch.stack([torch.randperm(nblocks, device=DEV)[:maxb] for _ in range(B)]).to(torch.int32)
    ln = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(B, (H + 2 * Hkv) * D, device=DEV) * 2  # a fused qkv row: q is its first H*D
    return q, kc, vc, bt, ln


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,Hkv,D,bs,lens,max_ctx,S", [
    (1, 9, 3, 64, 16, [1], 8192, 0),
    (3, 9, 3, 64, 16, [17, 300, 64], 8192, 4),
    (5, 32, 8, 128, 16, [130, 1, 513, 0, 1000], 8192, 3),
    (2, 8, 8, 128, 32, [2000, 33], 8192, 7),
    (1, 32, 8, 128, 16, [9000], 32768, 0),  # the 8B's shape at a long context, one stream: 18 segments
    (2, 4, 1, 256, 16, [4100, 5], 32768, 0),  # Gemma 3's: one KV head, D 256
    (2, 64, 8, 128, 16, [3000, 700], 8192, 5),  # G = 8
    (4, 9, 3, 64, 16, [0, 0, 2, 40], 8192, 64),  # more splits than segments
])
def test_split_decode_is_the_reference_and_paged_decode(dtype, B, H, Hkv, D, bs, lens, max_ctx, S):
    _skip_without_gpu()
    from imp.kernels.cuda import paged_decode_attention as pa
    from imp.kernels.cuda import quantize_act_int8

    q, kc, vc, bt, ln = _case(B, H, Hkv, D, bs, lens, dtype, B * 1000 + H + S)
    out = _poison(B, H * D)
    ps.paged_decode_split(q, kc, vc, bt, ln, H, max_ctx, n_splits=S, out=out)
    ref = pa.reference(q, kc, vc, bt, ln, H)
    for i, L in enumerate(lens):
        if L == 0:
            assert (out[i] == 0).all()
    assert _rel(out, ref) < 1e-5
    assert _rel(out, pa.paged_decode(q, kc, vc, bt, ln, H)) < 1e-5
    # the int8 output for an int8 O projection: this kernel's output quantized by the one rule
    xa, want = ps.paged_decode_split(q, kc, vc, bt, ln, H, max_ctx, n_splits=S, q8=True), quantize_act_int8.quantize(out)
    assert torch.equal(xa.xq, want.xq) and torch.equal(xa.xds, want.xds)
    # reused work buffers (a graph's), larger than needed and poisoned
    seg = ps.seg_keys_for(max_ctx)
    n = B * H * -(-max_ctx // seg) + 7
    work = (torch.full((n, 2), float("nan"), device=DEV), torch.full((n, D), float("nan"), device=DEV),
            torch.zeros(B * Hkv + 3, dtype=torch.int32, device=DEV))
    out2 = _poison(B, H * D)
    ps.paged_decode_split(q, kc, vc, bt, ln, H, max_ctx, n_splits=S, out=out2, work=work)
    assert torch.equal(out, out2)
    assert not work[2].any()  # the last CTA of each row resets its counter for the next launch


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv,D", [(32, 8, 128), (9, 3, 64), (4, 1, 256)])
def test_a_row_s_bits_are_the_same_alone_batched_and_at_any_split(H, Hkv, D):
    """Batch invariance: each row of a batch of 6 (contexts 1 .. 7,000, several segments) gives the same bits alone,
    in the batch, and at S = 1, 2, 5 and the default."""
    _skip_without_gpu()
    lens = [1, 700, 2049, 7000, 256, 4097]
    q, kc, vc, bt, ln = _case(6, H, Hkv, D, 16, lens, torch.bfloat16, H + D)
    outs = []
    for S in (0, 1, 2, 5):
        outs.append(ps.paged_decode_split(q, kc, vc, bt, ln, H, 8192, n_splits=S))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    for i in range(6):
        alone = ps.paged_decode_split(q[i:i + 1], kc, vc, bt[i:i + 1].contiguous(), ln[i:i + 1].contiguous(), H, 8192)
        assert torch.equal(alone[0], outs[0][i]), f"row {i} (context {lens[i]}) alone differs from batched"


@pytest.mark.gpu
def test_split_decode_is_captured_by_a_graph_and_serves_any_context_length():
    """One capture, replayed at lengths from 0 to 6,000: the graph holds the grid, the lengths are data."""
    _skip_without_gpu()
    from imp.kernels.cuda import paged_decode_attention as pa

    B, H, Hkv, D, bs, max_ctx = 2, 32, 8, 128, 16, 8192
    kc = torch.randn(800, bs, Hkv, D, device=DEV).to(torch.bfloat16)
    vc = torch.randn(800, bs, Hkv, D, device=DEV).to(torch.bfloat16)
    bt = torch.stack([torch.randperm(800, device=DEV)[:400] for _ in range(B)]).to(torch.int32)
    ln = torch.zeros(B, dtype=torch.int32, device=DEV)
    q = torch.randn(B, H * D, device=DEV)
    out = torch.empty(B, H * D, device=DEV)
    n = B * H * -(-max_ctx // ps.seg_keys_for(max_ctx))
    work = (torch.empty(n, 2, device=DEV), torch.empty(n, D, device=DEV), torch.zeros(B * Hkv, dtype=torch.int32, device=DEV))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ps.paged_decode_split(q, kc, vc, bt, ln, H, max_ctx, out=out, work=work)  # compile before capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ps.paged_decode_split(q, kc, vc, bt, ln, H, max_ctx, out=out, work=work)
    for lens in ([0, 1], [6000, 17], [513, 4096]):
        ln.copy_(torch.tensor(lens, dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        want = pa.reference(q, kc, vc, bt, ln, H)
        for i, L in enumerate(lens):
            assert (out[i] == 0).all() if L == 0 else _rel(out[i:i + 1], want[i:i + 1]) < 1e-5
        assert not work[2].any()
