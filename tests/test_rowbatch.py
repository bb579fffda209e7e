"""A plan's decode lane rows as columns (`DecodeRows`) from the scheduler to a runner and their ids back as one
(issue 33, deliverable 3): the columns stand for exactly the SeqWorks they replace, a GPU runner's hot path reads
them without making one, and the result's split puts every sampled id where the scheduler looks for it."""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import numpy as np
import pytest

from imp.actors.executor import landed_result, plan_works
from imp.messages import (PENDING_TOKEN, DecodeRows, SampledToken, SamplingParams, SeqWork, StepPlan, StepResult,
                          step_result)
from imp.sampling.works import RowBatch, Works, split_tokens


def _rows(ids, toks, starts, gens, tables=None) -> DecodeRows:
    tables = tables or tuple((10 + i,) for i in range(len(ids)))
    return DecodeRows(tuple(ids), tuple(tables), np.array([toks, starts, gens], "<i8").T.copy().tobytes())


def test_decode_rows_stand_for_their_seqworks_and_the_executor_completes_them():
    p = SamplingParams(max_tokens=9, repetition_penalty=1.2)
    rows = _rows(["a", "b"], [5, PENDING_TOKEN], [7, 8], [2, 3])
    assert rows.works() == [SeqWork("a", (5,), 7, (10,), True, None, gen_index=2),
                            SeqWork("b", (PENDING_TOKEN,), 8, (11,), True, None, gen_index=3, pending=1)]
    general = SeqWork("c", (1, 2, 3), 0, (12,), True, p)
    plan = StepPlan(4, (general,), (), rows)
    assert [w.seq_id for w in plan.shares()] == ["a", "b", "c"]
    kept, hists = {"a": p, "b": p}, {"a": [4, 5], "b": [6, 7, 8]}
    works = plan_works(plan, kept, hists)
    assert [w.seq_id for w in works] == ["a", "b", "c"] and works[0].params is p
    # a sampled row's history: gen_index - pending tokens of the kept ones (the one in flight is the device's)
    assert tuple(works[0].history) == (4, 5) and tuple(works[1].history) == (6, 7)
    rb = RowBatch(rows, kept, hists)
    assert rb.pending.tolist() == [0, 1] and rb.made == 0
    w = Works(rb, [general])
    assert len(w) == 3 and w.seq_ids == ["a", "b", "c"] and w[2] is general and w[-1] is general
    assert w[1] == works[1] and rb.made == 1  # made on first use, once
    assert isinstance(w.subset([0, 1, 2]), Works) and w.subset([1, 2]) == [works[1], general]
    with pytest.raises(KeyError):  # a row before its sequence's first share: the scheduler's bug
        RowBatch(rows, {"a": p}, {})
    with pytest.raises(ValueError):
        RowBatch(DecodeRows(("a",), (), rows.cols), kept, hists)


def test_a_step_s_samples_split_between_rows_and_shares_whatever_the_order():
    rows = ("a", "b", "c")
    ids, toks = split_tokens(rows, ["a", "b", "c", "x"], np.array([4, 5, 6, 7]), None)
    assert ids.tolist() == [4, 5, 6] and toks == [SampledToken("x", 7)]
    ids, toks = split_tokens(rows, ["a", "c", "x"], np.array([4, 6, 7]), None)  # b left out (its step failed)
    assert ids.tolist() == [4, -1, 6] and toks == [SampledToken("x", 7)]
    t = [SampledToken("x", 7, logprob=-0.5), SampledToken("c", 6), SampledToken("a", 4)]  # a verify step's tokens
    ids, toks = split_tokens(rows, None, None, t)
    assert ids.tolist() == [4, -1, 6] and toks == [t[0]]
    # the executor's result: ids a column, histories appended (a row's and a share's), -1 appends nothing
    hists = {"a": [1], "b": [2], "x": [3]}
    rb = RowBatch(_rows(rows, [PENDING_TOKEN] * 3, [5, 5, 5], [1, 1, 1]), {s: SamplingParams(max_tokens=4) for s in rows}, hists)
    res = landed_result(9, [], rb, hists, 100, 10, 0, (["a", "c", "x"], np.array([4, 6, 7])))
    assert np.frombuffer(res.row_ids, "<i8").tolist() == [4, -1, 6] and res.tokens == (SampledToken("x", 7),)
    assert hists == {"a": [1, 4], "b": [2], "x": [3, 7]}
    # a model stand-in's answer (tests, tools): the same split from tokens
    plan = StepPlan(9, (SeqWork("x", (1,), 4, (9,), True, None),), (), _rows(rows, [1, 1, 1], [5, 5, 5], [1, 1, 1]))
    r = step_result(plan, [SampledToken("c", 6), SampledToken("x", 7), SampledToken("a", 4)], 100)
    assert isinstance(r, StepResult) and np.frombuffer(r.row_ids, "<i8").tolist() == [4, -1, 6]
    assert r.tokens == (SampledToken("x", 7),)


