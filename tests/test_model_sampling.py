"""Sampling functions: filters, penalties, determinism, logprobs."""

import math
from imp.messages import SamplingParams, SeqWork
from imp.sampling import cpu as S

import numpy as np
import torch

V = 100


def work(seq="s", gen_index=0, history=(), **kw):
    return SeqWork(seq, [0], 0, [0], True, SamplingParams(max_tokens=4, **kw), gen_index, list(history))


def logits(seed=0):
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = torch.stack([logits(0), logits(1)])
    out = S.sample(x, [work("a"), work("b")])
    assert [t.token_id for t in out] == x.argmax(-1).tolist()
    assert [t.seq_id for t in out] == ["a", "b"]


def test_draw_depends_only_on_seed_and_gen_index():
    x = logits()
    a = [S.sample_one(x, work(gen_index=i, temperature=1.0, seed=7)).token_id for i in range(20)]
    b = [S.sample_one(x, work(gen_index=i, temperature=1.0, seed=7)).token_id for i in range(20)]
    c = [S.sample_one(x, work(gen_index=i, temperature=1.0, seed=8)).token_id for i in range(20)]
    assert a == b and a != c
    # batch position does not matter
    both = S.sample(torch.stack([logits(5), x]), [work("z", temperature=1.0), work(gen_index=3, temperature=1.0, seed=7)])
    assert both[1].token_id == a[3]


def test_top_k_one_is_greedy_and_filters_hold():
    x = logits()
    for i in range(10):
        assert S.sample_one(x, work(gen_index=i, temperature=2.0, top_k=1)).token_id == int(x.argmax())
    top5 = set(torch.topk(x, 5).indices.tolist())
    for i in range(30):
        assert S.sample_one(x, work(gen_index=i, temperature=5.0, top_k=5)).token_id in top5


def test_top_p_and_min_p_keep_the_head():
    x = torch.full((V,), -10.0)
    x[3], x[4] = 5.0, 4.0  # ~0.73 / 0.27 of the mass
    for i in range(30):
        assert S.sample_one(x, work(gen_index=i, temperature=1.0, top_p=0.5)).token_id == 3
        assert S.sample_one(x, work(gen_index=i, temperature=1.0, min_p=0.5)).token_id == 3
        assert S.sample_one(x, work(gen_index=i, temperature=1.0, top_p=0.9)).token_id in (3, 4)


def test_penalties_and_bias():
    x = torch.zeros(V)
    x[10], x[11] = 2.0, 1.9
    assert S.sample_one(x, work()).token_id == 10
    assert S.sample_one(x, work(history=[10], repetition_penalty=1.5)).token_id == 11
    assert S.sample_one(x, work(history=[10], presence_penalty=0.5)).token_id == 11
    assert S.sample_one(x, work(history=[10, 10], frequency_penalty=0.1)).token_id == 11
    assert S.sample_one(x, work(logit_bias=((42, 100.0),))).token_id == 42


def test_logprobs_finite_sorted_and_consistent():
    x = logits()
    t = S.sample_one(x, work(temperature=1.0, top_k=3, logprobs=5))
    assert len(t.top) == 5
    vals = [lp for _, lp in t.top]
    assert vals == sorted(vals, reverse=True)
    assert all(math.isfinite(v) for v in vals) and math.isfinite(t.logprob)
    assert vals[3] == S.LOGPROB_FLOOR  # filtered out by top_k: floored, not -inf
    assert t.logprob == dict(t.top)[t.token_id]
    g = S.sample_one(x, work(logprobs=0))
    assert g.top == () and abs(g.logprob - torch.log_softmax(x, -1).max().item()) < 1e-5


def test_penalties_touch_only_the_history_and_match_the_dense_form():
    """apply_penalties gathers the history's tokens only; the dense form over the whole row (HF's
    semantics: divide positive logits, multiply negative ones, then presence, then frequency)
    is the reference, bit for bit."""
    import random

    from imp.messages import SamplingParams
    from imp.sampling.cpu import apply_penalties

    def dense(logits, history, p):
        ids = torch.tensor(history, dtype=torch.int64)
        counts = torch.bincount(ids, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        seen, out = counts > 0, logits
        if p.repetition_penalty != 1.0:
            r = p.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        if p.presence_penalty != 0.0:
            out = out - p.presence_penalty * seen.to(out.dtype)
        if p.frequency_penalty != 0.0:
            out = out - p.frequency_penalty * counts
        return out

    rng = random.Random(0)
    for _ in range(200):
        V = rng.choice([50, 1000, 49152])
        x = torch.randn(V, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) * 5
        x[rng.randrange(V)] = 0.0
        hist = [rng.randrange(V) for _ in range(rng.randrange(1, 300))]
        p = SamplingParams(max_tokens=1, repetition_penalty=rng.choice([1.0, 1.05, 1.3, 0.9]),
                           presence_penalty=rng.choice([0.0, 0.3, -1.2]), frequency_penalty=rng.choice([0.0, 0.7, -0.4]))
        before = x.clone()
        assert torch.equal(torch.from_numpy(apply_penalties(x, hist, p)), dense(x, hist, p))
        assert torch.equal(x, before)  # the caller's row is not changed in place


def test_argmax_is_torchs_first_maximum_ties_and_nan_included():
    g = torch.Generator().manual_seed(3)
    for x in (torch.randn(262144, generator=g), torch.tensor([1.0, 3.0, 3.0, 2.0]),
              torch.tensor([1.0, float("nan"), 5.0, float("nan")]), torch.full((7,), -float("inf"))):
        assert S.argmax(x) == int(torch.argmax(x))
    rows = torch.randn(3, 1000, generator=g)
    rows[1, 10] = rows[1, 20] = rows[1].max() + 1
    w = SeqWork("s", (1,), 0, (0,), True, SamplingParams(max_tokens=1, temperature=0.0, repetition_penalty=1.0))
    assert [t.token_id for t in S.sample(rows, [w] * 3)] == torch.argmax(rows, dim=-1).tolist()


def test_owned_logits_are_penalized_in_place_and_others_never():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5000, generator=g)
    hist = tuple(int(i) for i in torch.topk(logits[0], 30).indices)  # the history holds the top tokens
    w = SeqWork("s", (1,), 0, (0,), True, SamplingParams(max_tokens=1, temperature=0.0, repetition_penalty=1.8),
                history=hist)
    before = logits.clone()
    want = [t.token_id for t in S.sample(logits, [w, w])]
    assert torch.equal(logits, before)  # not owned: untouched
    assert want[0] not in hist[:1]  # the penalty changed the choice
    got = [t.token_id for t in S.sample(logits.numpy(), [w, w], own=True)]
    assert got == want and not torch.equal(logits, before)  # owned: same tokens, penalized in place


