"""The GPU runner's plan check and block tables (imp.gpu.tables.Tables): a bad share is a ValueError (the step
fails, its requests end), never a device fault; a table is copied (and its entries checked) when its tuple object
changes, not every step; a decode step's inputs laid out from the kept tables equal those laid out share by share
(`imp.gpu.inputs.decode_rows`). CPU only (no device needed)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from imp.gpu.inputs import decode_rows
from imp.gpu.tables import Tables
from imp.messages import PENDING_TOKEN, SeqWork


def _w(sid: str, pos: int, table: tuple[int, ...], n: int = 1) -> SeqWork:
    return SeqWork(sid, (5,) * n, pos, table, True, None)


def _t(ctx: int = 4096) -> Tables:
    return Tables(ctx, 16, 64, -(-ctx // 16), cap=2)


def test_bad_shares_are_value_errors():
    with pytest.raises(ValueError, match="beyond context length"):
        _t(100).check([_w("a", 100, (0,) * 8)])
    with pytest.raises(ValueError, match="block table too short"):
        _t().check([_w("a", 40, (0, 1))])
    with pytest.raises(ValueError, match="block id out of range"):
        _t().check([_w("a", 20, (0, 64))])
    with pytest.raises(ValueError, match="no tokens"):
        _t().check([SeqWork("a", (), 0, (0,), True, None)])
    with pytest.raises(ValueError, match="b: block id out of range"):  # the share that is bad is named
        _t().check([_w("a", 20, (0, 1)), _w("b", 3, (-1,))])


def test_a_table_is_copied_when_its_tuple_changes_and_checked_up_to_the_position():
    t = _t()
    good = (3, 4, 5)
    t.check([_w("a", 20, good)])
    j = t.slots.of["a"]
    t.tab[j, 0] = 99  # (a marker: a copy would overwrite it)
    t.check([_w("a", 21, good)])  # the same tuple: not copied again
    assert t.tab[j, 0] == 99
    bad = (3, 4, 99)  # a new tuple (a grow): copied; its bad block found once the position reaches it
    t.check([_w("a", 20, bad)])
    assert t.tab[j, 0] == 3
    with pytest.raises(ValueError, match="block id out of range"):
        t.check([_w("a", 33, bad)])
    for i in range(5):  # more sequences than the first capacity: the arrays grow, slots stay
        t.check([_w(f"s{i}", 1, (i,))])
    assert t.tab[t.slots.of["s4"], 0] == 4 and t.slots.of["a"] == j
    s0 = t.slots.of["s0"]
    t.forget(["a", "s0"])
    assert "a" not in t.slots.of and len(t.slots) == 4 and t.slots.assign("z") in (j, s0)  # a freed slot reused


def test_a_grown_table_copies_its_new_entries_and_equals_a_whole_copy():
    """A grow appends to the table a row holds: only the tail is checked and copied; whatever else (a prefix that
    changed, a bad block in the tail, a table that shrank) takes the whole copy. Either way the row is the table."""
    import random

    rng = random.Random(5)
    t, whole = _t(), _t()
    tab = (rng.randrange(64),)
    for step in range(200):
        kind = rng.random()
        if kind < 0.7:
            tab = tab + tuple(rng.randrange(64) for _ in range(rng.randint(1, 3)))  # a grow
        elif kind < 0.8:
            tab = tab[:-1] + (rng.randrange(64),)  # its last block replaced (copy on write)
        elif kind < 0.9:
            tab = tab[:rng.randint(1, len(tab))]  # shorter (a preemption's new start)
        else:
            tab = tab + (64,)  # a block id outside the pool
        tab = tab[-200:] if len(tab) > 250 else tab
        pos = 16 * (len(tab) - 1)
        for tt in (t, whole):
            if tt is whole:
                tt.forget(["a"])
            try:
                tt.check([_w("a", pos, tab)])
                ok = True
            except ValueError:
                ok = False
            j = tt.slots.of["a"]
            n = min(len(tab), tt.MB)
            got = (ok, int(tt.n[j]), int(tt.good[j]), tt.tab[j, :int(tt.good[j])].tolist())
            if tt is t:
                inc = got
        assert inc == got, step
        assert got[3] == list(tab[:got[2]]) and got[1] == len(tab) and (got[2] == n) == ok
        if not ok:
            tab = tab[:-1]


def test_decode_rows_from_the_kept_tables_equal_the_shares_own():
    rng = random.Random(5)
    t = _t()
    tables = {f"s{i}": tuple(rng.randrange(64) for _ in range(6)) for i in range(9)}
    for step in range(3):
        seqs = []
        for sid, tbl in tables.items():
            pos = rng.randrange(0, 16 * len(tbl))
            if rng.random() < 0.3:  # a grow: a new tuple
                tables[sid] = tbl = tbl[:-1] + (rng.randrange(64),)
            pend = rng.random() < 0.5
            seqs.append(SeqWork(sid, (PENDING_TOKEN,) if pend else (rng.randrange(1000),), pos, tbl, True, None,
                                pending=int(pend)))
        src = {i: rng.randrange(40) for i, w in enumerate(seqs) if w.pending}
        rows = t.check(seqs)
        bt_a, bt_b = np.full((9, 8), -7, np.int32), np.full((9, 8), -7, np.int32)
        a = decode_rows(seqs, src, 16, bt_a)
        b = decode_rows(seqs, src, 16, bt_b, (rows, t))
        for x, y in zip(a, b):
            assert np.array_equal(x, y), step
        for k, w in enumerate(seqs):  # every block up to the row's position the same
            nb = w.start_pos // 16 + 1
            assert np.array_equal(bt_a[k, :nb], bt_b[k, :nb])


def test_a_host_only_runner_lays_decode_steps_out_and_samples_them_as_the_reference():
    """`GpuModelRunner.host_only` (bench/executor_host.py's): pipelined penalized decode steps through `launch`,
    tables growing: the graph inputs hold each row's position, KV slot and pending source, and the tokens are
    the CPU sampler's argmax over the penalized logits with the token in flight counted."""
    import torch

    from imp.actors.executor import attach_state, record_samples
    from imp.gpu.runner import GpuModelRunner
    from imp.messages import SamplingParams, StepPlan
    from imp.sampling.cpu import apply_penalties

    V, B = 23, 3
    r = GpuModelRunner.host_only(vocab=V, block_size=16, num_blocks=64, context_length=512, max_batch=4)
    p = SamplingParams(max_tokens=99, repetition_penalty=1.3, frequency_penalty=0.4)
    kept, hists, gen = {}, {}, {i: [] for i in range(B)}
    tables = [(i * 8,) for i in range(B)]
    g = torch.Generator().manual_seed(0)
    for k in range(20):
        pos = 10 + k
        if pos % 16 == 0:
            tables = [t + (t[0] + len(t),) for t in tables]
        seqs = tuple(SeqWork(f"s{i}", (7,) if k == 0 else (PENDING_TOKEN,), pos, tables[i], True, p if k == 0 else None,
                             gen_index=k, pending=int(k > 0)) for i in range(B))
        logits = torch.randn(4, V, generator=g) * 3
        r.host_logits.copy_(logits)
        toks = r.collect(r.launch(attach_state(StepPlan(step=k, seqs=seqs), kept, hists)))
        h = r.graphs.inputs.hosts[(r.graphs.inputs.turn + 1) % 2].numpy()
        M = r.graphs.inputs.M
        assert h[M:M + B].tolist() == [pos] * B
        assert h[2 * M:2 * M + B].tolist() == [tables[i][pos // 16] * 16 + pos % 16 for i in range(B)]
        assert h[5 * M:5 * M + B].tolist() == ([0, 1, 2] if k else [0, 0, 0])
        for i, t in enumerate(toks):
            want = int(np.argmax(apply_penalties(logits[i].numpy().copy(), gen[i], p)))
            assert t.token_id == want, (k, i)
            gen[i].append(want)
        record_samples(toks, hists)
