"""Draft-free speculation, core side: the n-gram drafter (imp.core.spec) and the scheduler's verify
shares, driven by test_scheduler_core's fake executor (it checks every position a sequence reads,
so a rejected draft's KV must be written over before anyone reads it) with a fake model that
repeats itself (a draft can be right) and sometimes does not (a draft can be wrong)."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

from imp.core import spec
from imp.core.spec import Drafter
from imp.messages import Constraint, FinishReason
from tests import test_scheduler_core as base
from tests.test_scheduler_core import EOS, Sim, params

CYCLE = [5, 9, 14, 3, 22, 17, 8, 11, 30, 2, 19]


def copying_token(seed: int, gen_index: int, seq_id: str) -> int:
    """A model that mostly repeats an 11-token cycle (from a seed-dependent phase), one token in
    seven off it: n-gram drafts are mostly right, sometimes wrong."""
    h = int.from_bytes(hashlib.sha256(f"{seed}/{gen_index}/{seq_id}".encode()).digest()[:4], "little")
    if h % 7 == 0:
        return 1 + h % 35
    return CYCLE[(seed + gen_index) % len(CYCLE)]


@pytest.fixture
def copying(monkeypatch):
    monkeypatch.setattr(base, "fake_token", copying_token)


def prompt(n: int, phase: int = 0) -> list[int]:
    return [CYCLE[(phase + i) % len(CYCLE)] for i in range(n)]


# --------------------------------------------------------------------------- the drafter


def test_prompt_hashed_at_once_indexes_as_token_by_token():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 50, 400).tolist()
    bulk, steps = Drafter(), Drafter()
    bulk._extend(toks, len(toks))
    for end in range(1, len(toks) + 1):
        steps._extend(toks, end)
    assert bulk.index == steps.index and bulk.indexed == steps.indexed == len(toks)
    looked = Drafter()  # as decoding calls it: a lookup a token, the suffix hashes reused as keys
    for end in range(1, len(toks) + 1):
        looked.propose(toks[:end], 4)
    assert looked.index == bulk.index


def test_draft_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    d = Drafter()
    # "1 2 3" is followed by 7 early on and by 8 later; the longer suffix "4 5 6 1 2 3" only by 9
    toks = [1, 2, 3, 7, 0, 4, 5, 6, 1, 2, 3, 9, 9, 9, 0, 1, 2, 3, 8, 8, 0, 4, 5, 6, 1, 2, 3]
    assert d.propose(toks, 3) == (9, 9, 9)
    d2 = Drafter()
    toks2 = [1, 2, 3, 7, 0, 0, 1, 2, 3, 8, 8, 0, 1, 2, 3]
    assert d2.propose(toks2, 2) == (8, 8)
    assert Drafter().propose([1, 2, 3, 4], 4) == ()  # nothing repeats
    assert Drafter().propose(toks, 0) == ()


def test_a_loop_drafts_as_far_as_asked_the_copy_overlapping_itself():
    """Where what followed the match runs into the end of the tokens (the sequence loops), the draft goes on as
    the copy would (LZ77's overlapping match): a loop of period p gives k tokens, not p."""
    def drafter(k):
        d = Drafter()
        d.k = k  # (as after kept drafts)
        return d

    assert drafter(8).propose([9, 5, 5, 5, 5, 5], 6) == (5,) * 6  # period 1 ("5 5 5" ended at 5: one token after)
    assert drafter(8).propose([0, 1, 2, 3, 1, 2, 3, 1, 2, 3], 8) == (1, 2, 3, 1, 2, 3, 1, 2)
    assert Drafter().propose([9, 5, 5, 5, 5, 5], 6) == (5,) * spec.K_START  # a new sequence's length still holds
    # a match whose continuation is longer than k: as before
    assert Drafter().propose([4, 5, 6, 7, 8, 9, 1, 4, 5, 6], 3) == (7, 8, 9)


def test_draft_length_adapts_and_misses_cool_it_down():
    d = Drafter()
    toks = prompt(40)
    assert len(d.propose(toks, 64)) == spec.K_START
    d.observe(4, 4)
    assert d.k == 8
    d.observe(8, 2)
    assert d.k == 3
    for _ in range(spec.WINDOW - 2):
        d.observe(3, 0)
    assert d.cool == spec.COOL_FIRST  # a window of misses: no drafts for a while
    assert [d.propose(toks, 8) for _ in range(spec.COOL_FIRST)] == [()] * spec.COOL_FIRST
    assert d.propose(toks, 8) != ()
    for _ in range(spec.WINDOW):
        d.observe(4, 0)
    assert d.cool == 2 * spec.COOL_FIRST  # missing again: twice as long



def test_pipelined_verifies_that_keep_less_than_a_token_each_cool_down():
    """Depth 2 (min_kept 1): a window of two-token drafts keeping 6 of 16 (above LOW_ACCEPT), 0.75 a verify,
    gives fewer tokens than decoding would (a verify costs its sequence a step there): it cools down; at depth 1
    (min_kept 0) the same window keeps drafting. A window keeping one token a verify goes on."""
    toks = prompt(40)
    for min_kept, kept, cools in ((1.0, 2 * [2, 0, 0] + [2, 0], True), (0.0, 2 * [2, 0, 0] + [2, 0], False),
                                  (1.0, [1] * spec.WINDOW, False)):
        d = Drafter(min_kept=min_kept)
        assert d.propose(toks, 64)
        for k in kept:
            d.observe(2, k)
        assert (d.cool > 0) == cools, (min_kept, kept)


# --------------------------------------------------------------------------- the scheduler


def _spec_params(**kw):
    return params(speculative=True, **kw)


def _verifies(sim) -> list:
    return [w for p in sim.plans for w in p.shares() if w.draft]


@pytest.mark.parametrize("depth", [1, 2])
def test_verify_shares_give_the_same_tokens(copying, depth):
    sim = Sim(num_blocks=64, max_context=256, max_step_tokens=32, spec_k_max=8, pipeline_depth=depth)
    for i in range(4):
        sim.submit(f"r{i}", prompt(20, i), _spec_params(max_tokens=60, seed=i, ignore_eos=True))
    sim.drain()
    for i in range(4):
        assert sim.output(f"r{i}") == sim.expected(f"r{i}", 0)
        fin = sim.finish[(f"r{i}", 0)]
        assert fin.finish == FinishReason.LENGTH and fin.completion_tokens == 60
        drafted, accepted, verifies = sim.spec[(f"r{i}", 0)]  # each TokenOut carries its verifies' counters
        assert verifies > 0 and 0 < accepted <= drafted
    vs = _verifies(sim)
    assert vs and max(w.draft for w in vs) > spec.K_START  # the draft grew while it was right
    assert len(vs) < 4 * 60 / 2  # most tokens came several a step
    assert sim.figures.kv.used == 0 and sim.figures.kv.reserved == 0


def test_without_speculation_no_drafts(copying):
    sim = Sim(num_blocks=64, max_context=256, max_step_tokens=32, spec_k_max=8)
    sim.submit("plain", prompt(20), params(max_tokens=30, ignore_eos=True))
    grammar = Constraint("regex", "[a-z]+")  # a grammar masks each drafted position (the runner's part)
    sim.submit("constrained", prompt(20, 3), _spec_params(max_tokens=30, ignore_eos=True, constraint=grammar))
    sim.drain()
    assert {w.seq_id for w in _verifies(sim)} == {"constrained#0"}
    assert sim.output("plain") == sim.expected("plain", 0)
    assert sim.output("constrained") == sim.expected("constrained", 0)
    off = Sim(num_blocks=64, max_context=256, max_step_tokens=32, spec_k_max=0)
    off.submit("asked", prompt(20), _spec_params(max_tokens=30, ignore_eos=True))
    off.drain()
    assert not _verifies(off) and off.output("asked") == off.expected("asked", 0)
    assert off.finish[("asked", 0)].spec_declined == "executor_cannot_verify"  # asked, and said why not
    assert sim.finish[("plain", 0)].spec_declined == ""  # not asked: nothing to say


def test_a_stop_inside_a_kept_draft_ends_the_choice_there(copying):
    # seed 0: the cycle from token 5; EOS (0) never comes from the cycle, so make the model say it
    # once, at a generated position well inside a run that drafts are right about
    stop_at = 30

    def token(seed, g, sid):
        return EOS if g == stop_at else copying_token(seed, g, sid)

    base_tok = base.fake_token
    base.fake_token = token
    try:
        sim = Sim(num_blocks=64, max_context=256, max_step_tokens=32, spec_k_max=8)
        sim.submit("s", prompt(20), _spec_params(max_tokens=60))
        sim.drain()
    finally:
        base.fake_token = base_tok
    out = sim.output("s")
    assert out[-1] == EOS and len(out) == stop_at + 1 and sim.finish[("s", 0)].finish == FinishReason.STOP
    assert sim.figures.kv.used == 0


@pytest.mark.parametrize("max_tokens", [23, 24, 25, 31])
def test_max_tokens_is_exact_with_drafts(copying, max_tokens):
    sim = Sim(num_blocks=64, max_context=256, max_step_tokens=32, spec_k_max=8)
    sim.submit("m", prompt(20), _spec_params(max_tokens=max_tokens, ignore_eos=True))
    sim.drain()
    assert sim.output("m") == sim.expected("m", 0) and len(sim.output("m")) == max_tokens
    assert all(w.start_pos + len(w.token_ids) - 1 < 20 + max_tokens for w in _verifies(sim))


def test_drafts_never_preempt_and_survive_preemption(copying):
    # a pool too small for all of them: preemptions happen, drafts take only blocks nobody needs
    sim = Sim(num_blocks=14, block_size=4, max_context=64, max_batch_size=4, max_step_tokens=16, spec_k_max=8,
              decode_reserve=0)
    for i in range(4):
        sim.submit(f"p{i}", prompt(8, i), _spec_params(max_tokens=24, seed=i, ignore_eos=True))
    sim.drain()
    for i in range(4):
        assert sim.output(f"p{i}") == sim.expected(f"p{i}", 0)
    assert _verifies(sim)
    assert sim.figures.kv.used == 0 and sim.figures.kv.reserved == 0


def test_the_budget_keeps_a_row_for_every_decode(copying):
    # 6 streams, 8 tokens a step: drafts may take only what is left after one row each
    sim = Sim(num_blocks=128, max_context=256, max_batch_size=6, max_step_tokens=8, spec_k_max=8)
    for i in range(6):
        sim.submit(f"b{i}", prompt(6, i), _spec_params(max_tokens=40, seed=i, ignore_eos=True))
    sim.drain()
    for i in range(6):
        assert sim.output(f"b{i}") == sim.expected(f"b{i}", 0)
    for p in sim.plans:
        decoding = [w for w in p.shares() if w.sample and len(w.token_ids) - w.draft == 1]
        assert sum(w.draft for w in p.shares()) <= 8 - len(decoding)


@pytest.mark.parametrize("depth", [1, 2])
def test_a_row_cap_keeps_every_step_within_it_and_shares_the_drafts_evenly(copying, depth):
    """spec_max_rows (a GPU's largest decode graph): a step's decode and drafted rows stay within it, each
    sequence the step may draft for gets an even share of the rows past the decode rows (not the first ones
    all of it), and the tokens are the ones without drafts."""
    sim = Sim(num_blocks=256, max_context=256, max_step_tokens=256, spec_k_max=8, spec_max_rows=16,
              pipeline_depth=depth)
    for i in range(5):
        sim.submit(f"c{i}", prompt(20, i), _spec_params(max_tokens=50, seed=i, ignore_eos=True))
    sim.drain()
    for i in range(5):
        assert sim.output(f"c{i}") == sim.expected(f"c{i}", 0)
    capped = 0
    for p in sim.plans:
        rows = [w for w in p.shares() if w.sample and len(w.token_ids) - w.draft == 1]
        assert len(rows) + sum(w.draft for w in rows) <= 16
        if len(rows) == 5:  # every sequence in the step: (16 - 5) // 5 = 2 drafted tokens each at most
            assert max(w.draft for w in rows) <= 2
            capped += any(w.draft for w in rows)
    assert _verifies(sim) and (capped or depth == 2)


@settings(max_examples=int(base.os.environ.get("IMP_SCHED_EXAMPLES", 200)), deadline=None)
@given(num_blocks=st.integers(8, 60), block_size=st.sampled_from([2, 4, 8]), batch=st.integers(1, 6),
       step_tokens=st.integers(2, 24), depth=st.sampled_from([1, 2]), k_max=st.integers(1, 12),
       rows_cap=st.sampled_from([0, 0, 3, 8]),
       reqs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 40), st.booleans(), st.integers(0, 10)),
                     min_size=1, max_size=6), fails=st.lists(st.integers(0, 60), max_size=2))
