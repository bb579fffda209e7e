"""Sampling as plain functions over one sequence's logits row [vocab], in numpy.

Order of processing (as in HF / vLLM; DRY where llama.cpp's chain has it):
    logit_bias -> penalties (over SeqWork.history) -> DRY -> temperature ->
    top_k -> top_p -> min_p -> typical_p -> draw   (mirostat: its own cut and draw after temperature)
Greedy (temperature 0) takes the argmax of the biased, penalized logits.

Determinism: the draw for a sequence depends only on (params.seed, gen_index):
its uniform number is a hash of the pair (`uniform`), drawn by inverse CDF over
the processed distribution, so a sequence recomputed after preemption, or run
in another batch, draws the same token from the same distribution.

Logprobs are those of the processed distribution (what was sampled from),
floored at LOGPROB_FLOOR so that JSON never sees -inf or NaN.

numpy, not torch: the default CPU server imports no torch (imp/model/paged.py says why). A
row may come in as a CPU torch tensor (the GPU sampler's host rows, tests): np.asarray reads
it in place.
"""

from __future__ import annotations

import hashlib

from imp.messages import SampledToken, SamplingParams, SeqWork
from imp.sampling import dry, mirostat

import numpy as np

LOGPROB_FLOOR = -9999.0
_F = np.float32
_NEG_INF = _F(-np.inf)


