"""Sampling on the device: logit bias + penalties (Numba), temperature, top-k,
top-p, min-p (torch, batched), a counter-based Gumbel draw (CuPy), logprobs.

Semantics follow `imp.model.sampling` (the CPU reference): bias -> penalties
-> (greedy: argmax) -> /temperature -> top_k -> top_p -> min_p -> draw.
The draw is Gumbel-max with noise hashed from (seed, gen_index, token id),
so it depends only on the sequence (not the batch it ran in), like the CPU
runner's; the CPU and GPU runners draw *different* tokens from the same
distribution (only greedy tokens are comparable across them).
typical_p < 1 is not done here: `GpuModelRunner` sends such rows to the CPU
sampler.
"""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import torch

from imp.kernels import _cuda as cu
from imp.messages import SampledToken, SeqWork
from imp.model.sampling import LOGPROB_FLOOR

cuda = None  # numba.cuda, bound on first use
THREADS = 128

GUMBEL_SRC = r"""
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
extern "C" __global__ void gumbel(float* __restrict__ out, const long long* __restrict__ seeds,
                                  const long long* __restrict__ gidx, int V, int R) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)V * R) return;
    const int r = (int)(i / V), v = (int)(i % V);
    const unsigned long long h = mix64(mix64(mix64((unsigned long long)seeds[r]) ^ (unsigned long long)gidx[r]) ^ (unsigned long long)v);
    const float u = ((float)(h >> 40) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
    out[i] = -logf(-logf(u));
}
"""


@functools.lru_cache(maxsize=None)
def _nb_kernels():
    global cuda  # a module global, so the CUDA simulator can swap it in tests
    cuda = cu.numba_cuda()

    @cuda.jit
    def add_bias(logits, rows, ids, vals):
        e = cuda.grid(1)
        if e < ids.shape[0]:
            logits[rows[e], ids[e]] += vals[e]

    @cuda.jit
    def penalize(logits, rows, ids, counts, params):
        e = cuda.grid(1)
        if e < ids.shape[0]:
            r = rows[e]
            x = logits[r, ids[e]]
            rep = params[r, 0]
            if rep != 1.0:
                x = x / rep if x > 0 else x * rep
            x -= params[r, 1]
            x -= params[r, 2] * counts[e]
            logits[r, ids[e]] = x

    return add_bias, penalize


