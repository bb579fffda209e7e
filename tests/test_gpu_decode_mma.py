"""Decode attention on tensor cores with a shared prefix read once (`imp.kernels.cuda.paged_decode_mma`, issue 39).

The plan (which rows share which segments, the items) runs everywhere in numpy (`plan_host`): every row's segments
covered once, a shared item's rows holding the same blocks there, the items within the launch's capacity. On a GPU:
the device's plan is the numpy one item for item; the kernel against the float64 reference for every group size
here (1, 3, 4, 8, 16) and D 64 / 128, zero and one-token contexts beside long ones; a row's bits the same alone,
beside rows that share its prefix and beside rows that do not (batch invariance); the int8 output the fp32 one
quantized by the one rule; one graph capture serving every sharing pattern; the runner's greedy tokens the same
batched over a shared prefix and alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from imp.kernels.cuda import paged_decode_mma as pm


def _covered(items, rl, bt, lens, bs, seg, R):
    """Each row's segments [0, nseg) are covered exactly once; a shared item's rows hold the first row's blocks over
    its segments, within their contexts; sizes within R."""
    B = len(lens)
    seen = [[] for _ in range(B)]
    for off, n, sb, se in items.tolist():
        if n <= 0:
            continue
        assert 1 <= n <= R and 0 <= sb < se
        rows = rl[off:off + n].tolist()
        first = rows[0]
        for r in rows:
            for s in range(sb, se):
                seen[r].append(s)
                if n > 1:  # the shared keys: whole segments inside every member's context, the same blocks
                    assert (s + 1) * seg <= lens[r] and (s + 1) * seg <= lens[first]
                    blocks = range(s * seg // bs, -(-(s + 1) * seg // bs))
                    assert all(bt[r, k] == bt[first, k] for k in blocks)
    for b in range(B):
        assert sorted(seen[b]) == list(range(-(-int(lens[b]) // seg))), (b, seen[b])


def _shared_tables(B, prefix_blocks, tails, rng, width):
    """Tables whose rows start with the same `prefix_blocks[b]` blocks of one pool prefix, then their own."""
    bt = np.zeros((B, width), np.int32)
    nxt = 10_000
    common = rng.permutation(5000)[:width].astype(np.int32)
    for b in range(B):
        k = prefix_blocks[b]
        bt[b, :k] = common[:k]
        bt[b, k:] = np.arange(nxt, nxt + width - k)
        nxt += width
    return bt


def test_a_plan_without_sharing_cuts_each_row_s_segments_to_fill_the_target():
    bt = np.arange(4 * 100, dtype=np.int32).reshape(4, 100)
    lens = np.array([1, 0, 1600, 257])
    items, rl = pm.plan_host(bt, lens, 16, 256, 16, pm.capacity(4, 66), 66)
    _covered(items, rl, bt, lens, 16, 256, 16)
    used = items[items[:, 1] > 0]
    assert (used[:, 1] == 1).all() and len(used) == 1 + 7 + 2  # one segment an item: 10 segments under the target


def test_sixteen_rows_after_a_shared_prompt_read_it_as_one_tile():
    rng = np.random.default_rng(0)
    B, bs, seg = 16, 16, 640
    lens = np.full(B, 16384 + 40)
    bt = _shared_tables(B, [1024] * B, None, rng, 1100)  # the prompt's 1,024 blocks shared, 16 own tails
    items, rl = pm.plan_host(bt, lens, bs, seg, 16, pm.capacity(B, 66), 66)
    _covered(items, rl, bt, lens, bs, seg, 16)
    used = items[items[:, 1] > 0]
    shared = used[used[:, 1] == 16]
    assert shared[:, 3].max() == 16384 // seg and (shared[:, 3] - shared[:, 2]).sum() == 25  # 25 whole segments
    assert len(used[used[:, 1] == 1]) == 16  # each row's last segment (its own keys) alone


def test_a_group_larger_than_a_tile_and_members_sharing_less_make_several_tiles():
    rng = np.random.default_rng(1)
    B, bs, seg, R = 20, 16, 256, 5  # R 5: SmolLM2's G = 3 would hold 20; smaller here to force several tiles
    pre = [64] * 12 + [20] * 6 + [0, 64]
    bt = _shared_tables(B, pre, None, rng, 80)
    lens = np.full(B, 1200)
    items, rl = pm.plan_host(bt, lens, bs, seg, R, pm.capacity(B, 30), 30)
    _covered(items, rl, bt, lens, bs, seg, R)
    used = items[items[:, 1] > 1]
    assert set(used[:, 1].tolist()) <= {2, 3, 4, 5} and len(used)  # tiles of up to 5 rows


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 24), st.integers(0, 2 ** 31 - 1), st.sampled_from([128, 256, 640]), st.sampled_from([4, 16, 20]),
       st.integers(1, 80))
def test_any_plan_covers_every_segment_once_within_capacity(B, seed, seg, R, target):
    rng = np.random.default_rng(seed)
    width = 120
    pre = rng.integers(0, width, B)
    bt = _shared_tables(B, pre, None, rng, width)
    if B > 2:  # a second family of rows sharing another prefix
        bt[B // 2:, :10] = bt[B // 2, :10] + 7000
    lens = rng.integers(0, width * 16 + 1, B)
    lens[rng.random(B) < 0.2] = 0
    cap = pm.capacity(B, target)
    items, rl = pm.plan_host(bt, lens, 16, seg, R, cap, target)
    assert items.shape == (cap, 4)
    _covered(items, rl, bt, lens, 16, seg, R)


def test_the_shape_follows_the_server_s_context_and_the_card():
    sh = pm.Shape.of(32, 8, 128, 33280, 132)
    assert sh.seg == 640 and sh.nseg_max == 52 and sh.target == 33 and sh.rows_a_tile == 16
    assert pm.Shape.of(9, 3, 64, 8192, 132).rows_a_tile == 20 and pm.per_tile(16) == 4
    assert pm.supports(32, 8, 128, torch.bfloat16) and not pm.supports(32, 8, 128, torch.float32)
    assert not pm.supports(4, 1, 256, torch.bfloat16) and not pm.supports(64, 2, 128, torch.bfloat16)


# ---- on a GPU ----

def _gpu():
    from tests.test_gpu_kernels import DEV, _skip_without_gpu

    _skip_without_gpu()
    return DEV


def _case(B, H, Hkv, D, lens, pre, seed, bs=16):
    dev = _gpu()
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    width = max(-(-L // bs) for L in lens) + 2
    nblocks = 10_000 + B * width + 8
    kc = torch.randn(nblocks, bs, Hkv, D, device=dev).to(torch.bfloat16)
    vc = torch.randn(nblocks, bs, Hkv, D, device=dev).to(torch.bfloat16)
    bt = torch.from_numpy(_shared_tables(B, pre, None, rng, width)).to(dev)
    ln = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(B, (H + 2 * Hkv) * D, device=dev) * 2  # a fused qkv row: q is its first H*D
    return q, kc, vc, bt, ln


def _work(H, Hkv, D, max_ctx, rows):
    from imp.kernels.cuda.gemm_int8_act_tiles import sm_count

    return pm.Work(pm.Shape.of(H, Hkv, D, max_ctx, sm_count(0)), rows, "cuda")


CASES = [  # B, H, Hkv, D, lens, shared prefix blocks, max_ctx
    (1, 9, 3, 64, [1], [0], 8192),
    (5, 32, 8, 128, [130, 1, 513, 0, 1000], [8, 0, 30, 0, 30], 8192),
    (6, 9, 3, 64, [3000, 3001, 2999, 40, 3000, 700], [180, 180, 180, 2, 100, 40], 8192),
    (16, 32, 8, 128, [9000 + i for i in range(16)], [560] * 16, 32768),  # the 8B's shape after a shared prompt
    (3, 8, 8, 128, [2000, 2000, 33], [120, 120, 2], 8192),  # G = 1: 64 rows a tile
    (4, 64, 8, 128, [3000, 3000, 3000, 10], [150, 150, 150, 0], 8192),  # G = 8
    (2, 16, 1, 64, [1500, 1500], [90, 90], 8192),  # G = 16: one sequence a warp
]


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,Hkv,D,lens,pre,max_ctx", CASES)
def test_the_kernel_is_the_reference_and_the_device_plans_as_numpy(B, H, Hkv, D, lens, pre, max_ctx):
    from imp.kernels.cuda import quantize_act_int8
    from tests.test_gpu_kernels import _poison, _rel

    q, kc, vc, bt, ln = _case(B, H, Hkv, D, lens, pre, B * 100 + H)
    work = _work(H, Hkv, D, max_ctx, max(B, 4))
    work.part.fill_(float("nan"))
    sh = work.shape
    items, rl = pm.decode_plan(bt, ln, 16, work)
    want_items, want_rl = pm.plan_host(bt.cpu().numpy(), ln.cpu().numpy(), 16, sh.seg, sh.rows_a_tile,
                                       pm.capacity(B, sh.target), sh.target)
    assert np.array_equal(items.cpu().numpy(), want_items)
    assert np.array_equal(rl.cpu().numpy(), want_rl)
    out = _poison(B, H * D)
    pm.paged_decode_mma(q, kc, vc, bt, ln, work, out=out)
    ref = pm.reference(q, kc, vc, bt, ln, H)
    for i, L in enumerate(lens):
        if L == 0:
            assert (out[i] == 0).all()
    assert _rel(out, ref) < 2e-2  # q and the probabilities in bf16, as paged_prefill
    xa, want = pm.paged_decode_mma(q, kc, vc, bt, ln, work, q8=True), quantize_act_int8.quantize(out)
    assert torch.equal(xa.xq, want.xq) and torch.equal(xa.xds, want.xds)


@pytest.mark.gpu
@pytest.mark.parametrize("H,Hkv,D", [(32, 8, 128), (9, 3, 64), (8, 8, 128)])
def test_a_row_s_bits_are_the_same_alone_and_beside_rows_sharing_its_prefix(H, Hkv, D):
    lens = [5000, 5003, 4990, 1200, 5000, 1, 5001, 2600]
    pre = [300, 300, 300, 70, 300, 0, 200, 160]
    q, kc, vc, bt, ln = _case(8, H, Hkv, D, lens, pre, H + D)
    work = _work(H, Hkv, D, 8192, 8)
    batched = pm.paged_decode_mma(q, kc, vc, bt, ln, work)
    items, _ = pm.decode_plan(bt, ln, 16, work)
    assert int(items[:, 1].max()) > 1  # the batch did share
    for i in range(8):
        alone = pm.paged_decode_mma(q[i:i + 1], kc, vc, bt[i:i + 1].contiguous(), ln[i:i + 1].contiguous(), work)
        assert torch.equal(alone[0], batched[i]), f"row {i} (context {lens[i]}) alone differs from batched"
    small = pm.Work(pm.Shape(H, Hkv, D, work.shape.seg, work.shape.nseg_max, 3), 8, "cuda")  # items cut otherwise
    assert torch.equal(pm.paged_decode_mma(q, kc, vc, bt, ln, small), batched)


@pytest.mark.gpu
def test_one_graph_serves_every_sharing_pattern():
    from tests.test_gpu_kernels import _rel

    B, H, Hkv, D = 4, 32, 8, 128
    q, kc, vc, bt, ln = _case(B, H, Hkv, D, [6000] * 4, [370] * 4, 7)
    work = _work(H, Hkv, D, 8192, B)
    out = torch.empty(B, H * D, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        pm.paged_decode_mma(q, kc, vc, bt, ln, work, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pm.paged_decode_mma(q, kc, vc, bt, ln, work, out=out)
    rng = np.random.default_rng(3)
    for lens, pre in (([0, 1, 17, 6000], [0, 0, 1, 370]), ([6000] * 4, [370] * 4), ([513, 4096, 4100, 4090],
                                                                                     [30, 250, 250, 100])):
        bt.copy_(torch.from_numpy(_shared_tables(B, pre, None, rng, bt.shape[1])))
        ln.copy_(torch.tensor(lens, dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        want = pm.paged_decode_mma(q, kc, vc, bt, ln, work)
        assert torch.equal(out, want)
        ref = pm.reference(q, kc, vc, bt, ln, H)
        for i, L in enumerate(lens):
            assert (out[i] == 0).all() if L == 0 else _rel(out[i:i + 1], ref[i:i + 1]) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_the_runner_s_greedy_tokens_are_the_same_over_a_shared_prefix_and_alone(tmp_path_factory, graphs):
    """--gpu-decode-attention mma on SmolLM2's shape (GQA 9/3, D 64, 8k context: segments of 256 keys), batch
    invariant matmuls: three sequences after one 600-token cached prefix (blocks shared) decode the same tokens
    batched (their first two segments one tile) as each alone."""
    _gpu()
    from gguf import GGMLQuantizationType as T

    from imp.gpu.runner import GpuModelRunner
    from imp.messages import SamplingParams, SeqWork
    from tests.fixtures.synth_raw import write_raw_gguf

    path = str(tmp_path_factory.mktemp("m135m") / "135m-q4_1.gguf")
    write_raw_gguf(path, n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, d_ff=1536, vocab=49152, qtype=T.Q4_1,
                   embed_qtype=T.Q8_0, tied=True, context_length=8192, rope_theta=100000.0, seed=0)
    gpu = GpuModelRunner.load(path, num_blocks=256, block_size=16, kv_dtype=torch.bfloat16, graphs=graphs,
                              max_graph_batch=4, int8_act=True, batch_invariant=True, decode_attention="mma")
    assert gpu.fwd.mma_work is not None and not [n for n in gpu.notes if "mma" in n]
    greedy = SamplingParams(max_tokens=64)
    prefix = list(range(400, 1000))  # 600 tokens: blocks 0..37 (the last partly filled)
    shared = list(range(100, 137))  # 37 whole blocks
    gpu.step([SeqWork(seq_id="p", token_ids=prefix[:592], start_pos=0, block_table=shared, sample=False,
                      params=greedy)])
    tails = [[7, 8, 9], [11], [12, 13, 14, 15, 16]]
    tables = [shared + list(range(200 + 10 * i, 210 + 10 * i)) for i in range(3)]

    def run(which):
        seqs = [SeqWork(seq_id=f"s{i}", token_ids=prefix[592:] + tails[i], start_pos=592, block_table=tables[i],
                        sample=True, params=greedy) for i in which]
        out = {i: [t.token_id] for i, t in zip(which, gpu.step(seqs))}
        for _ in range(10):
            seqs = [SeqWork(seq_id=f"s{i}", token_ids=[out[i][-1]], start_pos=600 + len(tails[i]) + len(out[i]) - 1,
                            block_table=tables[i], sample=True, params=greedy, gen_index=len(out[i])) for i in which]
            for i, t in zip(which, gpu.step(seqs)):
                out[i].append(t.token_id)
        gpu.forget([f"s{i}" for i in which])
        return out

    together = run([0, 1, 2])
    for i in range(3):
        assert run([i])[i] == together[i], f"sequence {i} alone differs from batched"