def uniform(seed: int, gen_index: int) -> float:
    """A number in [0, 1) that depends only on (seed, gen_index): 53 bits of a keyed hash."""
    digest = hashlib.blake2b(f"{seed}:{gen_index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0 ** -53


def argmax(x) -> int:
    """The first index of the largest value (a NaN counts as largest, as in torch)."""
    return int(np.argmax(np.asarray(x)))


def softmax(x: np.ndarray) -> np.ndarray:
    """float32 softmax of a row (max subtracted; -inf entries get 0)."""
    e = np.exp(x - x.max())
    return e / e.sum()


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max()
    return (x - m) - np.log(np.exp(x - m).sum())


def topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest of a row, largest first (ties: lower id first): (values, ids)."""
    k = min(k, x.shape[-1])
    part = np.argpartition(-x, k - 1)[:k] if k < x.shape[-1] else np.arange(x.shape[-1])
    order = np.lexsort((part, -x[part]))
    ids = part[order]
    return x[ids], ids


def apply_bans(logits, works) -> None:
    """In place on logits [len(works), V] (numpy, or a torch tensor on any device): each share's
    banned tokens (SeqWork.banned: a banned phrase started there) -inf, before anything samples, so
    no sampler, greedy or not, can draw them and logprobs read them as probability 0."""
    for i, w in enumerate(works):
        if w.banned:
            logits[i, list(w.banned)] = float("-inf")


def apply_guidance(logits, works) -> None:
    """Classifier-free guidance, in place on logits [len(works), V] (numpy or torch, any device): a row whose
    share names its shadow (SeqWork.guide, the shadow's share among `works`) becomes l_b + s (l_a - l_b), l_a
    its own logits, l_b the shadow's, s its params.cfg_scale (llama.cpp's formula), before anything else."""
    at = None
    for i, w in enumerate(works):
        if w.guide:
            at = at if at is not None else {x.seq_id: j for j, x in enumerate(works)}
            j = at[w.guide]  # the scheduler plans the two in one step (imp.core.guide)
            b = logits[j]
            logits[i] = b + w.params.cfg_scale * (logits[i] - b)


def apply_logit_bias(logits: np.ndarray, bias: tuple[tuple[int, float], ...]) -> np.ndarray:
    """A new row with bias[id] added (ids past the vocabulary ignored; repeats add up)."""
    if not bias:
        return logits
    ids = np.array([t for t, _ in bias], dtype=np.int64)
    vals = np.array([b for _, b in bias], dtype=_F)
    keep = ids < logits.shape[-1]
    out = logits.copy()
    np.add.at(out, ids[keep], vals[keep])
    return out


def apply_penalties(logits, history, p: SamplingParams, own: bool = False) -> np.ndarray:
    """Repetition (HF: divide positive logits, multiply negative ones), presence, frequency.

    Only the tokens of the history change, so only they are gathered, penalized and put back:
    O(history) instead of O(vocab) (Gemma's 262k vocabulary made the dense form ~2 ms a row).
    float32 throughout, in the order of the dense form (held to it bit for bit in
    tests/test_model_sampling.py; the GPU kernel follows the same rounding). own: the caller
    owns `logits` (a fresh row nobody reads after): penalized in place, no copy of the row."""
    row = np.asarray(logits)
    if not history or not p.penalized:
        return row
    V = row.shape[-1]
    ids = np.fromiter(history, np.int64, len(history))  # a tuple, or the executor's view
    ids = ids[(ids >= 0) & (ids < V)]
    if ids.size == 0:
        return row
    uniq, counts = np.unique(ids, return_counts=True)
    if row.dtype != _F:
        row, own = row.astype(_F), True
    out = row if own else row.copy()
    v = out[..., uniq]
    if p.repetition_penalty != 1.0:
        r = _F(p.repetition_penalty)
        v = np.where(v > 0, v / r, v * r)
    if p.presence_penalty != 0.0:
        v = v - _F(p.presence_penalty) * np.ones_like(v)
    if p.frequency_penalty != 0.0:
        v = v - _F(p.frequency_penalty) * counts.astype(_F)
    out[..., uniq] = v
    return out


def top_k_filter(x: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= x.shape[-1]:
        return x
    kth = np.partition(x, x.shape[-1] - k)[x.shape[-1] - k]  # the k-th largest
    return np.where(x < kth, _NEG_INF, x)


def top_p_filter(x: np.ndarray, top_p: float) -> np.ndarray:
    if top_p >= 1.0:
        return x
    V = x.shape[-1]
    live = np.flatnonzero(x != _NEG_INF)
    if live.size < V // 2:  # after top_k: sort the live tokens only, the same bits (a 262k row: 6 -> 0.3 ms)
        order = live[np.argsort(-x[live], kind="stable")]
        e = np.exp(x[order] - x[order[0]])
        whole = np.zeros(V, _F)  # the sorted row's exp, zeros where -inf: summed as the whole row was
        whole[:e.size] = e
        p = (e / whole.sum()).astype(np.float64)
        before = np.cumsum(p) - p
        out = np.full(V, _NEG_INF, _F)
        keep = order[before < top_p]
        out[keep] = x[keep]
        return out
    order = np.argsort(-x, kind="stable")
    p = softmax(x[order]).astype(np.float64)
    before = np.cumsum(p) - p  # mass strictly before each token, largest first
    drop = np.empty(V, dtype=bool)
    drop[order] = before >= top_p  # drop a token once the mass before it reaches top_p (keeps >= 1)
    return np.where(drop, _NEG_INF, x)


def min_p_filter(x: np.ndarray, min_p: float) -> np.ndarray:
    if min_p <= 0.0:
        return x
    probs = softmax(x)
    return np.where(probs < _F(min_p) * probs.max(), _NEG_INF, x)


def typical_filter(x: np.ndarray, typical_p: float) -> np.ndarray:
    """Locally typical sampling: keep tokens whose surprisal is closest to the entropy."""
    if typical_p >= 1.0:
        return x
    logp = log_softmax(x)
    p = np.exp(logp)
    with np.errstate(invalid="ignore"):  # 0 * -inf of a filtered token: NaN, counted as 0
        ent = -np.nan_to_num(p * logp).sum()
    order = np.argsort(np.abs(-logp - ent), kind="stable")
    n_keep = int((np.cumsum(p[order]) < typical_p).sum()) + 1
    drop = np.ones(x.shape[-1], dtype=bool)
    drop[order[:n_keep]] = False
    return np.where(drop, _NEG_INF, x)


def process(logits, work: SeqWork, own: bool = False) -> np.ndarray:
    """Biased, penalized, tempered and filtered logits [vocab] float32 for one sequence. own: the
    caller's `logits` may be changed in place (see apply_penalties)."""
    p = work.params
    row = np.asarray(logits)
    x = row.astype(_F, copy=False)
    x = apply_logit_bias(x, p.logit_bias)
    x = apply_penalties(x, work.history, p, own=own or x is not row)  # a fresh x is ours anyway
    if p.dry is not None:  # after the penalties, before temperature: llama.cpp's chain order
        x = dry.apply(x, p.dry, work.history, own=own or x is not row)
    if p.greedy:
        return x
    x = x / _F(p.temperature)
    if p.mirostat:  # its own cut replaces the filters (llama.cpp's chain: bias, temperature, mirostat)
        return x
    x = top_k_filter(x, p.top_k)
    x = top_p_filter(x, p.top_p)
    x = min_p_filter(x, p.min_p)
    x = typical_filter(x, p.typical_p)
    return x


def draw(x: np.ndarray, u: float) -> int:
    """The token at u in [0, 1) of softmax(x)'s cumulative distribution (float64). A token of
    probability 0 (filtered, masked: -inf) is never drawn: the CDF does not rise at it."""
    live = np.flatnonzero(x != _NEG_INF)
    if live.size < x.shape[-1] // 2:  # filtered: the CDF over the live tokens only (a -inf adds exactly 0)
        e = np.exp(x[live].astype(np.float64) - float(x.max()))
        cdf = np.cumsum(e)
        i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        return int(live[min(i, live.size - 1)])
    e = np.exp(x.astype(np.float64) - float(x.max()))
    cdf = np.cumsum(e)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(i, x.shape[-1] - 1)


def sample_one(logits, work: SeqWork, own: bool = False) -> SampledToken:
    """logits [vocab] fp32 -> the sequence's next token (and logprobs if asked); own: see process."""
    p = work.params
    x = process(logits, work, own)
    mu = None
    if p.mirostat:  # the draw from mirostat's cut; logprobs are those of the cut distribution
        token, ids, probs, mu = mirostat.sample(x, p.mirostat, p.mirostat_tau, p.mirostat_eta, work.mu,
                                                uniform(p.seed, work.gen_index), p.greedy)
        if p.logprobs >= 0:
            x = np.full(x.shape[-1], _NEG_INF, _F)
            x[ids] = np.log(probs)
    else:
        token = argmax(x) if p.greedy else draw(x, uniform(p.seed, work.gen_index))
    if p.logprobs < 0:
        return SampledToken(seq_id=work.seq_id, token_id=token, mu=mu)
    logp = np.maximum(np.nan_to_num(log_softmax(x), nan=LOGPROB_FLOOR), _F(LOGPROB_FLOOR))
    top: tuple[tuple[int, float], ...] = ()
    if p.score_ids:  # the caller's candidates, in its order (/v1/score)
        top = tuple((i, float(logp[i])) for i in p.score_ids)
    elif p.logprobs > 0:
        vals, ids = topk(logp, p.logprobs)
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return SampledToken(seq_id=work.seq_id, token_id=token, logprob=float(logp[token]), top=top, mu=mu)


def sample(logits, works: list[SeqWork], own: bool = False) -> list[SampledToken]:
    """logits [B, vocab] for `works` (same order) -> one token per sequence. own: the caller's logits
    are a fresh array it will not read again (its rows may be penalized in place)."""
    logits = np.asarray(logits)
    assert logits.shape[0] == len(works)
    if all(w.params.plain_greedy for w in works):
        ids = np.argmax(logits, axis=-1).tolist()  # all-greedy fast path, one op
        return [SampledToken(seq_id=w.seq_id, token_id=t) for w, t in zip(works, ids)]
    return [sample_one(logits[i], w, own) for i, w in enumerate(works)]