def _run_host_only(columns: bool, steps: int = 20):
    """Pipelined penalized decode steps of 3 lane rows and one general decode share through a `host_only` GPU
    runner: as columns (Works) or as the SeqWorks they stand for. (tokens by step, SeqWorks made a step)"""
    import torch

    from imp.gpu.runner import GpuModelRunner

    V, B = 23, 3
    r = GpuModelRunner.host_only(vocab=V, block_size=16, num_blocks=64, context_length=512, max_batch=8)
    p = SamplingParams(max_tokens=99, repetition_penalty=1.3, frequency_penalty=0.4)
    q = SamplingParams(max_tokens=99, temperature=0, presence_penalty=0.5)  # (host_only: greedy draws)
    kept, hists = {}, {}
    tables = [(i * 8,) for i in range(B + 1)]
    g = torch.Generator().manual_seed(1)
    out, made = [], []
    for k in range(steps):
        pos = 10 + k
        if pos % 16 == 0:
            tables = [t + (t[0] + len(t),) for t in tables]
        r.host_logits.copy_(torch.randn(r.host_logits.shape, generator=g) * 3)
        tok = (7,) if k == 0 else (PENDING_TOKEN,)
        gshare = SeqWork("g", tok, pos, tables[B], True, q if k == 0 else None, gen_index=k, pending=int(k > 0))
        if k == 0:  # every sequence's first share brings its params (the lane takes it from the next step)
            plan = StepPlan(k, tuple(SeqWork(f"s{i}", tok, pos, tables[i], True, p) for i in range(B)) + (gshare,))
        else:
            chunk = (SeqWork("p", (1, 2, 3), 0, (60,), False, p),) if k == 10 else ()  # a mixed step: eager here
            plan = StepPlan(k, (gshare,) + chunk, (), _rows([f"s{i}" for i in range(B)], [PENDING_TOKEN] * B, [pos] * B, [k] * B,
                                                    tables[:B]))
        rb = RowBatch(plan.rows, kept, hists) if plan.rows is not None else None
        from imp.actors.executor import attach_state

        general = attach_state(plan, kept, hists)
        if rb is not None and columns:
            sids, ids, toks = r.collect_ids(r.launch(Works(rb, general)))
            res = landed_result(k, toks or [], rb, hists, 0, 0, 0, (sids, ids) if toks is None else None)
        else:
            works = (rb.works() if rb is not None else []) + general
            res = landed_result(k, r.collect(r.launch(works)), rb, hists, 0, 0)
        made.append(rb.made if rb is not None else 0)
        got = {t.seq_id: t.token_id for t in res.tokens}
        if res.row_ids:
            got.update(zip([f"s{i}" for i in range(B)], np.frombuffer(res.row_ids, "<i8").tolist()))
        out.append(got)
    return out, made


def test_a_gpu_runner_takes_the_rows_as_columns_without_a_seqwork_a_row():
    """`GpuModelRunner.host_only`: the columns' steps give the SeqWorks' tokens (penalties on the device counts,
    a general share with other params beside them, tables growing), and the hot path makes no SeqWork of a row."""
    as_cols, made = _run_host_only(True)
    as_works, _ = _run_host_only(False)
    assert as_cols == as_works and all(len(t) == 4 for t in as_cols)
    assert made[:10] + made[11:] == [0] * (len(made) - 1)  # (step 10's prompt chunk: the eager path reads SeqWorks)


