"""The mixed-step graphs' input layout (`imp.gpu.mixed.layout`), on the CPU: for random steps of prompt
chunks, decodes, PENDING_TOKEN shares and shares that sample nothing, every head row a graph reads (token
after the pending fill, position, KV slot, attention context) is the one the eager step (`eager_meta`,
`head_rows`) gives the same share, padding is inert, and steps a graph cannot take go eager."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from imp.gpu.inputs import eager_meta
from imp.gpu.mixed import (MAX_CHUNKS, Regions, fits, head_slots, layout, prompt_buckets, tile_slots)
from imp.messages import PENDING_TOKEN, SamplingParams, SeqWork
from imp.model.rows import head_rows

BS, MB = 16, 64
G = SamplingParams(max_tokens=8)
DBS = (0, 1, 2, 4, 8, 16, 32, 64)
PBS = prompt_buckets(512)


def _step(rng: random.Random) -> tuple[list[SeqWork], dict[int, int]]:
    seqs, src, block = [], {}, 0
    for i in range(rng.randint(1, 12)):
        if rng.random() < 0.4:  # a prompt chunk, maybe after a cached prefix, maybe not the last one
            n, start = rng.randint(2, 60), rng.choice([0, 0, 5, 16, 33])
        else:
            n, start = 1, rng.randint(0, 300)
        nb = (start + n - 1) // BS + 1
        table = tuple(range(block, block + nb))
        block += nb
        pend = n == 1 and rng.random() < 0.5
        toks = (PENDING_TOKEN,) if pend else tuple(rng.randint(3, 999) for _ in range(n))
        seqs.append(SeqWork(seq_id=f"s{i}", token_ids=toks, start_pos=start, block_table=table,
                            sample=rng.random() < 0.8, params=G, pending=int(pend)))
        if pend:
            src[i] = rng.randint(0, 40)
    return seqs, src


def _views(h: np.ndarray, reg: Regions, pb: int, db: int) -> dict:
    o = reg.offsets
    N, cb, tb = pb + db, head_slots(pb), tile_slots(pb)
    return dict(tokens=h[o["tokens"]:][:N].copy(), positions=h[o["positions"]:][:N], slots=h[o["slots"]:][:N],
                lens=h[o["dec_lens"]:][:db], ph_rows=h[o["ph_rows"]:][:db], ph_src=h[o["ph_src"]:][:db],
                p_head=h[o["p_head"]:][:cb], tiles=h[o["tiles"]:][:4 * tb].reshape(tb, 4),
                pf_bt=h[o["pf_bt"]:][:cb * MB].reshape(cb, MB), dec_bt=h[o["dec_bt"]:][:db * MB].reshape(db, MB))


def _attends(v: dict, row: int, pb: int):
    """(context length, block ids covering it) that the graph's attention gives a row, or None."""
    if row >= pb:
        j = row - pb
        n = int(v["lens"][j])
        return n, tuple(v["dec_bt"][j, :(n - 1) // BS + 1]) if n else ()
    hits = [t for t in v["tiles"] if t[1] > 0 and t[0] <= row < t[0] + t[1]]
    assert len(hits) <= 1
    if not hits:
        return None
    r0, _, c, p0 = hits[0]
    n = int(p0 + row - r0 + 1)
    return n, tuple(v["pf_bt"][c, :(n - 1) // BS + 1])


def test_layout_matches_the_eager_step_row_for_row():
    rng = random.Random(7)
    sampled = np.arange(100, 164, dtype=np.int32)  # the previous step's ids
    checked = 0
    for _ in range(300):
        seqs, src = _step(rng)
        pair = fits(seqs, PBS, DBS)
        if pair is None:
            assert all(len(s.token_ids) == 1 for s in seqs) or sum(len(s.token_ids) for s in seqs if
                                                                    len(s.token_ids) > 1) > max(PBS)
            continue
        pb, db = pair
        reg = Regions(N=max(PBS) + max(DBS), D=max(DBS), C=head_slots(max(PBS)), T=tile_slots(max(PBS)), MB=MB)
        h = np.full(reg.offsets["end"], 12345, np.int32)  # stale values everywhere: layout must overwrite
        placed = layout(seqs, src, pb, db, BS, reg, h)
        v = _views(h, reg, pb, db)
        ok = v["ph_rows"] >= 0
        v["tokens"][v["ph_rows"][ok]] = sampled[v["ph_src"][ok]]  # fill_pending, as the graph does
        rows, sample_at, _ = head_rows(seqs)
        m = eager_meta(seqs, rows, BS, torch.device("cpu"), src)
        etok = m.tokens.numpy().copy()
        if m.pending is not None:
            r, s_, k = m.pending
            etok[r.numpy()[:k]] = sampled[s_.numpy()[:k]]
        head = np.concatenate([v["p_head"], pb + np.arange(db)])
        assert sorted(placed.head_at) == sorted(sample_at)
        for i, at in sample_at.items():
            er, gr = rows[at], int(head[placed.head_at[i]])
            assert etok[er] == v["tokens"][gr]
            assert m.positions[er] == v["positions"][gr] and m.slots[er] == v["slots"][gr]
            p = int(m.positions[er])
            assert _attends(v, gr, pb) == (p + 1, seqs[i].block_table[:p // BS + 1])
            checked += 1
        # every real row written once with its KV slot; padding rows write nothing and attend nothing
        real = [r for r in range(pb + db) if v["slots"][r] >= 0]
        assert sorted(v["slots"][real]) == sorted(m.slots.numpy())
        for r in range(pb + db):
            if v["slots"][r] < 0:
                assert _attends(v, r, pb) in (None, (0, ()))
            else:
                assert _attends(v, r, pb) == (int(v["positions"][r]) + 1,
                                              tuple(_attends(v, r, pb)[1]))
        assert placed.used == reg.offsets["dec_bt"] + db * MB
    assert checked > 500


def test_steps_a_graph_cannot_take_go_eager():
    one = SeqWork(seq_id="d", token_ids=(5,), start_pos=3, block_table=(0,), sample=True, params=G)
    chunk = lambda n, **kw: SeqWork(seq_id="p", token_ids=tuple(range(3, 3 + n)), start_pos=0,  # noqa: E731
                                    block_table=tuple(range((n - 1) // BS + 1)), sample=True, params=G, **kw)
    assert fits([one, one], PBS, DBS) is None  # decode only: the decode graphs' case
    assert fits([chunk(20), one], PBS, DBS) == (32, 1)
    assert fits([chunk(16)] + [one] * 5, PBS, DBS) == (16, 8)
    assert fits([chunk(300)], PBS, DBS) == (512, 0)
    assert fits([chunk(513)], PBS, DBS) is None  # past the largest prompt bucket
    assert fits([chunk(20, prompt_logprobs=2)], PBS, DBS) is None
    assert fits([chunk(20)] + [one] * 65, PBS, DBS) is None  # past the largest decode bucket
    assert fits([chunk(2)] * (MAX_CHUNKS + 1), PBS, DBS) is None  # more shares than head slots
    assert prompt_buckets(512) == (16, 32, 64, 128, 256, 512) and prompt_buckets(600)[-1] == 1024


# --------------------------------------------------------------------------- on the GPU (marked: skipped without)

def _gpu_runner(tmp_path_factory, int8_act: bool):
    from imp.kernels.cuda import runtime

    if not runtime.available():
        pytest.skip("needs CUDA and CuPy")
    from gguf import GGMLQuantizationType as T

    from imp.gpu.runner import GpuModelRunner
    from tests.fixtures.synth import write_synthetic_gguf

    path = tmp_path_factory.mktemp("mixed") / "m.gguf"
    write_synthetic_gguf(path, qtype=T.Q4_0, embed_qtype=T.Q8_0, tied=False, n_layers=2, d_model=256, n_heads=4,
                         n_kv_heads=2, d_ff=512, vocab=512)
    return GpuModelRunner.load(str(path), num_blocks=96, block_size=BS, max_graph_batch=8, int8_act=int8_act,
                               max_prompt_rows=128)


@pytest.mark.gpu
@pytest.mark.parametrize("int8_act", [False, True])
def test_a_mixed_graph_gives_the_eager_step_s_logits(tmp_path_factory, int8_act):
    """Prompt chunks (fresh and after a cached prefix) beside decodes: the graph of the step's bucket pair
    gives each head row the eager step's logits (the same kernels; only the matmuls' row counts differ, which
    cuBLAS may round differently) and the same greedy token; the graph ran, not the eager path."""
    gpu = _gpu_runner(tmp_path_factory, int8_act)
    assert gpu.mixed is not None and len(gpu.mixed.graphs) == 4 * 5, gpu.notes  # Pb 16..128 x Db 0,1,2,4,8
    rng = random.Random(3)
    # context first: three sequences' prompts, so the decodes and the cached-prefix chunk have KV to read
    ctx = [[rng.randint(3, 500) for _ in range(n)] for n in (40, 23, 70)]
    tables = [tuple(range(10 * i, 10 * i + 8)) for i in range(6)]
    gpu.step([SeqWork(seq_id=f"c{i}", token_ids=tuple(p), start_pos=0, block_table=tables[i], sample=True, params=G)
              for i, p in enumerate(ctx)])
    seqs = [SeqWork(seq_id="c0", token_ids=(7,), start_pos=40, block_table=tables[0], sample=True, params=G),
            SeqWork(seq_id="c2", token_ids=tuple(rng.randint(3, 500) for _ in range(19)), start_pos=70,
                    block_table=tables[2], sample=True, params=G),  # a chunk after 70 cached positions
            SeqWork(seq_id="n3", token_ids=tuple(rng.randint(3, 500) for _ in range(33)), start_pos=0,
                    block_table=tables[3], sample=False, params=G),  # a middle chunk: no head row
            SeqWork(seq_id="c1", token_ids=(9,), start_pos=23, block_table=tables[1], sample=True, params=G),
            SeqWork(seq_id="n4", token_ids=tuple(rng.randint(3, 500) for _ in range(5)), start_pos=0,
                    block_table=tables[4], sample=True, params=G)]
    pair = gpu.mixed.fits(seqs)
    assert pair == (64, 2)
    with torch.inference_mode():
        logits, head_at = gpu.mixed.replay(seqs, pair)
        graph = {i: logits[r].clone() for i, r in head_at.items()}
        rows, sample_at, _ = head_rows(seqs)
        eager = gpu._eager_logits(seqs, rows, {}, None)
    assert sorted(graph) == sorted(sample_at) == [0, 1, 3, 4]
    for i, at in sample_at.items():
        e, g = eager[at].float(), graph[i].float()
        assert torch.allclose(g, e, rtol=1e-3, atol=1e-3 * float(e.abs().max())), (i, float((g - e).abs().max()))
        assert int(g.argmax()) == int(e.argmax())
    # and through launch/collect: the graph path answers the same tokens as with the graphs off
    want = [t.token_id for t in gpu.step(seqs)]
    saved, gpu.mixed = gpu.mixed, None
    try:
        assert [t.token_id for t in gpu.step(seqs)] == want
    finally:
        gpu.mixed = saved


def test_few_prompt_tiles_over_a_long_context_run_eagerly():
    """A 16-row chunk after a 20k-token cached prefix splits its attention segments in an eager step (a
    graph's launch cannot): the mixed graphs decline it; a short context or many tiles still take a graph."""
    from imp.gpu.mixed import fits
    from imp.messages import SamplingParams, SeqWork

    p = SamplingParams(max_tokens=4)
    tail = SeqWork("a", tuple(range(16)), 19984, tuple(range(1251)), True, p)
    short = SeqWork("b", tuple(range(16)), 100, tuple(range(8)), True, p)
    dec = SeqWork("c", (1,), 500, tuple(range(32)), True, p)
    assert fits([tail], (16, 32), (0, 8), heads=32) is None
    assert fits([tail], (16, 32), (0, 8)) == (16, 0)  # heads unknown: as before
    assert fits([short, dec], (16, 32), (0, 8), heads=32) == (16, 8)
    many = SeqWork("d", tuple(range(1024)), 19000, tuple(range(1251)), True, p)  # 64 tiles x 32 heads: in turn
    assert fits([many], (1024,), (0,), heads=32) == (1024, 0)


@pytest.mark.gpu
def test_the_bucket_costs_cover_every_pair_with_decode_rows_and_change_no_token(tmp_path_factory):
    """`prompt_costs` (the ITL policy's table, measured at boot on the captured graphs): one entry per
    (prompt bucket, decode bucket) pair with decode rows, none negative, the largest prompt bucket costing
    more than the smallest; `prompt_ctx_ns` (a prompt row's attention per 1,000 positions) positive; a step
    run before and after measuring answers the same tokens (the replays touch no sequence's KV)."""
    gpu = _gpu_runner(tmp_path_factory, True)
    rng = random.Random(5)
    seqs = [SeqWork(seq_id=f"p{i}", token_ids=tuple(rng.randint(3, 500) for _ in range(n)), start_pos=0,
                    block_table=tuple(range(10 * i, 10 * i + 6)), sample=True, params=G) for i, n in enumerate((40, 70))]
    want = [t.token_id for t in gpu.step(seqs)]
    gpu.forget([s.seq_id for s in seqs])
    table = gpu.prompt_costs()
    assert sorted((pb, db) for pb, db, _ in table) == sorted((pb, db) for pb in (16, 32, 64, 128) for db in (1, 2, 4, 8))
    assert all(ns >= 0 for *_, ns in table)
    assert any(ns > 0 for *_, ns in table)  # measured (a tiny model: launches more than rows)
    assert [t.token_id for t in gpu.step(seqs)] == want
    gpu.forget([s.seq_id for s in seqs])
    # the prompt rows' attention by context: 128 rows from ~1.5k positions read blocks these sequences hold
    # (reads only: the same tokens after)
    assert gpu.prompt_ctx_ns() > 0
    assert [t.token_id for t in gpu.step(seqs)] == want