def gumbel_noise(seeds: torch.Tensor, gen_index: torch.Tensor, vocab: int) -> torch.Tensor:
    cu.check(seeds, "seeds", torch.int64, 1)
    cu.check(gen_index, "gen_index", torch.int64, 1)
    R = seeds.shape[0]
    out = torch.empty(R, vocab, dtype=torch.float32, device=seeds.device)
    total = R * vocab
    if total:
        cu.launch(cu.function(GUMBEL_SRC, "gumbel"), ((total + 255) // 256,), (256,),
                  (cu.ptr(out), cu.ptr(seeds), cu.ptr(gen_index), cu.i32(vocab), cu.i32(R)))
    return out


def bias_and_penalties(logits: torch.Tensor, works: list[SeqWork], use_numba: bool = True) -> torch.Tensor:
    """In place on logits [R, V] fp32 (contiguous): logit_bias, then repetition/presence/frequency."""
    V = logits.shape[1]
    b_rows, b_ids, b_vals = [], [], []
    p_rows, p_ids, p_cnt = [], [], []
    params = np.zeros((len(works), 3), np.float32)
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
        if w.history and (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0):
            c = Counter(t for t in w.history if 0 <= t < V)
            p_rows += [r] * len(c)
            p_ids += list(c)
            p_cnt += list(c.values())
    dev = logits.device
    if b_ids:
        rows = torch.tensor(b_rows, dtype=torch.int32, device=dev)
        ids = torch.tensor(b_ids, dtype=torch.int32, device=dev)
        vals = torch.tensor(b_vals, dtype=torch.float32, device=dev)
        if use_numba:
            add_bias, _ = _nb_kernels()
            cu.nb_launch(add_bias, (len(b_ids) + THREADS - 1) // THREADS, THREADS, logits, rows, ids, vals)
        else:
            logits.index_put_((rows.long(), ids.long()), vals, accumulate=True)
    if p_ids:
        rows = torch.tensor(p_rows, dtype=torch.int32, device=dev)
        ids = torch.tensor(p_ids, dtype=torch.int32, device=dev)
        cnt = torch.tensor(p_cnt, dtype=torch.float32, device=dev)
        prm = torch.from_numpy(params).to(dev)
        if use_numba:
            _, penalize = _nb_kernels()
            cu.nb_launch(penalize, (len(p_ids) + THREADS - 1) // THREADS, THREADS, logits, rows, ids, cnt, prm)
        else:
            r_, i_ = rows.long(), ids.long()
            x = logits[r_, i_]
            rep = prm[r_, 0]
            x = torch.where(rep != 1.0, torch.where(x > 0, x / rep, x * rep), x)
            logits[r_, i_] = x - prm[r_, 1] - prm[r_, 2] * cnt
    return logits


def filter_logits(x: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Rows of x [R, V] tempered and filtered (-inf outside the kept set); temp > 0 rows only."""
    R, V = x.shape
    ninf = float("-inf")
    x = x / temp[:, None]
    srt, order = torch.sort(x, dim=-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k >= V), torch.full_like(top_k, V), top_k)
    kth = srt.gather(1, (k - 1).long()[:, None])  # [R, 1]
    srt = srt.masked_fill(srt < kth, ninf)
    p = torch.softmax(srt, -1)
    drop_sorted = ((p.cumsum(-1) - p) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    x = x.masked_fill((x < kth) | drop, ninf)
    probs = torch.softmax(x, -1)
    x = x.masked_fill((probs < min_p[:, None] * probs.amax(-1, keepdim=True)) & (min_p[:, None] > 0), ninf)
    return x


def sample(logits: torch.Tensor, works: list[SeqWork], use_numba: bool = True) -> list[SampledToken]:
    """logits [R, V] fp32 on the device -> one SampledToken per work (typical_p ignored: see module doc)."""
    tokens, processed = sample_ids(logits, works, use_numba)
    return _to_sampled(tokens, processed, works)


def sample_ids(logits: torch.Tensor, works: list[SeqWork], use_numba: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The drawn ids [R] int64 and the processed logits, left on the device (no host sync)."""
    R, V = logits.shape
    dev = logits.device
    x = logits.float().contiguous().clone()
    bias_and_penalties(x, works, use_numba)
    ps = [w.params for w in works]
    greedy = [p.temperature <= 0.0 for p in ps]
    tokens = torch.argmax(x, dim=-1)
    processed = x
    if not all(greedy):
        f = lambda vals, dt: torch.tensor(vals, dtype=dt, device=dev)  # noqa: E731
        temp = f([p.temperature if p.temperature > 0 else 1.0 for p in ps], torch.float32)
        filt = filter_logits(x, temp, f([p.top_k for p in ps], torch.int64), f([p.top_p for p in ps], torch.float32),
                             f([p.min_p for p in ps], torch.float32))
        g = gumbel_noise(f([p.seed for p in ps], torch.int64), f([w.gen_index for w in works], torch.int64), V)
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
        k = ps[r].logprobs
        if k < 0:
            out.append(SampledToken(seq_id=w.seq_id, token_id=t))
            continue
        top = tuple(zip(top_i[r][:k], top_v[r][:k])) if k > 0 else ()
        out.append(SampledToken(seq_id=w.seq_id, token_id=t, logprob=float(chosen[r]), top=top))
    return out


def reference_processed(logits: torch.Tensor, works: list[SeqWork]) -> torch.Tensor:
    """CPU reference: imp.model.sampling.process row by row (float32)."""
    from imp.model.sampling import process

    return torch.stack([process(logits[r].cpu(), w) for r, w in enumerate(works)])