def _torch_filters(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filters as the torch sampler had them (temperature, top_k, top_p, min_p, typical_p)."""
    x = x / p.temperature
    if 0 < p.top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        s, order = torch.sort(x, descending=True)
        sm = torch.softmax(s, -1)
        drop = torch.empty_like(s, dtype=torch.bool).scatter_(0, order, (sm.cumsum(-1) - sm) >= p.top_p)
        x = x.masked_fill(drop, float("-inf"))
    if p.min_p > 0.0:
        pr = torch.softmax(x, -1)
        x = x.masked_fill(pr < p.min_p * pr.max(), float("-inf"))
    if p.typical_p < 1.0:
        logp = torch.log_softmax(x, -1)
        pr = logp.exp()
        ent = -(torch.nan_to_num(pr * logp)).sum()
        order = torch.argsort((-logp - ent).abs(), stable=True)
        n_keep = int((pr[order].cumsum(-1) < p.typical_p).sum()) + 1
        drop = torch.ones_like(x, dtype=torch.bool)
        drop[order[:n_keep]] = False
        x = x.masked_fill(drop, float("-inf"))
    return x


def test_filters_keep_the_tokens_the_torch_sampler_kept():
    """The numpy filters against the torch ones they replaced: the same tokens survive, with the
    same values, over random rows and parameters."""
    import random

    rng = random.Random(1)
    for _ in range(300):
        n = rng.choice([50, 1000, 49152])
        x = torch.randn(n, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) * rng.choice([1, 4])
        p = SamplingParams(max_tokens=1, temperature=rng.choice([0.5, 1.0, 1.7]), top_k=rng.choice([0, 1, 5, 40]),
                           top_p=rng.choice([1.0, 0.9, 0.5]), min_p=rng.choice([0.0, 0.05, 0.3]),
                           typical_p=rng.choice([1.0, 1.0, 0.8]))
        w = SeqWork("s", (1,), 0, (0,), True, p)
        got, want = S.process(x.numpy(), w), _torch_filters(x, p).numpy()
        kept, kept_t = np.isfinite(got), np.isfinite(want)
        assert (kept == kept_t).all(), (p, np.flatnonzero(kept != kept_t))
        np.testing.assert_allclose(got[kept], want[kept], rtol=1e-6)


def test_draws_follow_the_distribution_and_never_pick_a_filtered_token():
    """Inverse-CDF draws over 20,000 (seed, gen_index) pairs: each kept token's frequency within
    5 sigma of its probability; filtered (-inf) tokens never drawn."""
    x = np.full(V, -np.inf, dtype=np.float32)
    x[[3, 7, 50, 99]] = np.log(np.array([0.5, 0.25, 0.15, 0.10], dtype=np.float32))
    n = 20000
    drawn = np.array([S.draw(x, S.uniform(s, g)) for s in range(100) for g in range(n // 100)])
    assert set(np.unique(drawn)) <= {3, 7, 50, 99}
    for tok, pr in ((3, 0.5), (7, 0.25), (50, 0.15), (99, 0.10)):
        freq = (drawn == tok).mean()
        assert abs(freq - pr) < 5 * math.sqrt(pr * (1 - pr) / n), (tok, freq, pr)


def test_filtered_rows_take_the_short_paths_with_the_same_bits():
    """top_p and the draw look only at the live tokens when a filter (top_k) left few: the same kept set
    and the same token as the whole-row forms (kept here as the reference), ties included."""
    import numpy as np

    from imp.sampling import cpu

    neg = np.float32(-np.inf)

    def top_p_whole(x, top_p):
        order = np.argsort(-x, kind="stable")
        p = cpu.softmax(x[order]).astype(np.float64)
        before = np.cumsum(p) - p
        drop = np.empty(x.shape[-1], dtype=bool)
        drop[order] = before >= top_p
        return np.where(drop, neg, x)

    def draw_whole(x, u):
        e = np.exp(x.astype(np.float64) - float(x.max()))
        cdf = np.cumsum(e)
        return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), x.shape[-1] - 1)

    rng = np.random.default_rng(1)
    for trial in range(600):
        V = int(rng.choice([50, 1000, 49152]))
        x = (rng.standard_normal(V) * rng.uniform(0.1, 5)).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x, 1).astype(np.float32)  # ties
        y = cpu.top_k_filter(x, int(rng.integers(1, max(2, V // 3))))
        tp, u = float(rng.uniform(0.05, 0.999)), float(rng.uniform())
        a, b = top_p_whole(y, tp), cpu.top_p_filter(y, tp)
        assert np.array_equal(a, b), trial
        assert draw_whole(a, u) == cpu.draw(b, u), trial
