"""The sampling params as columns by slot (imp.sampling.rowparams, the GPU runner's): a step's columns are the
rows' params; a re-admission's new params object refills its slot; forgotten slots are reused; the sampler fed
the columns (`draw_ids(..., step=)`) draws what it draws from each row's params — greedy rows with penalties (the
counts on the device, tokens in flight) on CPU tensors here; sampled rows and logit bias (CUDA kernels) in the GPU
lane."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from imp.messages import SamplingParams, SeqWork
from imp.sampling.devcounts import DeviceCounts
from imp.sampling.gpu import draw_ids, sample_ids
from imp.sampling.rowparams import F_FREQ, F_MIN_P, F_PRES, F_REP, F_TEMP, F_TOP_P, I_SEED, I_TOP_K, RowParams


def _w(sid, p, gen=1, pending=0, hist=()):
    return SeqWork(sid, (3,), 10, (0,), True, p, gen_index=gen, pending=pending, history=hist)


def test_the_columns_are_the_rows_params_and_slots_follow_the_sequences():
    rp = RowParams("cpu", cap=2)
    a = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=11,
                       repetition_penalty=1.05, presence_penalty=0.5, frequency_penalty=0.25)
    b = SamplingParams(max_tokens=9, logit_bias=((3, 1.0),))
    c = SamplingParams(max_tokens=9, logprobs=2)
    st = rp.take([_w("a", a, 4, 1), _w("b", b, 2), _w("c", c)])
    assert st.gen.tolist() == [4, 2, 1] and st.pending.tolist() == [1, 0, 0]
    assert st.greedy.tolist() == [False, True, True] and st.plain.tolist() == [False, False, False]
    assert st.penalized.tolist() == [True, False, False] and st.bias.tolist() == [False, True, False]
    assert st.host.tolist() == [False, False, True] and st.hist.tolist() == [True, False, False]
    f, i = st.f[0].tolist(), st.i[0].tolist()
    assert f[F_TEMP] == pytest.approx(0.7) and f[F_TOP_P] == pytest.approx(0.9) and f[F_MIN_P] == pytest.approx(0.05)
    assert [f[F_REP], f[F_PRES], f[F_FREQ]] == pytest.approx([1.05, 0.5, 0.25]) and i == [40, 11]
    assert st.f[1, F_TEMP] == 1.0 and st.i[1, I_SEED] == 0 and st.i[1, I_TOP_K] == 0  # greedy: temperature 1
    sa = rp.slots.of["a"]
    a2 = SamplingParams(max_tokens=9, seed=12)  # re-admitted with params sent again: the slot refilled
    st = rp.take([_w("a", a2)])
    assert rp.slots.of["a"] == sa and st.plain.tolist() == [True] and st.i[0, I_SEED] == 12
    rp.forget(["b"])
    st = rp.take([_w("d", b)])
    assert rp.slots.of["d"] == st.slots[0] and "b" not in rp.slots.of and st.bias.tolist() == [True]


def test_the_sampler_with_columns_draws_what_it_draws_row_by_row():
    rng = random.Random(2)
    V = 37
    ps = [SamplingParams(max_tokens=99), SamplingParams(max_tokens=99, repetition_penalty=1.3),
          SamplingParams(max_tokens=99, presence_penalty=0.7, frequency_penalty=0.2),
          SamplingParams(max_tokens=99, frequency_penalty=0.1)]
    rp, counts = RowParams("cpu"), [DeviceCounts(V, "cpu"), DeviceCounts(V, "cpu")]
    hists = {f"s{k}": [rng.randrange(V) for _ in range(3)] for k in range(8)}
    prev = None
    for step in range(6):
        works = [_w(sid, ps[k % 4], gen=len(h) + (prev is not None), pending=int(prev is not None), hist=tuple(h))
                 for k, (sid, h) in enumerate(hists.items())]
        logits = torch.randn(len(works), V) * 4
        pend = (list(range(len(works))), prev, list(range(len(works)))) if prev is not None else None
        outs = []
        for c, st in ((counts[0], None), (counts[1], rp.take(works))):
            c.drop_taken()
            ids, tokens = draw_ids(logits.clone(), works, False, pend, c, st)
            c.record(ids)
            outs.append(ids)
            if st is not None:
                _, x_cols = sample_ids(logits.clone(), works, False, None, None, st)
                _, x_rows = sample_ids(logits.clone(), works, False, None, None)
                assert torch.equal(x_cols, x_rows)
        assert torch.equal(outs[0], outs[1]), step
        if prev is not None:
            for k, h in enumerate(hists.values()):
                h.append(int(prev[k]))
        prev = outs[0].to(torch.int32)
    assert counts[1].slot == counts[0].slot and counts[1].n.tolist() == counts[0].n.tolist()


@pytest.mark.gpu
def test_sampled_rows_with_columns_draw_the_same_on_the_device():
    from imp.kernels.cuda import runtime

    if not runtime.available():
        pytest.skip("no CUDA / CuPy")
    V = 1000
    ps = [SamplingParams(max_tokens=9, temperature=t, top_k=k, top_p=p, min_p=m, seed=s, repetition_penalty=r)
          for t, k, p, m, s, r in [(0.8, 0, 1.0, 0.0, 1, 1.0), (1.2, 40, 0.9, 0.0, 2, 1.1), (0.0, 0, 1.0, 0.0, 3, 1.0),
                                   (0.5, 5, 1.0, 0.1, 4, 1.0)]]
    ps[3] = SamplingParams(max_tokens=9, temperature=0.5, top_k=5, min_p=0.1, seed=4, logit_bias=((7, 5.0), (7, 1.0)))
    works = [_w(f"s{k}", ps[k % 4], gen=k + 1, hist=(1, 2, 3)) for k in range(16)]
    logits = torch.randn(16, V, device="cuda") * 3
    rp = RowParams("cuda")
    a, xa = sample_ids(logits.clone(), works, True, None, None)
    b, xb = sample_ids(logits.clone(), works, True, None, None, rp.take(works))
    assert torch.equal(a, b) and torch.equal(xa, xb)
    assert np.unique(a.cpu().numpy()).size > 1
