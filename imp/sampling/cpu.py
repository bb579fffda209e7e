"""Sampling as plain functions over one sequence's logits row [vocab].

Order of processing (as in HF / vLLM):
    logit_bias -> penalties (over SeqWork.history) -> temperature ->
    top_k -> top_p -> min_p -> typical_p -> draw
Greedy (temperature 0) takes the argmax of the biased, penalized logits.

Determinism: the draw for a sequence depends only on (params.seed, gen_index):
each draw gets a fresh torch.Generator seeded from a hash of the pair, so a
sequence recomputed after preemption, or run in another batch, draws the
same token from the same distribution.

Logprobs are those of the processed distribution (what was sampled from),
floored at LOGPROB_FLOOR so that JSON never sees -inf or NaN.
"""

from __future__ import annotations

import hashlib
from imp.messages import SampledToken, SamplingParams, SeqWork

import numpy as np
import torch

LOGPROB_FLOOR = -9999.0


def generator_for(seed: int, gen_index: int) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{gen_index}".encode(), digest_size=8).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return g


def argmax(x: torch.Tensor) -> int:
    """The first index of the largest value of a CPU row (a NaN counts as largest, as in torch):
    numpy's, ~10x faster than torch.argmax here (262k floats: 15 vs 163 µs, 2 threads)."""
    return int(np.argmax(x.numpy()))


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    if not bias:
        return logits
    ids = torch.tensor([t for t, _ in bias], dtype=torch.int64)
    vals = torch.tensor([b for _, b in bias], dtype=logits.dtype)
    keep = ids < logits.shape[-1]
    return logits.index_add(0, ids[keep], vals[keep])


def apply_penalties(logits: torch.Tensor, history: list[int], p: SamplingParams, own: bool = False) -> torch.Tensor:
    """Repetition (HF: divide positive logits, multiply negative ones), presence, frequency.

    Only the tokens of the history change, so only they are gathered, penalized and put back:
    O(history) instead of O(vocab) (Gemma's 262k vocabulary made the dense form ~2 ms a row).
    The same operations in the same order as on the whole row, so the same bits. own: the caller
    owns `logits` (a fresh tensor nobody reads after): penalized in place, no copy of the row
    (a 262k vocabulary's row is 1 MB, copied every step)."""
    if not history or not p.penalized:
        return logits
    V = logits.shape[-1]
    ids = np.fromiter(history, np.int64, len(history))  # a tuple, or the executor's view
    ids = ids[(ids >= 0) & (ids < V)]
    if ids.size == 0:
        return logits
    # numpy, float32 throughout: the same IEEE operations as torch's (a Python scalar meets an fp32
    # tensor as fp32), in a handful of calls instead of ~8 torch ops a row (held to the dense torch
    # form bit for bit in tests/test_model_sampling.py)
    uniq, counts = np.unique(ids, return_counts=True)
    if logits.dtype != torch.float32:
        logits, own = logits.float(), True
    out = logits if own else logits.clone()
    row = out.numpy()
    v = row[..., uniq]
    f = np.float32
    if p.repetition_penalty != 1.0:
        r = f(p.repetition_penalty)
        v = np.where(v > 0, v / r, v * r)
    if p.presence_penalty != 0.0:
        v = v - f(p.presence_penalty) * np.ones_like(v)
    if p.frequency_penalty != 0.0:
        v = v - f(p.frequency_penalty) * counts.astype(f)
    row[..., uniq] = v
    return out


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cum = torch.softmax(sorted_logits, -1).cumsum(-1)
    # drop a token when the mass strictly before it already reaches top_p (keeps >= 1)
    drop_sorted = (cum - torch.softmax(sorted_logits, -1)) >= top_p
    drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, -1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def typical_filter(logits: torch.Tensor, typical_p: float) -> torch.Tensor:
    """Locally typical sampling: keep tokens whose surprisal is closest to the entropy."""
    if typical_p >= 1.0:
        return logits
    logp = torch.log_softmax(logits, -1)
    p = logp.exp()
    ent = -(torch.nan_to_num(p * logp)).sum()
    dist = (-logp - ent).abs()
    order = torch.argsort(dist)
    cum = p[order].cumsum(-1)
    n_keep = int((cum < typical_p).sum().item()) + 1
    drop = torch.ones_like(logits, dtype=torch.bool)
    drop[order[:n_keep]] = False
    return logits.masked_fill(drop, float("-inf"))


def process(logits: torch.Tensor, work: SeqWork, own: bool = False) -> torch.Tensor:
    """Biased, penalized, tempered and filtered logits [vocab] for one sequence. own: the caller's
    `logits` may be changed in place (see apply_penalties)."""
    p = work.params
    x = logits.float()
    x = apply_logit_bias(x, p.logit_bias)
    x = apply_penalties(x, work.history, p, own=own or x is not logits)  # a fresh x is ours anyway
    if p.greedy:
        return x
    x = x / p.temperature
    x = top_k_filter(x, p.top_k)
    x = top_p_filter(x, p.top_p)
    x = min_p_filter(x, p.min_p)
    x = typical_filter(x, p.typical_p)
    return x


def sample_one(logits: torch.Tensor, work: SeqWork, own: bool = False) -> SampledToken:
    """logits [vocab] fp32 -> the sequence's next token (and logprobs if asked); own: see process."""
    p = work.params
    x = process(logits, work, own)
    if p.greedy:
        token = argmax(x)
    else:
        probs = torch.softmax(x, -1)
        token = int(torch.multinomial(probs, 1, generator=generator_for(p.seed, work.gen_index)).item())
    if p.logprobs < 0:
        return SampledToken(seq_id=work.seq_id, token_id=token)
    logp = torch.log_softmax(x, -1).nan_to_num(nan=LOGPROB_FLOOR).clamp(min=LOGPROB_FLOOR)
    top: tuple[tuple[int, float], ...] = ()
    if p.logprobs > 0:
        vals, ids = torch.topk(logp, min(p.logprobs, logp.shape[-1]))
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return SampledToken(seq_id=work.seq_id, token_id=token, logprob=float(logp[token]), top=top)


def sample(logits: torch.Tensor, works: list[SeqWork], own: bool = False) -> list[SampledToken]:
    """logits [B, vocab] for `works` (same order) -> one token per sequence. own: the caller's logits
    are a fresh tensor it will not read again (its rows may be penalized in place)."""
    assert logits.shape[0] == len(works)
    if all(w.params.plain_greedy for w in works):
        ids = np.argmax(logits.numpy(), axis=-1).tolist()  # all-greedy fast path, one op (see argmax)
        return [SampledToken(seq_id=w.seq_id, token_id=t) for w, t in zip(works, ids)]
    return [sample_one(logits[i], w, own) for i, w in enumerate(works)]
