"""Mirostat v1 and v2 (Basu et al., 2020), as llama.cpp runs them: a cut of the distribution that steers each
token's surprise (-log2 p) toward tau, with a per-sequence state mu (2 tau at first) learned at rate eta.

v2: keep the most probable tokens while their surprise is at most mu (at least one), renormalize, draw.
v1: estimate the Zipf exponent s from the 100 most probable tokens, keep the top k with
    k = (eps 2^mu / (1 - V^-eps))^(1/s), eps = s - 1, renormalize, draw.
Then mu -= eta (surprise of the drawn token under the cut distribution - tau).

llama.cpp's chain for mirostat is logit bias -> temperature -> mirostat: top-k, top-p, min-p and typical-p do
not apply (nor here); the penalties and DRY a request asks for do apply here, before temperature. The draw is
this server's (the inverse CDF at uniform(seed, gen_index), most probable first), so a seed gives the same
tokens on every run; llama.cpp's own RNG draws others from the same distribution. float32 as llama.cpp
computes the probabilities, the cut and mu.

State: mu lives with the runner from step to step (`MirostatState`, like the penalty counts), and with the
scheduler through each SampledToken's `mu`, so a sequence re-admitted after a preemption resumes its mu
(SeqWork.mu on its first share) and draws what it would have drawn.
"""

from __future__ import annotations

from typing import Iterable

import msgspec
import numpy as np

_F = np.float32
M = 100  # v1: tokens that estimate s (llama.cpp's m)


def _softmax32(x: np.ndarray) -> np.ndarray:
    """llama.cpp's llama_sampler_softmax_impl on logits sorted descending: float32 exp(x - max) / sum."""
    e = np.exp((x - x[0]).astype(_F)).astype(_F)
    return (e / e.sum(dtype=_F)).astype(_F)


def _sorted(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids ordered by x descending (ties: lower id first, as a stable sort of the whole row would)."""
    return ids[np.lexsort((ids, -x[ids]))]


def cut(x: np.ndarray, version: int, mu: float) -> tuple[np.ndarray, np.ndarray]:
    """x: processed logits [V] float32 (after temperature). -> (ids kept, most probable first; their
    probabilities renormalized, float32). Only the candidates are sorted (a whole 262k row took 30 ms)."""
    V = x.shape[-1]
    top = int(np.argmax(x))
    with np.errstate(under="ignore"):
        e = np.exp(x - x[top], dtype=_F)  # float32, as llama.cpp's softmax
    S = _F(e.sum(dtype=_F))
    if version == 2:  # keep p >= 2^-mu, i.e. e >= S 2^-mu: a prefix of the sorted candidates
        ids = np.nonzero(e >= S * _F(np.exp2(-np.float64(mu))))[0]
        ids = _sorted(x, ids) if ids.size else np.array([top])
    else:
        m = min(M, V)
        head = np.argpartition(-x, m - 1)[:m] if m < V else np.arange(V)
        head = _sorted(x, head)
        p = e[head] / S
        n = m - 1
        i = np.arange(n, dtype=_F)
        t = np.log((i + _F(2)) / (i + _F(1))).astype(_F)
        with np.errstate(divide="ignore", invalid="ignore"):
            b = np.log(p[:n] / p[1:n + 1]).astype(_F)
        s_hat = _F((t * b).sum(dtype=_F) / (t * t).sum(dtype=_F)) if n > 0 else _F(1)
        eps = s_hat - _F(1)
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            k = np.power((eps * np.power(_F(2), _F(mu))) / (_F(1) - np.power(_F(V), -eps)), _F(1) / s_hat)
        k = max(1, int(k)) if np.isfinite(k) and k < V else V
        if k <= m:
            ids = head[:k]
        else:
            ids = np.argpartition(-x, k - 1)[:k] if k < V else np.arange(V)
            ids = _sorted(x, ids)
    ids = ids[np.isfinite(x[ids])] if not np.isfinite(x[ids[-1]]) else ids
    return ids, _softmax32(x[ids])


def sample(x: np.ndarray, version: int, tau: float, eta: float, mu: float | None, u: float, greedy: bool
           ) -> tuple[int, np.ndarray, np.ndarray, float]:
    """One draw: (token, ids kept, their probabilities, mu after). Greedy (temperature 0): llama.cpp's
    temperature keeps only the most probable token, whose surprise is 0."""
    mu = _F(2.0 * tau) if mu is None else _F(mu)
    if greedy:
        t = int(np.argmax(x))
        return t, np.array([t]), np.ones(1, _F), float(mu - _F(eta) * (_F(0) - _F(tau)))
    ids, p = cut(x, version, float(mu))
    cdf = np.cumsum(p.astype(np.float64))
    j = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(ids) - 1)
    surprise = -np.log2(p[j]).astype(_F)
    return int(ids[j]), ids, p, float(mu - _F(eta) * (surprise - _F(tau)))


class MirostatState:
    """mu by sequence, kept by a runner from step to step: `fill` gives each mirostat share its mu (the
    scheduler's on a first share, which also resets the kept one; else the kept one), `keep` takes a step's
    sampled tokens, `forget` the freed sequences."""

    def __init__(self):
        self._mu: dict[str, float] = {}

    def fill(self, works: list) -> list:
        out = works
        for i, w in enumerate(works):
            p = w.params
            if p is None or not p.mirostat:
                continue
            if w.mu is not None:
                self._mu[w.seq_id] = w.mu
            elif w.seq_id in self._mu:
                if out is works:
                    out = list(works)
                out[i] = msgspec.structs.replace(w, mu=self._mu[w.seq_id])
        return out

    def keep(self, tokens: Iterable) -> None:
        for t in tokens:
            if t is not None and t.mu is not None:
                self._mu[t.seq_id] = t.mu

    def forget(self, seq_ids) -> None:
        for s in seq_ids:
            self._mu.pop(s, None)

    def __len__(self) -> int:
        return len(self._mu)
