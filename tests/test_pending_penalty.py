"""Penalties of a pipelined share whose last token is still on the device (issue 14: a
penalized stream no longer waits for the previous step on the host).

`imp.sampling.gpu.bias_and_penalties` packs the host-known histories into segments and
counts the in-flight token on the device (`imp.kernels.cuda.sampling.penalize_segments`, one
launch); it must equal the CPU reference (`imp.sampling.cpu.apply_penalties`) over the
complete history. On CPU tensors the same rule runs in numpy, so this runs on the CPU (the
GPU lane checks the kernel against it: tests/test_gpu_kernels.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from imp.messages import SamplingParams, SeqWork
from imp.sampling.cpu import apply_penalties as _apply_penalties
from imp.sampling.gpu import bias_and_penalties


def apply_penalties(logits, history, p):
    """The CPU reference (numpy) on a torch row, as a torch row."""
    return torch.from_numpy(_apply_penalties(logits, history, p))


def _penalize_dense(x, works, pending, params):
    """The pending rows only, as the runner passes them (rows index works)."""
    bias_and_penalties(x, works, pending=pending)


def test_dense_pending_penalty_equals_the_reference_over_the_full_history():
    rng = random.Random(0)
    V, R = 97, 6
    logits = torch.randn(R, V) * 3
    works, pend_rows, pend_ids = [], [], []
    params = torch.zeros(R, 3)
    for r in range(R):
        p = SamplingParams(max_tokens=8, repetition_penalty=rng.choice([1.0, 1.05, 1.3, 0.8]),
                           presence_penalty=rng.choice([0.0, 0.5, -0.3]), frequency_penalty=rng.choice([0.0, 0.2]))
        hist = tuple(rng.randrange(V) for _ in range(rng.randrange(0, 12)))
        works.append(SeqWork(seq_id=str(r), token_ids=(0,), start_pos=5, block_table=(0,), sample=True, params=p,
                             history=hist))
        params[r] = torch.tensor([p.repetition_penalty, p.presence_penalty, p.frequency_penalty])
        if r % 2 == 0 or r == R - 1:  # these rows feed a pending token (sometimes one already seen)
            pend_rows.append(r)
            pend_ids.append(hist[0] if hist and r % 4 == 0 else rng.randrange(V))
    x = logits.clone()
    # the in-flight ids sit at other slots of a device buffer, as the runner's last-step ids do
    src = torch.tensor([7] * 3 + pend_ids, dtype=torch.int32)
    _penalize_dense(x, works, (pend_rows, src, [3 + i for i in range(len(pend_rows))]), params)
    for r, w in enumerate(works):
        full = [*w.history, pend_ids[pend_rows.index(r)]] if r in pend_rows else list(w.history)
        want = apply_penalties(logits[r].clone(), full, w.params)
        assert torch.allclose(x[r], want, atol=1e-6), (r, w.params, w.history, full)


def test_dense_pending_penalty_ignores_ids_outside_the_vocabulary_and_empty_histories():
    V = 50
    p = SamplingParams(max_tokens=8, repetition_penalty=1.3, frequency_penalty=0.2)
    hists = [(3, 3, -1, 7, V + 5), (), (V, 4)]
    works = [SeqWork(seq_id=str(r), token_ids=(0,), start_pos=5, block_table=(0,), sample=True, params=p, history=h)
             for r, h in enumerate(hists)]
    logits = torch.randn(3, V) * 3
    params = torch.tensor([[1.3, 0.0, 0.2]] * 3)
    pend = [9, 3, 4]
    x = logits.clone()
    _penalize_dense(x, works, ([0, 1, 2], torch.tensor(pend, dtype=torch.int32)), params)
    y = logits.clone()
    _penalize_dense(y, works, ([0, 1, 2], torch.tensor(pend, dtype=torch.int64)), params)  # int64 ids as well
    assert torch.equal(x, y)
    for r, h in enumerate(hists):
        want = apply_penalties(logits[r].clone(), [t for t in h if 0 <= t < V] + [pend[r]], p)
        assert torch.allclose(x[r], want, atol=1e-6), (r, h)


def test_history_counts_are_the_per_row_counters():
    from collections import Counter

    from imp.sampling.gpu import history_counts

    rng = random.Random(1)
    V = 40
    hists = [tuple(rng.randrange(-3, V + 3) for _ in range(rng.randrange(0, 30))) for _ in range(7)]
    rows = [0, 2, 3, 5, 8, 9, 11]
    r, ids, cnt = history_counts(hists, rows, V)
    got = {(int(a), int(b)): float(c) for a, b, c in zip(r, ids, cnt)}
    want = {(row, t): float(c) for row, h in zip(rows, hists) for t, c in Counter(x for x in h if 0 <= x < V).items()}
    assert got == want and cnt.dtype == np.float32
    assert history_counts([(), ()], [0, 1], V)[0].size == 0


def test_segments_skip_unpenalized_rows_and_rows_with_nothing_to_count():
    from imp.sampling.gpu import penalty_segments

    pen = SamplingParams(max_tokens=8, repetition_penalty=1.2, presence_penalty=0.5)
    plain = SamplingParams(max_tokens=8)
    works = [SeqWork(seq_id=str(r), token_ids=(0,), start_pos=5, block_table=(0,), sample=True, params=p, history=h)
             for r, (p, h) in enumerate([(plain, (1, 2)), (pen, ()), (pen, (4, 4, 9)), (pen, ())])]
    meta, S = penalty_segments(works, ([3], torch.tensor([5], dtype=torch.int32)), 20)
    assert S == 2 and list(meta[:2]) == [2, 3]  # row 1: penalized but nothing to count; row 0: no penalty
    assert list(meta[2:5]) == [0, 2, 2] and list(meta[5:7]) == [-1, 0]  # offsets, in-flight slots
    assert list(meta[13:15]) == [4, 9] and list(meta[15:17]) == [2, 1]  # ids, counts
    assert penalty_segments(works[:2], None, 20)[1] == 0
    x = torch.zeros(4, 20)
    bias_and_penalties(x, works, pending=([3], torch.tensor([5], dtype=torch.int32)))
    assert x[0].eq(0).all() and x[1].eq(0).all() and int((x != 0).sum()) == 3  # 4, 9 and the in-flight 5


def test_history_counts_kept_across_steps_equal_counting_afresh():
    """The runner's HistoryCounts: histories growing by one or several tokens a step (ids outside V too),
    a sequence forgotten and seen again, one whose history comes back shorter: the packed segments equal
    those of counting every history afresh, step after step."""
    from imp.sampling.counts import HistoryCounts
    from imp.sampling.gpu import penalty_segments

    rng = random.Random(5)
    V = 30
    p = SamplingParams(max_tokens=8, repetition_penalty=1.2, frequency_penalty=0.1)
    kept = HistoryCounts()
    hists = {f"s{i}": [] for i in range(5)}
    for step in range(60):
        for sid, h in hists.items():
            h.extend(rng.randrange(-1, V + 1) for _ in range(rng.choice([0, 1, 1, 1, 3])))
        if step == 20:
            kept.forget(["s1"])
        if step == 30:
            hists["s2"] = hists["s2"][:2]  # shorter than counted: counted afresh
        works = [SeqWork(seq_id=sid, token_ids=(0,), start_pos=5, block_table=(0,), sample=True, params=p,
                         history=tuple(h)) for sid, h in hists.items()]
        pend = ([0, 3], torch.tensor([4, 9], dtype=torch.int32))
        a, sa = penalty_segments(works, pend, V, kept)
        b, sb = penalty_segments(works, pend, V)
        assert sa == sb and np.array_equal(a, b), step
    assert len(kept) == 5
    # an id reused for another sequence without a forget: a history as long as the counted one, other tokens
    w = [SeqWork(seq_id="s0", token_ids=(0,), start_pos=5, block_table=(0,), sample=True, params=p,
                 history=tuple((t + 1) % V for t in hists["s0"]))]
    assert np.array_equal(penalty_segments(w, None, V, kept)[0], penalty_segments(w, None, V)[0])
    kept.forget(list(hists))
    assert len(kept) == 0


def test_history_view_reads_the_first_n_kept_tokens_in_place():
    from imp.actors.executor import HistoryView

    kept = [5, 6, 7]
    v = HistoryView(kept, 2)
    kept.append(8)  # a later sample lands while a runner reads the view: it still sees 2 tokens
    assert len(v) == 2 and list(v) == [5, 6] and v == (5, 6) and v == [5, 6] and v != (5, 6, 7)
    assert v[-1] == 6 and v[0:] == (5, 6) and v[-4:] == (5, 6) and bool(v) and not HistoryView(kept, 0)
    with pytest.raises(IndexError):
        v[2]
    assert (*v, 9) == (5, 6, 9)  # pending.fill's spelling
    p = SamplingParams(max_tokens=4, repetition_penalty=1.3, frequency_penalty=0.2)
    x = torch.randn(10)
    assert torch.equal(apply_penalties(x.clone(), v, p), apply_penalties(x.clone(), (5, 6), p))
