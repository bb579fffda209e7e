"""`imp.kernels.cuda.paged_prefill_attention`: every prompt row of a step in one launch, read through block tables.

Against a float64 reference (bf16 cache, q and probabilities rounded to bf16 as flash attention
does), and the property the serving path relies on: a row's bits depend on the row alone, not on
the chunk it came in, the rows beside it in its tile, or a cached prefix. Marked `gpu`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def _gpu_ok() -> bool:
    from imp.kernels.cuda import runtime

    return runtime.available()


if not _gpu_ok():
    pytest.skip("needs CUDA and CuPy", allow_module_level=True)

DEV = "cuda"


def _setup(H, Hkv, D, seed=0, num_blocks=160, bs=16):
    g = torch.Generator(device="cpu").manual_seed(seed)
    kc = (torch.randn(num_blocks, bs, Hkv, D, generator=g) * 1.5).to(torch.bfloat16).to(DEV)
    vc = torch.randn(num_blocks, bs, Hkv, D, generator=g).to(torch.bfloat16).to(DEV)
    return g, kc, vc


def _run(q, kc, vc, chunks, H):
    from imp.kernels.cuda import paged_prefill_attention as pp

    tiles, bt = pp.plan(chunks)
    out = torch.full((q.shape[0], H * kc.shape[-1]), float("nan"), device=DEV)
    pp.paged_prefill(q, kc, vc, torch.from_numpy(tiles).to(DEV), torch.from_numpy(bt).to(DEV), H, out)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (32, 8, 128), (4, 4, 64)])
def test_paged_prefill_matches_float64(H, Hkv, D):
    from imp.kernels.cuda import paged_prefill_attention as pp

    g, kc, vc = _setup(H, Hkv, D)
    perm = torch.randperm(kc.shape[0], generator=g).numpy().astype(np.int32)
    # an uncached 37-row prompt, a 2-row chunk after a 352-token prefix, one row, a 16-aligned chunk of 16
    chunks = [(0, 37, perm[:3], 0), (37, 2, perm[3:26], 352), (39, 1, perm[26:28], 20), (40, 16, perm[28:31], 32)]
    N = 56
    q = torch.randn(N, (H + 2 * Hkv) * D, generator=g).to(DEV) * 2  # qkv rows: q is the first H*D columns
    out = _run(q, kc, vc, chunks, H)
    assert not torch.isnan(out).any()
    ref = pp.reference(q, kc, vc, chunks, H)
    for r, want in ref.items():
        err = float((out[r].double() - want).norm() / want.norm())
        assert err < 1.5e-2, (r, err)  # bf16 q and probabilities


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (32, 8, 128)])
def test_a_rows_bits_do_not_depend_on_its_chunk_or_neighbours(H, Hkv, D):
    """One 120-token sequence: all at once from 0; then positions 100..101 as a 2-row chunk after a
    cached prefix, beside other chunks; then every position as its own one-row chunk."""
    g, kc, vc = _setup(H, Hkv, D, seed=1)
    blocks = torch.randperm(kc.shape[0], generator=g).numpy().astype(np.int32)[:8]
    q = torch.randn(120, (H + 2 * Hkv) * D, generator=g).to(DEV)
    whole = _run(q, kc, vc, [(0, 120, blocks, 0)], H)
    other = torch.randn(30, q.shape[1], generator=g).to(DEV)
    mixed_q = torch.cat([other[:13], q[100:102], other[13:]])
    mixed = _run(mixed_q, kc, vc, [(0, 13, blocks[1:3][::-1].copy(), 0), (13, 2, blocks, 100),
                                   (15, 17, blocks[:2], 5)], H)
    assert torch.equal(mixed[13:15], whole[100:102])
    singles = _run(q, kc, vc, [(p, 1, blocks, p) for p in range(120)], H)
    assert torch.equal(singles, whole)


def test_forward_uses_one_launch_for_every_chunk():
    """The eager layout hands the forward tiles for every prompt chunk, cached prefix or not."""
    from imp.gpu.inputs import eager_meta
    from imp.messages import SamplingParams, SeqWork

    p = SamplingParams(max_tokens=4)
    seqs = [SeqWork("a", tuple(range(40)), 0, (3, 4, 5), True, p), SeqWork("b", (7, 8), 32, (9, 10, 11), True, p),
            SeqWork("c", (1,), 5, (2,), True, p)]
    m = eager_meta(seqs, [39, 41, 42], 16, torch.device(DEV))
    assert m.pf_tiles.cpu().tolist() == [[0, 16, 0, 0], [16, 16, 0, 16], [32, 8, 0, 32], [40, 2, 1, 32]]
    assert m.pf_bt.cpu().tolist() == [[3, 4, 5], [9, 10, 11]]
    assert m.pf_last == 39  # a's position 39, b's 33: the launch may split its segments by it


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (32, 8, 128)])
def test_segments_in_turn_or_side_by_side_give_the_same_bits(H, Hkv, D):
    """Keys in segments (64 keys here, 2048 in service): a launch that walks them in turn (many tiles, or a
    graph's) and one that splits them over blocks and merges (few tiles, `last` given) agree bit for bit,
    whatever the chunking; both match float64; a row inside its first segment keeps the one-pass bits."""
    from imp.kernels.cuda import paged_prefill_attention as pp

    g, kc, vc = _setup(H, Hkv, D, seed=2, num_blocks=64)
    blocks = torch.randperm(kc.shape[0], generator=g).numpy().astype(np.int32)[:40]  # 640 positions
    q = torch.randn(640, (H + 2 * Hkv) * D, generator=g).to(DEV)

    def run(chunks, qq, last=None, seg=64):
        tiles, bt = pp.plan(chunks)
        out = torch.full((qq.shape[0], H * D), float("nan"), device=DEV)
        pp.paged_prefill(qq, kc, vc, torch.from_numpy(tiles).to(DEV), torch.from_numpy(bt).to(DEV), H, out,
                         last=last, seg=seg)
        torch.cuda.synchronize()
        return out

    whole = run([(0, 640, blocks, 0)], q)  # no `last` (as a graph's launch): in turn
    tail = [(0, 3, blocks, 600)]  # three rows after a 600-token prefix: one tile, split over 10 segments
    assert pp.splits(1, H, 602, 64) == 10
    split = run(tail, q[600:603], last=602)
    turn = run(tail, q[600:603])
    assert torch.equal(split, turn) and torch.equal(split, whole[600:603])
    straddle = [(0, 16, blocks, 56)]  # rows 56..71: the first eight inside segment 0, the rest past it
    assert torch.equal(run(straddle, q[56:72], last=71), whole[56:72])
    ref = pp.reference(q, kc, vc, [(0, 640, blocks, 0)], H)
    for r in (5, 63, 64, 300, 639):
        err = float((whole[r].double() - ref[r]).norm() / ref[r].norm())
        assert err < 1.5e-2, (r, err)
    one_pass = run([(0, 640, blocks, 0)], q, seg=2048)  # every row inside one segment
    assert torch.equal(one_pass[:64], whole[:64])  # the first segment's rows: the same bits
    err = float((one_pass - whole).norm() / whole.norm())
    assert 0 < err < 1.5e-2, err  # past it the probabilities round to bf16 against another running max


def test_a_short_chunk_after_a_long_prefix_splits_and_is_faster():
    """The 8B shape's restart step (16 rows after 19,984 cached positions, 32 heads): side by side vs in turn."""
    from imp.kernels.cuda import paged_prefill_attention as pp

    H, Hkv, D, bs = 32, 8, 128, 16
    g, kc, vc = _setup(H, Hkv, D, seed=3, num_blocks=1300, bs=bs)
    blocks = torch.randperm(kc.shape[0], generator=g).numpy().astype(np.int32)[:1250]
    q = torch.randn(16, (H + 2 * Hkv) * D, generator=g).to(DEV)
    chunks = [(0, 16, blocks, 19984)]
    tiles, bt = pp.plan(chunks)
    tiles, bt = torch.from_numpy(tiles).to(DEV), torch.from_numpy(bt).to(DEV)
    outs, ms = [], []
    for last in (19999, None):
        out = torch.empty(16, H * D, device=DEV)
        for _ in range(2):
            pp.paged_prefill(q, kc, vc, tiles, bt, H, out, last=last)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5):
            pp.paged_prefill(q, kc, vc, tiles, bt, H, out, last=last)
        e.record()
        e.synchronize()
        ms.append(s.elapsed_time(e) / 5)
        outs.append(out)
    print(f"16 rows at 20k context, one layer: side by side {ms[0]:.3f} ms, in turn {ms[1]:.3f} ms")
    assert torch.equal(outs[0], outs[1])
    assert ms[0] < ms[1] / 3


