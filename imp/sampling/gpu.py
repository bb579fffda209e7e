"""The sampler on the device, over a step's sequences (the GPU runner's only sampler).

Semantics follow `imp.sampling.cpu` (the reference): bias -> penalties ->
(greedy: argmax) -> /temperature -> top_k -> top_p -> min_p -> draw. The draw
is Gumbel-max with noise hashed from (seed, gen_index, token id), so it depends
only on the sequence, like the CPU sampler's inverse-CDF draw; the two draw *different* tokens
from the same distribution (only greedy tokens compare across them). Rows that
need the host (`SamplingParams.host_sampled`: logprobs, typical_p, DRY, mirostat) go to the CPU
sampler row by row. The kernels are `imp.kernels.cuda.sampling`.
"""

from __future__ import annotations

import itertools


import numpy as np
import torch

from imp.kernels.cuda import sampling as k
from imp.kernels.cuda.runtime import to_device
from imp.messages import SampledToken, SeqWork
from imp.sampling.cpu import LOGPROB_FLOOR, sample_one
from imp.sampling.devcounts import DeviceCounts
from imp.sampling.rowparams import F_MIN_P, F_TEMP, F_TOP_P, I_SEED, I_TOP_K, Step


def draw_ids(logits: torch.Tensor, seqs: list[SeqWork], use_numba: bool = True, pending=None, counts=None,
             step: Step | None = None) -> tuple[torch.Tensor, list[SampledToken] | None]:
    """A step's sampled ids [R] on the device, without a host sync where possible; the
    SampledTokens too when some row had to be sampled on the host (they are then final).
    pending: (rows: a list of P row indices, ids on the device[, slots: P indices into ids, default 0..P-1]):
    penalized rows whose history lacks the token the step in flight sampled, still on the device (row
    rows[j]'s is ids[slots[j]]); the penalties count it there. step: the rows' params as columns
    (`imp.sampling.rowparams`, the GPU runner's): the same draws without reading each row's params."""
    if step is not None:
        if step.plain.all():
            return torch.argmax(logits, dim=-1), None
        if not step.host.any():
            return sample_ids(logits, seqs, use_numba, pending, counts, step)[0], None
    ps = [s.params for s in seqs]
    if all(p.plain_greedy for p in ps):
        return torch.argmax(logits, dim=-1), None
    if any(p.host_sampled for p in ps):
        tokens = sample_rows(logits, seqs, use_numba)
        return to_device([t.token_id for t in tokens], torch.int32, logits.device), tokens
    return sample_ids(logits, seqs, use_numba, pending, counts)[0], None


def sample_rows(logits: torch.Tensor, seqs: list[SeqWork], use_numba: bool = True) -> list[SampledToken]:
    """One SampledToken per row (waits for the device): device rows batched, host rows one by one."""
    if all(s.params.plain_greedy for s in seqs):
        ids = torch.argmax(logits, dim=-1).tolist()
        return [SampledToken(seq_id=s.seq_id, token_id=t) for s, t in zip(seqs, ids)]
    cpu = [i for i, s in enumerate(seqs)  # score: the CPU sampler's; DRY: its context walk is the host's
           if (s.params.typical_p < 1.0 and not s.params.greedy) or s.params.score_ids or s.params.dry is not None
           or s.params.mirostat]
    dev = [i for i in range(len(seqs)) if i not in set(cpu)]
    out: dict[int, SampledToken] = {}
    if dev:
        sel = logits if len(dev) == len(seqs) else logits.index_select(0, to_device(dev, torch.int64, logits.device))
        for i, t in zip(dev, sample(sel, [seqs[i] for i in dev], use_numba)):
            out[i] = t
    for i in cpu:  # typical_p, score_ids, DRY, mirostat: the CPU sampler, row by row
        out[i] = sample_one(logits[i].float().cpu(), seqs[i])
    return [out[i] for i in range(len(seqs))]


def bias_and_penalties(logits: torch.Tensor, works: list[SeqWork], use_numba: bool = True,
                       pending=None, counts=None, step: Step | None = None) -> torch.Tensor:
    """In place on logits [R, V] fp32 (contiguous): logit_bias, then repetition/presence/frequency.
    pending: see draw_ids; those rows' in-flight token is counted on the device. The penalties of the
    whole step are one host->device copy and one kernel (`k.penalize_segments`): a step's host cost
    must stay under its device time at one stream (torch's index_put_ with accumulate cost 0.64 ms a
    step there, the whole dense path 1.4 ms against a 0.8 ms SmolLM2 step on the H200). step: the rows'
    params as columns (see draw_ids): only the rows with a bias are read, the penalties' params gathered."""
    V = logits.shape[1]
    b_rows, b_ids, b_vals = [], [], []
    biased = np.flatnonzero(step.bias).tolist() if step is not None else range(len(works))
    for r in biased:
        agg: dict[int, float] = {}
        for t, val in works[r].params.logit_bias:
            if 0 <= t < V:
                agg[t] = agg.get(t, 0.0) + float(val)
        b_rows += [r] * len(agg)
        b_ids += list(agg)
        b_vals += list(agg.values())
    dev = logits.device
    if b_ids:
        i32 = lambda v: to_device(v, torch.int32, dev)  # noqa: E731
        k.add_bias(logits, i32(b_rows), i32(b_ids), to_device(b_vals, torch.float32, dev), use_numba)
    pen = (np.flatnonzero(step.penalized).tolist() if step is not None
           else [r for r, w in enumerate(works) if w.params.penalized])
    if isinstance(counts, DeviceCounts):  # the counts on the device; the rows past its table: segments
        rest = counts.penalize(logits, works, pen, pending, step)
        if not rest:
            return logits
        meta, S = penalty_segments(works, pending, V, counts.host, only=set(rest))
    else:
        meta, S = penalty_segments(works, pending, V, counts)
    if S:
        src = pending[1] if pending is not None else None
        if src is not None and src.dtype != torch.int32:
            src = src.to(torch.int32)
        k.penalize_segments(logits, to_device(torch.from_numpy(meta), torch.int32, dev), S, src)
    return logits


