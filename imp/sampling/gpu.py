"""The sampler on the device, over a step's sequences (the GPU runner's only sampler).

Semantics follow `imp.sampling.cpu` (the reference): bias -> penalties ->
(greedy: argmax) -> /temperature -> top_k -> top_p -> min_p -> draw. The draw
is Gumbel-max with noise hashed from (seed, gen_index, token id), so it depends
only on the sequence, like the CPU sampler's; the two draw *different* tokens
from the same distribution (only greedy tokens compare across them). Rows that
need the host (`SamplingParams.host_sampled`: logprobs, typical_p) go to the CPU
sampler row by row. The kernels are `imp.kernels.sampling`.
"""

from __future__ import annotations

import itertools


import numpy as np
import torch

from imp.kernels import sampling as k
from imp.kernels._cuda import to_device
from imp.messages import SampledToken, SeqWork
from imp.sampling.cpu import LOGPROB_FLOOR, sample_one


def draw_ids(logits: torch.Tensor, seqs: list[SeqWork], use_numba: bool = True, pending=None
             ) -> tuple[torch.Tensor, list[SampledToken] | None]:
    """A step's sampled ids [R] on the device, without a host sync where possible; the
    SampledTokens too when some row had to be sampled on the host (they are then final).
    pending: (rows: a list of P row indices, ids [P] on the device): penalized rows whose history lacks the
    token the step in flight sampled, still on the device; the penalties count it there."""
    ps = [s.params for s in seqs]
    if all(p.plain_greedy for p in ps):
        return torch.argmax(logits, dim=-1), None
    if any(p.host_sampled for p in ps):
        tokens = sample_rows(logits, seqs, use_numba)
        return to_device([t.token_id for t in tokens], torch.int32, logits.device), tokens
    return sample_ids(logits, seqs, use_numba, pending)[0], None


def sample_rows(logits: torch.Tensor, seqs: list[SeqWork], use_numba: bool = True) -> list[SampledToken]:
    """One SampledToken per row (waits for the device): device rows batched, host rows one by one."""
    if all(s.params.plain_greedy for s in seqs):
        ids = torch.argmax(logits, dim=-1).tolist()
        return [SampledToken(seq_id=s.seq_id, token_id=t) for s, t in zip(seqs, ids)]
    cpu = [i for i, s in enumerate(seqs) if s.params.typical_p < 1.0 and not s.params.greedy]
    dev = [i for i in range(len(seqs)) if i not in set(cpu)]
    out: dict[int, SampledToken] = {}
    if dev:
        sel = logits if len(dev) == len(seqs) else logits.index_select(0, to_device(dev, torch.int64, logits.device))
        for i, t in zip(dev, sample(sel, [seqs[i] for i in dev], use_numba)):
            out[i] = t
    for i in cpu:  # typical_p: the CPU sampler, row by row
        out[i] = sample_one(logits[i].float().cpu(), seqs[i])
    return [out[i] for i in range(len(seqs))]


