"""Classifier-free guidance (params.cfg_scale, imp.core.guide): every token of a guided choice is drawn in a
step where its shadow's share ends at the same generated index (the fake executor of test_scheduler_core
checks it, and every position each sequence attends to), under pipelining, preemption and neighbours; the
runner's row is l_b + s (l_a - l_b) of the two rows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from imp.messages import FinishReason, SamplingParams, SeqWork
from imp.sampling.cpu import apply_guidance
from tests.test_scheduler_core import Sim, ids, params


def _guided_samples(sim: Sim, req: str) -> tuple[int, int]:
    """(sampling shares of the choice, those that named its shadow)."""
    shares = [w for plan in sim.plans for w in plan.shares() if w.seq_id == f"{req}#0" and w.sample]
    return len(shares), sum(w.guide == f"{req}#0.cfg" for w in shares)


@pytest.mark.parametrize("depth", [1, 2])
def test_every_token_of_a_guided_choice_is_drawn_beside_its_shadow(depth):
    sim = Sim(num_blocks=64, max_context=256, max_step_tokens=24, pipeline_depth=depth, history_once=True)
    for i in range(3):  # shadow prompts shorter, longer and as long as the choice's
        sim.submit(f"g{i}", ids(20 + i), params(max_tokens=20, seed=i, ignore_eos=True, cfg_scale=1.5),
                   cfg_prompt=ids((10, 37, 21)[i], base=5))
    sim.submit("plain", ids(9), params(max_tokens=15, seed=7))
    sim.drain()
    for i in range(3):
        assert sim.output(f"g{i}") == sim.expected(f"g{i}", 0)  # the fake model ignores the guidance
        n, guided = _guided_samples(sim, f"g{i}")
        assert n == guided == 20, (i, n, guided)
    assert sim.output("plain") == sim.expected("plain", 0)
    assert not any(w.guide for plan in sim.plans for w in plan.shares() if w.seq_id.startswith("plain"))
    assert sim.figures.kv.used == 0 and sim.figures.kv.reserved == 0 and sim.finished.keys() == {"g0", "g1", "g2",
                                                                                                  "plain"}


def test_guided_pairs_under_preemption_and_cancel():
    sim = Sim(num_blocks=20, block_size=4, max_context=64, max_batch_size=6, max_step_tokens=16, decode_reserve=1)
    for i in range(4):
        sim.submit(f"g{i}", ids(8), params(max_tokens=25, seed=20 + i, ignore_eos=True, cfg_scale=3.0),
                   cfg_prompt=ids(6, base=9))
    for _ in range(12):
        sim.step()
    sim.cancel("g3")
    sim.drain()
    assert sim.sched.preemptions > 0
    for i in range(3):
        assert sim.output(f"g{i}") == sim.expected(f"g{i}", 0)
        n, guided = _guided_samples(sim, f"g{i}")
        assert guided == n >= 25  # a preempted choice samples again (the same tokens), always beside its shadow
    assert sim.figures.kv.used == 0 and not sim.sched.running and not sim.sched.waiting


def test_the_runner_samples_l_b_plus_s_times_l_a_minus_l_b():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    la, lb, other = logits.copy()
    p = SamplingParams(max_tokens=4, cfg_scale=2.5)
    works = [SeqWork("a#0", (1,), 0, (0,), True, p, guide="a#0.cfg"),
             SeqWork("a#0.cfg", (1,), 0, (1,), True, SamplingParams(max_tokens=4)),
             SeqWork("b#0", (1,), 0, (2,), True, SamplingParams(max_tokens=4))]
    apply_guidance(logits, works)
    assert np.allclose(logits[0], lb + 2.5 * (la - lb)) and (logits[1] == lb).all() and (logits[2] == other).all()


def test_a_guided_step_on_a_real_forward_samples_from_the_combined_row(tmp_path):
    """The CPU runner, one step of two prompts: the choice's logprob is that of log_softmax(l_b + s (l_a - l_b)),
    l_a and l_b each prompt's own last-row logits (separate forwards)."""
    from imp.model.runner import ModelRunner
    from tests.fixtures.synth import write_synthetic_gguf

    r = ModelRunner.load(write_synthetic_gguf(tmp_path / "g.gguf", n_layers=2, vocab=300, seed=3), kv_tokens=256)
    a, b = tuple(range(3, 15)), tuple(range(50, 57))
    plain = SamplingParams(max_tokens=4, repetition_penalty=1.0)
    la = r.forward([SeqWork("x#0", a, 0, (0,), True, plain)])[0].astype(np.float64)
    lb = r.forward([SeqWork("y#0", b, 0, (1,), True, plain)])[0].astype(np.float64)
    guided = SamplingParams(max_tokens=4, repetition_penalty=1.0, logprobs=3, cfg_scale=2.0)
    out = r.step([SeqWork("g#0", a, 0, (2,), True, guided, guide="g#0.cfg"),
                  SeqWork("g#0.cfg", b, 0, (3,), True, plain)])
    z = lb + 2.0 * (la - lb)
    ref = z - z.max() - np.log(np.exp(z - z.max()).sum())
    assert out[0].token_id == int(np.argmax(z)) and abs(out[0].logprob - ref.max()) < 1e-3
    assert [i for i, _ in out[0].top] == list(np.argsort(-ref, kind="stable")[:3])


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), step=st.sampled_from([6, 8, 12, 24]), depth=st.sampled_from([1, 2]),
       lens=st.tuples(st.integers(3, 40), st.integers(3, 40), st.integers(3, 40)), blocks=st.sampled_from([14, 40]))
def test_guided_pairs_under_any_budget_pool_and_prompt_lengths(seed, step, depth, lens, blocks):
    """Small step budgets (a choice sits out while its shadow catches up: no op and no share of its own),
    pipelining, a pool that preempts: the tokens are the unguided ones, each drawn beside its shadow."""
    sim = Sim(num_blocks=blocks, block_size=4, max_context=96, max_batch_size=4, max_step_tokens=step,
              pipeline_depth=depth, history_once=True, decode_reserve=1)
    sim.submit("g", ids(lens[0]), params(max_tokens=12, seed=seed, ignore_eos=True, cfg_scale=2.0),
               cfg_prompt=ids(lens[1], base=7))
    sim.submit("p", ids(lens[2], base=11), params(max_tokens=10, seed=seed + 1, ignore_eos=True))
    sim.drain()
    assert sim.output("p") == sim.expected("p", 0)
    if "g" in sim.rejected:  # the two prompts do not fit the pool together: a 400 at admission
        assert sim.rejected["g"].code == "context_length_exceeded" and (lens[0] + lens[1]) // 4 >= blocks - 2
    else:
        got, want = sim.output("g"), sim.expected("g", 0)
        assert got == want[:len(got)] and sim.finish[("g", 0)].finish is FinishReason.LENGTH
        if len(got) < 12:  # ended early: the pair outgrew the whole pool (it cannot be run together any more)
            assert -(-(lens[0] + len(got) + 2) // 4) + -(-(lens[1] + len(got) + 2) // 4) > blocks
        n, guided = _guided_samples(sim, "g")
        assert n == guided >= len(got)
    assert sim.figures.kv.used == 0 and not sim.sched.running and not sim.sched.waiting