def test_any_pool_and_budget_gives_the_tokens_of_one_at_a_time(num_blocks, block_size, batch, step_tokens, depth,
                                                               k_max, rows_cap, reqs, fails):
    """Whatever the pool, budget, depth and draft cap (preemption, chunked prefill, failed steps
    included), every finished choice has the fake model's tokens and the pool ends empty."""
    sim = Sim(num_blocks=num_blocks, block_size=block_size, max_context=64, max_batch_size=batch,
              max_step_tokens=step_tokens, pipeline_depth=depth, spec_k_max=k_max, spec_max_rows=rows_cap,
              token=copying_token,
              decode_reserve=1)
    for i, (plen, max_tokens, eos, phase) in enumerate(reqs):
        sim.submit(f"h{i}", prompt(plen, phase), _spec_params(max_tokens=max_tokens, seed=i, ignore_eos=not eos))
    for k in range(5000):
        if not sim.step(fail=k in fails):
            break
    else:
        raise AssertionError("never idle")
    event(f"verify shares: {'none' if not _verifies(sim) else 'some'}")
    for (req, index), fin in sim.finish.items():
        if fin.finish in (FinishReason.LENGTH, FinishReason.STOP):
            assert sim.output(req, index) == sim.expected(req, index)
    sim.kv.audit()
    kvf = sim.kv.figures()
    assert kvf.used == kvf.pinned == 0