def penalty_segments(works: list[SeqWork], pending, V: int, counts=None, only: set[int] | None = None
                     ) -> tuple[np.ndarray, int]:
    """The step's penalties packed for `k.penalize_segments` (its layout): one segment per penalized row
    with a history or a token in flight, the history's distinct ids in 0..V-1 with their counts.
    pending: (rows, src ids on the device[, slots]): row rows[j]'s in-flight token is src[slots[j]]
    (slots default: j). counts (HistoryCounts): each row's ids and counts kept from its last step, else
    every history counted now. only: these rows alone (the others penalized elsewhere). Returns (meta int32, S)."""
    psrc_of: dict[int, int] = {}
    if pending is not None:
        slots = pending[2] if len(pending) > 2 else range(len(pending[0]))
        psrc_of = dict(zip(pending[0], slots))
    seg = [r for r, w in enumerate(works) if w.params.penalized and (w.history or r in psrc_of)
           and (only is None or r in only)]
    S = len(seg)
    if not S:
        return np.zeros(0, np.int32), 0
    if counts is not None:
        per = [counts.get(works[r].seq_id, works[r].history, V) for r in seg]
        off = np.zeros(S + 1, np.int32)
        np.cumsum([a.size for a, _ in per], out=off[1:])
        ids = np.concatenate([a for a, _ in per])
        cnt = np.concatenate([c for _, c in per])
    else:
        srow, ids, cnt = history_counts([works[r].history for r in seg], range(S), V)
        off = np.searchsorted(srow, np.arange(S + 1)).astype(np.int32)
    prm = np.array([(works[r].params.repetition_penalty, works[r].params.presence_penalty,
                     works[r].params.frequency_penalty) for r in seg], np.float32)
    meta = np.concatenate([np.asarray(seg, np.int32), off, np.array([psrc_of.get(r, -1) for r in seg], np.int32),
                           prm.reshape(-1).view(np.int32), ids.astype(np.int32), cnt.astype(np.int32)])
    return meta, S


def history_counts(histories: list[tuple[int, ...]], rows, V: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, token id, count) of every id in 0..V-1 that `histories[i]` holds, row = rows[i], as int64 /
    int64 / float32 arrays ordered by row then id: the penalty kernel's input, counted in numpy (one
    np.unique over row * V + id for the whole step) instead of a Counter per row."""
    lens = [len(h) for h in histories]
    flat = np.fromiter(itertools.chain.from_iterable(histories), dtype=np.int64, count=sum(lens))
    r = np.repeat(np.asarray(rows, dtype=np.int64), lens)
    keep = (flat >= 0) & (flat < V)
    keys, cnt = np.unique(r[keep] * V + flat[keep], return_counts=True)
    return keys // V, keys % V, cnt.astype(np.float32)


def sample(logits: torch.Tensor, works: list[SeqWork], use_numba: bool = True) -> list[SampledToken]:
    """logits [R, V] fp32 on the device -> one SampledToken per work (typical_p ignored: see module doc)."""
    tokens, processed = sample_ids(logits, works, use_numba)
    return _to_sampled(tokens, processed, works)


def sample_ids(logits: torch.Tensor, works: list[SeqWork], use_numba: bool = True, pending=None, counts=None,
               step: Step | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The drawn ids [R] int64 and the processed logits, left on the device (no host sync). step: the rows'
    params as columns (see draw_ids)."""
    R, V = logits.shape
    dev = logits.device
    x = logits.float().contiguous().clone()
    bias_and_penalties(x, works, use_numba, pending, counts, step)
    tokens = torch.argmax(x, dim=-1)
    processed = x
    if step is not None:
        if step.greedy.all():
            return tokens, processed
        f, i, d = step.f, step.i, step.dev()
        filt = k.filter_logits(x, f[:, F_TEMP].contiguous(), i[:, I_TOP_K].contiguous(), f[:, F_TOP_P].contiguous(),
                               f[:, F_MIN_P].contiguous())
        g = k.gumbel_noise(i[:, I_SEED].contiguous(), d[1].contiguous(), V)
        is_greedy = to_device(torch.from_numpy(step.greedy), torch.bool, dev)
    else:
        ps = [w.params for w in works]
        greedy = [p.greedy for p in ps]
        if all(greedy):
            return tokens, processed
        f = lambda vals, dt: to_device(vals, dt, dev)  # noqa: E731
        temp = f([p.temperature if p.temperature > 0 else 1.0 for p in ps], torch.float32)
        filt = k.filter_logits(x, temp, f([p.top_k for p in ps], torch.int64), f([p.top_p for p in ps], torch.float32),
                               f([p.min_p for p in ps], torch.float32))
        g = k.gumbel_noise(f([p.seed for p in ps], torch.int64), f([w.gen_index for w in works], torch.int64), V)
        is_greedy = f(greedy, torch.bool)
    drawn = torch.argmax(filt + g, dim=-1)
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

    return torch.stack([torch.from_numpy(process(logits[r].float().cpu().numpy(), w)) for r, w in enumerate(works)])
