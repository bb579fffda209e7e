"""Banned strings and regexes (imp.core.banned): the watch on its own, then the scheduler's rewinds
driven by the fake executor of test_scheduler_core (its KV memory checks every position a sequence
attends to), against a plain-Python rewind loop that knows nothing of the scheduler."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from imp.core.banned import MAX_REWINDS, BanWatch, Texts
from imp.messages import FinishReason, TokenTexts
from tests.test_scheduler_core import EOS, VOCAB, Sim, ids, params

# the fake vocabulary's text: EOS empty, 1..26 a letter, 27.. two letters
TEXTS = [b""] + [bytes([97 + i]) for i in range(26)] + [bytes([97 + i, 98 + i]) for i in range(VOCAB - 27)]


def token_texts(texts=TEXTS) -> TokenTexts:
    offsets = np.zeros(len(texts) + 1, dtype="<i8")
    np.cumsum([len(t) for t in texts], out=offsets[1:])
    return TokenTexts(b"".join(texts), offsets.tobytes())


def watch(strings=(), regexes=(), texts=TEXTS) -> BanWatch:
    t = token_texts(texts)
    return BanWatch(Texts(t.blob, t.offsets), tuple(strings), tuple(regexes))


def tok(ch: str) -> int:
    return TEXTS.index(ch.encode())


# --------------------------------------------------------------------------- the watch


def test_a_phrase_across_tokens_is_found_where_it_starts_without_case():
    w = watch(["BCD"])
    assert w.push(tok("a")) is None and w.safe() == 1  # "a": no phrase starts with it
    assert w.push(tok("b")) is None and w.safe() == 1  # "b" may start "bcd": held
    assert w.push(tok("cd")) == 1  # completed: it started in generated token 1
    w.rewind(1)
    assert bytes(w.buf) == b"a" and w.ends == [1] and w.rewinds == 1


def test_the_hold_back_is_the_longest_tail_a_phrase_may_still_complete():
    w = watch(["abc", "cx"])
    for ch in "zab":
        assert w.push(tok(ch)) is None
    assert w.safe() == 1  # "ab" may become "abc"
    assert w.push(tok("z")) is None and w.safe() == 4  # "abz": nothing can complete any more
    assert w.push(tok("c")) is None and w.safe() == 4  # "c" may start "cx"


def test_a_match_must_end_in_the_new_token():
    w = watch(["b"])
    assert w.push(tok("a")) is None
    assert w.push(tok("b")) == 1
    w.rewind(1)
    assert w.push(tok("c")) is None  # the old "b" is gone with the rewind


def test_regexes_hold_255_bytes_and_find_the_leftmost_match_reaching_the_new_text():
    w = watch(regexes=[r"b+c"])
    for ch in "abbb":
        assert w.push(tok(ch)) is None
    assert w.safe() == 0  # 4 bytes, all within the 255 held back
    assert w.push(tok("c")) == 1  # "bbbc" starts at generated token 1
    w2 = watch(regexes=[r"\d", "zz"])
    assert w2.push(tok("z")) is None and w2.push(tok("z")) == 0


def test_after_the_last_rewind_the_phrases_pass():
    w = watch(["b"])
    for _ in range(MAX_REWINDS):
        assert w.push(tok("b")) == 0
        w.rewind(0)
    assert w.push(tok("b")) is None and w.safe() == 1


def test_special_tokens_are_empty_text_and_never_complete_anything():
    w = watch(["a"])
    assert w.push(EOS) is None and w.safe() == 1


# --------------------------------------------------------------------------- the scheduler's rewinds


def reference(sim: Sim, req_id: str, index: int, phrases: tuple[str, ...]) -> list[int]:
    """A plain rewind loop: draw, look for a phrase (no case) ending in the new token's text, rewind to the
    token it starts in and ban that token there; after MAX_REWINDS the phrases pass."""
    m = sim.submits[req_id]
    seed, sid = m.params.seed + index, f"{req_id}#{index}"
    low = [p.encode().lower() for p in phrases]
    out: list[int] = []
    bans: dict[int, tuple[int, ...]] = {}
    rewinds = 0
    while True:
        g = len(out)
        t = sim.draw(seed, g, sid, bans.get(g, ()))
        out.append(t)
        text = b"".join(TEXTS[x] for x in out).lower()
        new_from = len(text) - len(TEXTS[t])
        starts = [i for p in low for i in range(len(text)) if text[i:i + len(p)] == p and i + len(p) > new_from]
        if starts and len(TEXTS[t]) and rewinds < MAX_REWINDS:
            b, ends, keep = min(starts), np.cumsum([len(TEXTS[x]) for x in out]), 0
            keep = int(np.searchsorted(ends, b, side="right"))
            bans = {k: v for k, v in bans.items() if k < keep}
            bans[keep] = bans.get(keep, ()) + (out[keep],)
            out = out[:keep]
            rewinds += 1
            continue
        if t in m.params.stop_token_ids and not m.params.ignore_eos:
            return out
        if len(out) >= m.params.max_tokens or len(m.prompt) + len(out) >= sim.max_len:
            return out


def banned_sim(**kw) -> Sim:
    sim = Sim(**kw)
    sim._collect(sim.router.send([("ingress", "scheduler", token_texts())]))
    return sim


def _text(toks) -> bytes:
    return b"".join(TEXTS[t] for t in toks).lower()


@pytest.mark.parametrize("depth", [1, 2])
def test_rewinds_give_the_plain_loop_s_tokens_and_no_phrase_goes_out(depth):
    phrases = ("bc", "Q", "dex")
    sim = banned_sim(num_blocks=64, max_context=256, pipeline_depth=depth, history_once=True)
    for i in range(6):
        sim.submit(f"r{i}", ids(5 + i), params(max_tokens=40, seed=i, ignore_eos=i % 2 == 0, banned_strings=phrases))
    sim.submit("plain", ids(7), params(max_tokens=30, seed=9))  # a neighbour without phrases: untouched
    sim.drain()
    assert sim.sched.rewinds > 0
    for i in range(6):
        got = sim.output(f"r{i}")
        assert got == reference(sim, f"r{i}", 0, phrases), i
        assert not any(p.lower().encode() in _text(got) for p in phrases)
    assert sim.output("plain") == sim.expected("plain", 0)
    assert sim.figures.kv.used == 0 and sim.figures.kv.reserved == 0


def test_held_tokens_go_out_with_the_end_and_completion_tokens_count_the_kept_ones():
    sim = banned_sim(num_blocks=64, max_context=256)
    sim.submit("a", ids(4), params(max_tokens=25, seed=3, ignore_eos=True, banned_strings=("abcdefgh",)))
    sim.drain()
    fin = sim.finish[("a", 0)]
    assert fin.finish is FinishReason.LENGTH and fin.completion_tokens == 25 == len(sim.output("a"))


def test_rewinds_under_preemption_and_with_siblings():
    """A pool too small for everyone: preempted and rewound sequences, n = 2, all as the plain loop says."""
    phrases = ("ab", "k")
    sim = banned_sim(num_blocks=14, block_size=4, max_context=64, max_batch_size=4, decode_reserve=1)
    for i in range(4):
        sim.submit(f"r{i}", ids(6), params(max_tokens=30, seed=10 + i, ignore_eos=True, banned_strings=phrases),
                   n=2 if i == 1 else 1)
    sim.drain()
    for i in range(4):
        for k in range(2 if i == 1 else 1):
            assert sim.output(f"r{i}", k) == reference(sim, f"r{i}", k, phrases), (i, k)
    assert sim.figures.kv.used == 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), phrase=st.text(alphabet="abcdefg", min_size=1, max_size=4),
       depth=st.sampled_from([1, 2]))
def test_any_phrase_any_seed(seed, phrase, depth):
    sim = banned_sim(num_blocks=32, max_context=128, pipeline_depth=depth, history_once=True)
    sim.submit("a", ids(5), params(max_tokens=30, seed=seed, ignore_eos=True, banned_strings=(phrase,)))
    sim.drain()
    got = sim.output("a")
    assert got == reference(sim, "a", 0, (phrase,))
    if sim.sched.rewinds < MAX_REWINDS:
        assert phrase.encode() not in _text(got)
    assert sim.figures.kv.used == 0
