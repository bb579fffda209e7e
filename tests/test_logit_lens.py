"""The logit lens (params.logit_lens): the fused CPU forward run one layer at a time gives the one-call
forward's logits bit for bit, and each layer's lens is the final norm + LM head on that layer's residual
(held against numpy on the kept residual; the last layer's against the step's own logits)."""

from __future__ import annotations

import numpy as np
import pytest

from imp.messages import SamplingParams, SeqWork
from imp.model.runner import ModelRunner
from tests.fixtures.synth import write_synthetic_gguf


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def runner(request, tmp_path_factory):
    path = write_synthetic_gguf(tmp_path_factory.mktemp("lens") / f"{request.param}.gguf", arch=request.param,
                                n_layers=3, vocab=300, seed=4)
    return ModelRunner.load(path, kv_tokens=512)


def _works(lens: int, gen: int = 0):
    p = SamplingParams(max_tokens=8, repetition_penalty=1.0, logprobs=2, logit_lens=lens)
    return [SeqWork("a#0", tuple(range(3, 14)), 0, (0,), True, p),
            SeqWork("b#0", tuple(range(40, 47)), 0, (1,), True, SamplingParams(max_tokens=8))]


def test_layer_by_layer_is_the_one_call_forward_and_the_last_layer_is_the_step_s_distribution(runner):
    plain = runner.step(_works(0))
    runner.forget(["a#0", "b#0"])
    lensed = runner.step(_works(4))
    assert [t.token_id for t in lensed] == [t.token_id for t in plain]
    assert lensed[0].logprob == plain[0].logprob and lensed[0].top == plain[0].top  # the same bits
    lens = lensed[0].lens
    assert len(lens) == runner.config.n_layers and not lensed[1].lens  # the neighbour asked for none
    last = lens[-1]
    assert last.rank == 1 and abs(last.logprob - plain[0].logprob) < 1e-4  # greedy, no penalty: the raw row
    for x in lens:
        ids = [i for i, _ in x.top]
        lps = [lp for _, lp in x.top]
        assert len(ids) == 4 and lps == sorted(lps, reverse=True)
        assert x.rank >= 1 and x.logprob <= lps[0] + 1e-9 and x.entropy >= 0
        assert (x.rank == 1) == (x.logprob >= lps[0] - 1e-12)


def test_a_layer_s_lens_is_the_head_on_its_residual(runner):
    m = runner.model
    tokens = np.arange(5, 12, dtype=np.int64)
    from imp.model import paged

    plan = paged.rows_plan([0], [len(tokens)], [(2,)], runner.block_size)
    logits, resid = m.forward(tokens, plan, runner.cache, keep_rows=[len(tokens) - 1])
    assert resid.shape == (runner.config.n_layers, 1, runner.config.d_model)
    tok = int(np.argmax(logits[0]))
    got = m.lens(resid[:, 0], tok, 3)
    for layer, (rank, lp, ent, top) in enumerate(got):
        r = resid[layer, 0].astype(np.float64)
        h = r / np.sqrt((r * r).mean() + runner.config.rms_eps) * m.out_norm
        z = m.head_logits(h[None].astype(np.float32))[0].astype(np.float64)
        if m.final_softcap:
            z = np.tanh(z / m.final_softcap) * m.final_softcap
        ref = z - z.max() - np.log(np.exp(z - z.max()).sum())
        assert abs(lp - ref[tok]) < 2e-3 and rank == 1 + int((ref > ref[tok]).sum())
        assert abs(ent + (np.exp(ref) * ref).sum()) < 2e-3
        assert [i for i, _ in top] == list(np.argsort(-ref, kind="stable")[:3])
    assert got[-1][0] == 1  # the final layer's lens is the step's own argmax


def test_the_top_n_bound_keeps_every_top_value_ties_included():
    from imp.model.fused import _kth_bound

    rng = np.random.default_rng(1)
    z = np.round(rng.standard_normal((6, 4096)), 1).astype(np.float32)  # many ties
    for k in (1, 5, 20):
        thr = _kth_bound(z, k)
        for row, t in zip(z, thr):
            kth = np.sort(row)[::-1][k - 1]
            assert t <= kth and (row >= t).sum() < 600  # every top-k value passes; few others do