def bias_and_penalties(logits: torch.Tensor, works: list[SeqWork], use_numba: bool = True,
                       pending=None) -> torch.Tensor:
    """In place on logits [R, V] fp32 (contiguous): logit_bias, then repetition/presence/frequency.
    pending: see draw_ids; those rows are penalized densely, their device token counted once more."""
    V = logits.shape[1]
    dense = set(pending[0]) if pending is not None else set()
    b_rows, b_ids, b_vals = [], [], []
    p_rows, p_ids, p_cnt = [], [], []  # (filled by history_counts)
    params = np.zeros((len(works), 3), np.float32)
    counted = []  # rows whose history the penalty kernel counts (pending rows: _penalize_dense)
    for r, w in enumerate(works):
        p = w.params
        agg: dict[int, float] = {}
        for t, val in p.logit_bias:
            if 0 <= t < V:
                agg[t] = agg.get(t, 0.0) + float(val)
        b_rows += [r] * len(agg)
        b_ids += list(agg)
        b_vals += list(agg.values())
        params[r] = (p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        if w.history and p.penalized and r not in dense:
            counted.append(r)
    if counted:
        p_rows, p_ids, p_cnt = history_counts([works[r].history for r in counted], counted, V)
    dev = logits.device
    i32 = lambda v: to_device(v, torch.int32, dev)  # noqa: E731
    if b_ids:
        k.add_bias(logits, i32(b_rows), i32(b_ids), to_device(b_vals, torch.float32, dev), use_numba)
    if len(p_ids) or dense:
        params_dev = to_device(torch.from_numpy(params), torch.float32, dev)
    if len(p_ids):
        k.penalize(logits, i32(torch.from_numpy(p_rows)), i32(torch.from_numpy(p_ids)),
                   to_device(torch.from_numpy(p_cnt), torch.float32, dev), params_dev, use_numba)
    if dense:
        _penalize_dense(logits, [works[r] for r in pending[0]], pending, params_dev)
    return logits


def history_counts(histories: list[tuple[int, ...]], rows: list[int], V: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, token id, count) of every id in 0..V-1 that `histories[i]` holds, row = rows[i], as int64 /
    int64 / float32 arrays ordered by row then id: the penalty kernel's input, counted in numpy (one
    np.unique over row * V + id for the whole step) instead of a Counter per row."""
    lens = [len(h) for h in histories]
    flat = np.fromiter(itertools.chain.from_iterable(histories), dtype=np.int64, count=sum(lens))
    r = np.repeat(np.asarray(rows, dtype=np.int64), lens)
    keep = (flat >= 0) & (flat < V)
    keys, cnt = np.unique(r[keep] * V + flat[keep], return_counts=True)
    return keys // V, keys % V, cnt.astype(np.float32)


def _penalize_dense(logits: torch.Tensor, works: list[SeqWork], pending, params: torch.Tensor) -> None:
    """The penalties of rows `pending[0]` over counts built on the device: the host-known history
    plus the in-flight token `pending[1]` (no host sync). Same arithmetic as k.penalize, applied to
    every token with a count: repetition once, presence once, frequency per occurrence."""
    rows_l, ids = pending
    P, V = len(rows_l), logits.shape[1]
    dev = logits.device
    rows = to_device(rows_l, torch.int64, dev)
    counts = torch.zeros(P, V, dtype=torch.float32, device=dev)
    lens = [len(w.history) for w in works]
    total = sum(lens)
    if total:  # the histories flattened in C (np.fromiter), not by a Python loop per token: 256 rows x 1k tokens
        ht = np.fromiter(itertools.chain.from_iterable(w.history for w in works), dtype=np.int64, count=total)
        hr = np.repeat(np.arange(P, dtype=np.int64), lens)
        keep = (ht >= 0) & (ht < V)
        if not keep.all():
            ht, hr = ht[keep], hr[keep]
        if ht.size:
            counts.index_put_((to_device(torch.from_numpy(hr), torch.int64, dev),
                               to_device(torch.from_numpy(ht), torch.int64, dev)),
                              torch.ones(ht.size, device=dev), accumulate=True)
    counts.scatter_add_(1, ids.long().clamp(0, V - 1).view(P, 1), torch.ones(P, 1, device=dev))
    x = logits.index_select(0, rows)
    pr = params.index_select(0, rows)
    rep, pres, freq = pr[:, 0:1], pr[:, 1:2], pr[:, 2:3]
    seen = counts > 0
    y = torch.where(rep != 1.0, torch.where(x > 0, x / rep, x * rep), x)
    y = y - pres - freq * counts
    logits.index_copy_(0, rows, torch.where(seen, y, x))


def sample(logits: torch.Tensor, works: list[SeqWork], use_numba: bool = True) -> list[SampledToken]:
    """logits [R, V] fp32 on the device -> one SampledToken per work (typical_p ignored: see module doc)."""
    tokens, processed = sample_ids(logits, works, use_numba)
    return _to_sampled(tokens, processed, works)


def sample_ids(logits: torch.Tensor, works: list[SeqWork], use_numba: bool = True, pending=None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The drawn ids [R] int64 and the processed logits, left on the device (no host sync)."""
    R, V = logits.shape
    dev = logits.device
    x = logits.float().contiguous().clone()
    bias_and_penalties(x, works, use_numba, pending)
    ps = [w.params for w in works]
    greedy = [p.greedy for p in ps]
    tokens = torch.argmax(x, dim=-1)
    processed = x
    if not all(greedy):
        f = lambda vals, dt: to_device(vals, dt, dev)  # noqa: E731
        temp = f([p.temperature if p.temperature > 0 else 1.0 for p in ps], torch.float32)
        filt = k.filter_logits(x, temp, f([p.top_k for p in ps], torch.int64), f([p.top_p for p in ps], torch.float32),
                             f([p.min_p for p in ps], torch.float32))
        g = k.gumbel_noise(f([p.seed for p in ps], torch.int64), f([w.gen_index for w in works], torch.int64), V)
        drawn = torch.argmax(filt + g, dim=-1)
        is_greedy = f(greedy, torch.bool)
        tokens = torch.where(is_greedy, tokens, drawn)
        processed = torch.where(is_greedy[:, None], x, filt)
    return tokens, processed


def _to_sampled(tokens: torch.Tensor, processed: torch.Tensor, works: list[SeqWork]) -> list[SampledToken]:
    V = processed.shape[1]
    ps = [w.params for w in works]
    want = [p.logprobs >= 0 for p in ps]
    ids = tokens.tolist()
    if not any(want):
        return [SampledToken(seq_id=w.seq_id, token_id=t) for w, t in zip(works, ids)]
    logp = torch.log_softmax(processed, -1).nan_to_num(nan=LOGPROB_FLOOR).clamp(min=LOGPROB_FLOOR)
    kmax = max(p.logprobs for p in ps)
    chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
    top_v, top_i = (torch.topk(logp, min(kmax, V), dim=-1) if kmax > 0 else (None, None))
    top_v = top_v.tolist() if top_v is not None else None
    top_i = top_i.tolist() if top_i is not None else None
    out = []
    for r, (w, t) in enumerate(zip(works, ids)):
        n_top = ps[r].logprobs
        if n_top < 0:
            out.append(SampledToken(seq_id=w.seq_id, token_id=t))
            continue
        top = tuple(zip(top_i[r][:n_top], top_v[r][:n_top])) if n_top > 0 else ()
        out.append(SampledToken(seq_id=w.seq_id, token_id=t, logprob=float(chosen[r]), top=top))
    return out


def reference_processed(logits: torch.Tensor, works: list[SeqWork]) -> torch.Tensor:
    """CPU reference: imp.sampling.cpu.process row by row (float32)."""
    from imp.sampling.cpu import process

    return torch.stack([process(logits[r].cpu(), w) for r, w in enumerate(works)])