@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (32, 8, 128), (4, 4, 64), (8, 1, 128), (16, 8, 64), (32, 2, 128)])
def test_the_shared_staging_kernel_gives_the_one_warp_kernel_s_bits(H, Hkv, D):
    """paged_prefill (a block a tile and KV head, Q and key tiles staged once for the group's warps, one or two heads
    a warp) against paged_prefill_warp (a warp a tile and head: the kernel it replaced) on chunks of every kind: a prompt from 0, a
    short chunk after a cached prefix, single rows, a tile straddling segments; in turn and side by side."""
    from imp.kernels.cuda import paged_prefill_attention as pp

    g, kc, vc = _setup(H, Hkv, D, seed=4, num_blocks=96)
    blocks = torch.randperm(kc.shape[0], generator=g).numpy().astype(np.int32)[:80]  # 1,280 positions
    many = [(0, 300, blocks, 0), (300, 3, blocks, 1000), (303, 1, blocks, 5), (304, 16, blocks[:60], 952),
            (320, 37, blocks, 1243)]
    few = [(0, 3, blocks, 1000), (3, 37, blocks, 1243)]  # 4 tiles: side by side when `last` is given
    q = torch.randn(357, (H + 2 * Hkv) * D, generator=g).to(DEV) * 2
    assert pp.splits(4, H, 1279, 64) == 20
    for chunks, seg, last in ((many, 2048, None), (many, 64, None), (many, 64, 1279), (few, 64, 1279),
                              (few, 128, 1279), (few, 2048, 1279)):
        tiles, bt = pp.plan(chunks)
        tiles, bt = torch.from_numpy(tiles).to(DEV), torch.from_numpy(bt).to(DEV)
        outs = []
        for kw in [dict(warp=True), dict(hpw=1)] + ([dict(hpw=2)] if (H // Hkv) % 2 == 0 else []):
            out = torch.full((q.shape[0], H * D), float("nan"), device=DEV)
            pp.paged_prefill(q, kc, vc, tiles, bt, H, out, last=last, seg=seg, **kw)
            outs.append(out)
        torch.cuda.synchronize()
        n = sum(c[1] for c in chunks)  # the rows the chunks name (the rest stay NaN)
        assert not torch.isnan(outs[0][:n]).any(), (seg, last)
        for o in outs[1:]:
            assert torch.equal(o[:n], outs[0][:n]), (seg, last, float((o[:n] - outs[0][:n]).abs().max()))