def test_step_cost_fits_the_line_and_prices_drafts():
    c = spec.StepCost()
    assert c.worth(1, 1, 0.5) == 1 << 16  # nothing measured: no cut
    for i in range(64):  # a CPU-like step: 10 ms for the weights + 2 ms a row
        rows = 1 + (i % 5) * 4
        c.observe(rows, int((10 + 2 * rows) * 1e6))
    assert abs(c.per_row_ms() - 2.0) < 1e-6
    # one stream: a token costs a 12 ms step; a row 2 ms: drafts pay while alpha^i x 12 > 2
    assert c.worth(1, 1, 0.9) == int(math.log(2 / 12) / math.log(0.9))  # 17
    assert c.worth(1, 1, 0.1) == 0  # 0.1 x 12 < 2: not even one
    # 16 streams: a 42 ms step, 2.6 ms a token, 2 ms a row: only a sure draft pays
    assert c.worth(16, 16, 0.5) == 0
    assert 0 < c.worth(16, 16, 0.97) < c.worth(1, 1, 0.97)
    flat = spec.StepCost()
    for _ in range(16):
        flat.observe(16, 40_000_000)
    assert flat.per_row_ms() is None  # rows never varied: the slope is unknown


def test_acceptance_estimate_follows_the_verifies():
    d = Drafter()
    assert d.alpha == 1.0  # untried: one draft to show what it copies
    for _ in range(6):
        d.observe(8, 8)
    high = d.alpha
    for _ in range(6):
        d.observe(8, 0)
    assert high > 0.9 and d.alpha < 0.35
    d.observe(8, 8)  # a run starts again: the last verify speaks for the next token at once
    assert d.alpha == 1.0
    d.observe(8, 6)
    assert d.alpha == 6 / 7


def test_a_stop_that_is_the_first_kept_draft_token_is_the_token_that_goes_out(copying):
    """A verify kept a draft whose first token is a stop (an end token copied from the prompt, say): the choice
    ends at it and the TokenOut carries it, not the token sampled after the draft (a one-token cut once sent that
    one: text after the end, and a wrong last token)."""
    from imp.messages import SampledToken, TokenBatch, TokenOut

    sim = Sim(num_blocks=64, max_context=256, max_step_tokens=32, spec_k_max=8)
    sim.submit("s", prompt(20), _spec_params(max_tokens=60))
    for _ in range(3):
        sim.step()
    (s,) = sim.sched.running
    n = len(s.tokens)
    out = []
    sim.sched._sampled(s, SampledToken(s.id, 7, accepted=(SampledToken(s.id, EOS), SampledToken(s.id, 9))), out)
    touts = [t for _, m in out for t in (m.each() if isinstance(m, TokenBatch) else (m,)) if isinstance(t, TokenOut)]
    assert [t.token_ids for t in touts] == [(EOS,)] and touts[0].finish == FinishReason.STOP
    assert s.tokens[n:] == [EOS]