def test_a_server_on_a_paced_null_runner_streams_every_lane_row_and_replays(smollm2_path, tmp_path):
    """The executor's columns path end to end (the paced null runner takes rows as a GPU runner does): eight
    concurrent streams each get all their tokens, the pool is empty after, and the event log replays identical."""
    from imp.core.replay import main as replay_main
    from tests.serverproc import ServerProcess

    env = {"IMP_NULL_RUNNER": "1", "IMP_NULL_STEP_US": "300"}
    log = tmp_path / "rows.log"

    def ask(url, i):
        body = json.dumps({"model": "m", "prompt": list(range(300 + i, 340 + i)), "max_tokens": 30, "stream": True,
                           "ignore_eos": True, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        n = 0
        with urllib.request.urlopen(req, timeout=120) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    n += len(json.loads(line[6:])["choices"][0]["text"]) > 0
        return n

    with ServerProcess(str(smollm2_path), "--event-log", str(log), "--speculative", "off", env=env) as srv:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            counts = list(pool.map(lambda i: ask(srv.url, i), range(8)))
        with urllib.request.urlopen(srv.url + "/health", timeout=30) as resp:
            health = json.load(resp)
    assert counts == [30] * 8
    assert health["kv_blocks_used"] == 0 and health["queue_running"] == 0
    assert replay_main([str(log)]) == 0


def test_rows_whose_pending_token_was_lost_are_left_out_and_come_back_as_minus_one():
    """After a failed step (the runner has nothing to feed PENDING_TOKEN from), a step's pending decode rows are
    left out, a share with its token known still runs, and the split says -1 for the rows left out."""
    import torch

    from imp.actors.executor import attach_state
    from imp.gpu.runner import GpuModelRunner

    r = GpuModelRunner.host_only(vocab=19, block_size=16, num_blocks=32, context_length=256, max_batch=8)
    p = SamplingParams(max_tokens=50, repetition_penalty=1.1)
    kept, hists = {}, {}
    r.host_logits.copy_(torch.randn(r.host_logits.shape, generator=torch.Generator().manual_seed(2)))
    first = StepPlan(0, tuple(SeqWork(s, (3,), 5, (i,), True, p) for i, s in enumerate(["a", "b", "k"])))
    landed_result(0, r.collect(r.launch(attach_state(first, kept, hists))), None, hists, 0, 0)
    r._prev_at[:] = -1  # as `launch` leaves it when a step raised on the device
    r._prev_sids, r._prev_map = [], None
    plan = StepPlan(1, (SeqWork("k", (4,), 6, (2,), True, None, gen_index=1),), (),
                    _rows(["a", "b"], [PENDING_TOKEN] * 2, [6, 6], [1, 1], ((0,), (1,))))
    rb = RowBatch(plan.rows, kept, hists)
    sids, ids, toks = r.collect_ids(r.launch(Works(rb, attach_state(plan, kept, hists))))
    assert toks is None and sids == ["k"]
    res = landed_result(1, [], rb, hists, 0, 0, 0, (sids, ids))
    assert np.frombuffer(res.row_ids, "<i8").tolist() == [-1, -1] and [t.seq_id for t in res.tokens] == ["k"]


def test_a_mixed_graph_lays_decode_rows_out_from_the_columns_as_from_their_seqworks():
    """`imp.gpu.mixed.layout` with a Works and the checked columns writes the same buffer, byte for byte, and the
    same head rows as with the SeqWorks the rows stand for: pending rows, tables of several blocks, prompt chunks
    and one-token general shares beside them."""
    import random

    from imp.gpu.mixed import Regions, fits, head_slots, layout, tile_slots
    from imp.gpu.tables import Tables

    BS, MB, PBS, DBS = 16, 8, (64, 128), (0, 4, 8, 16)
    reg = Regions(N=max(PBS) + max(DBS), D=max(DBS), C=head_slots(max(PBS)), T=tile_slots(max(PBS)), MB=MB)
    p = SamplingParams(max_tokens=99)
    rng = random.Random(5)
    laid = 0
    for case in range(60):
        R, G = rng.randint(1, 9), rng.randint(1, 3)
        kept = {f"r{i}": p for i in range(R)}
        pos = [rng.randint(0, 100) for _ in range(R)]
        tabs = tuple(tuple(rng.sample(range(1, 200), q // BS + 1)) for q in pos)
        toks = [PENDING_TOKEN if rng.random() < 0.6 else rng.randint(0, 50) for _ in range(R)]
        rows = RowBatch(_rows([f"r{i}" for i in range(R)], toks, pos, [1] * R, tabs), kept, {})
        general = []
        for j in range(G):
            n = rng.choice([1, rng.randint(2, 40)])
            st = rng.randint(0, 60)
            general.append(SeqWork(f"g{j}", tuple(rng.randint(0, 50) for _ in range(n)), st,
                                   tuple(rng.sample(range(200, 400), (st + n - 1) // BS + 1)), rng.random() < 0.7, p))
        works = Works(rows, general)
        listed = rows.works() + general
        pair = fits(works, PBS, DBS)
        assert pair == fits(listed, PBS, DBS)
        if pair is None:
            continue
        laid += 1
        src = {i: rng.randint(0, 30) for i, w in enumerate(listed) if w.pending}
        t = Tables(context_length=512, block_size=BS, num_blocks=400, max_blocks=MB)
        tr = t.check(works)
        h1 = np.full(reg.offsets["end"], 12345, np.int32)
        h2 = h1.copy()
        a = layout(works, src, *pair, BS, reg, h1, (tr, t))
        b = layout(listed, src, *pair, BS, reg, h2)
        # (a row's table past its position: the columns' gather may write entries the SeqWorks' layout leaves)
        o = reg.offsets
        dec = slice(o["dec_bt"], o["dec_bt"] + pair[1] * MB)
        assert (h1[:o["dec_bt"]] == h2[:o["dec_bt"]]).all(), case
        assert a.head_at == b.head_at and a.used == b.used, case
        d1, d2 = h1[dec].reshape(-1, MB), h2[dec].reshape(-1, MB)
        lens = h2[o["dec_lens"]:o["dec_lens"] + pair[1]]
        for j, n in enumerate(lens.tolist()):
            nb = (n - 1) // BS + 1 if n else 0
            assert (d1[j, :nb] == d2[j, :nb]).all(), (case, j)
    assert laid >= 30
