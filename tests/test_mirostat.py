"""Mirostat (imp.sampling.mirostat) against a plain transliteration of llama.cpp's v1 and v2 (the cut and the mu
update for the drawn token), the runner-side state, and the sampler's use of it: a seed gives the same
tokens, mu follows the draws, logprobs are those of the cut distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest

from imp.messages import SamplingParams, SeqWork
from imp.sampling import cpu, mirostat


def llama_cut(logits: np.ndarray, version: int, mu: float) -> list[tuple[int, float]]:
    """llama.cpp's llama_sampler_mirostat(_v2)_apply up to the draw, in plain Python floats: the (id, p) kept."""
    cand = sorted(((float(v), i) for i, v in enumerate(logits)), key=lambda c: -c[0])
    mx = cand[0][0]
    ex = [math.exp(v - mx) for v, _ in cand]
    tot = sum(ex)
    p = [e / tot for e in ex]
    if version == 2:
        n = next((j for j, q in enumerate(p) if -math.log2(q) > mu), len(p)) or 1
    else:
        m = min(99, len(p) - 1)
        t = [math.log((i + 2) / (i + 1)) for i in range(m)]
        b = [math.log(p[i] / p[i + 1]) for i in range(m)]
        s_hat = sum(x * y for x, y in zip(t, b)) / sum(x * x for x in t)
        eps = s_hat - 1
        k = ((eps * 2 ** mu) / (1 - len(logits) ** -eps)) ** (1 / s_hat)
        n = max(int(k), 1) if k < len(p) else len(p)
    kept = cand[:n]
    ex = [math.exp(v - kept[0][0]) for v, _ in kept]
    return [(i, e / sum(ex)) for (_, i), e in zip(kept, ex)]


@pytest.mark.parametrize("version", [1, 2])
def test_the_cut_and_mu_follow_llama_cpp(version):
    rng = np.random.default_rng(version)
    for trial in range(40):
        x = (rng.standard_normal(500) * rng.uniform(0.5, 4)).astype(np.float32)
        mu = float(rng.uniform(0.5, 12))
        ids, p = mirostat.cut(x, version, mu)
        want = llama_cut(x, version, mu)
        assert len(ids) == len(want), (trial, len(ids), len(want))  # float32 vs double: the same cut here
        assert ids.tolist() == [i for i, _ in want]
        assert np.allclose(p, [q for _, q in want], rtol=1e-5, atol=1e-7)
        u = float(rng.uniform())
        tok, _, probs, mu2 = mirostat.sample(x, version, 5.0, 0.1, mu, u, greedy=False)
        j = ids.tolist().index(tok)
        assert mu2 == pytest.approx(mu - 0.1 * (-math.log2(probs[j]) - 5.0), rel=1e-6, abs=1e-6)


def test_sampler_draws_reproducibly_and_keeps_mu():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 300)).astype(np.float32) * 3
    p = SamplingParams(max_tokens=8, temperature=0.9, seed=11, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.3,
                       logprobs=2, top_k=5)  # top_k does not apply under mirostat (llama.cpp's chain)
    mu, toks, mus = None, [], []
    for g in range(6):
        t = cpu.sample_one(logits[g], SeqWork("s", (1,), 0, (0,), True, p, gen_index=g, mu=mu))
        toks.append(t.token_id)
        mus.append(t.mu)
        mu = t.mu
        assert t.logprob <= 0 and len(t.top) == 2 and t.top[0][1] >= t.top[1][1]
    again = []
    mu = None
    for g in range(6):
        t = cpu.sample_one(logits[g], SeqWork("s", (1,), 0, (0,), True, p, gen_index=g, mu=mu))
        again.append(t.token_id)
        mu = t.mu
    assert again == toks and mus[0] != 6.0 and len(set(mus)) > 1
    # the first draw starts at 2 tau; a greedy one keeps the argmax and raises mu by eta tau
    g = SamplingParams(max_tokens=8, temperature=0.0, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.3)
    t = cpu.sample_one(logits[0], SeqWork("s", (1,), 0, (0,), True, g))
    assert t.token_id == int(np.argmax(logits[0])) and t.mu == pytest.approx(6.0 + 0.3 * 3.0)
    # top_k really is off: with mu large the cut keeps more than 5 tokens, and draws may fall outside the top 5
    wide = SamplingParams(max_tokens=8, temperature=1.0, seed=1, mirostat=2, mirostat_tau=20.0, top_k=5)
    top5 = set(np.argsort(-logits[1])[:5].tolist())
    drawn = {cpu.sample_one(logits[1], SeqWork("s", (1,), 0, (0,), True, wide, gen_index=i)).token_id
             for i in range(60)}
    assert drawn - top5


def test_runner_state_fill_keep_forget():
    st = mirostat.MirostatState()
    p = SamplingParams(max_tokens=4, temperature=1.0, mirostat=2)
    plain = SamplingParams(max_tokens=4)
    first = SeqWork("a", (1,), 0, (0,), True, p, mu=6.0)
    assert st.fill([first]) == [first] and len(st) == 1  # the scheduler's mu: kept
    from imp.messages import SampledToken

    st.keep([SampledToken("a", 5, mu=4.5), SampledToken("b", 2)])
    nxt = st.fill([SeqWork("a", (5,), 1, (0,), True, p), SeqWork("b", (2,), 1, (0,), True, plain)])
    assert nxt[0].mu == 4.5 and nxt[1].mu is None
    st.forget(["a"])
    assert len(st) == 0 and st.fill([SeqWork("a", (5,), 1, (0,), True, p)])[0].mu is None
