"""Sampling kernels: logit bias scattered into logits rows (Numba, with a torch
fallback), the penalties of a step in one CuPy launch (`penalize_segments`:
host-counted histories plus each row's token still in flight on the device),
temperature / top-k / top-p / min-p filtering (torch, batched) and a
counter-based Gumbel draw (CuPy).

The Gumbel noise is hashed from (seed, gen_index, token id), so a row's draw
depends only on its sequence, not on the batch it ran in. The sampler that
drives these over a step's sequences is `imp.sampling.gpu`.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from imp.kernels.cuda import runtime as cu

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
    // u in (0, 1) strictly: 23 random bits + 0.5 are exact in a float (24 bits would round
    // 2^24 - 0.5 up to 2^24, u = 1, noise +inf, and -inf + inf = NaN wins the argmax: a filtered
    // or grammar-masked token drawn about once in 2^24 / V steps)
    const float u = ((float)(h >> 41) + 0.5f) * (1.0f / 8388608.0f);
    out[i] = -logf(-logf(u));
}
"""


# One block per penalized row ("segment"): its distinct history ids with their counts (host-counted, sorted),
# and optionally the token the step in flight sampled for it, read on the device (src[psrc]). Each distinct id
# is touched by one thread: repetition once, presence once, frequency per occurrence, in the order and
# rounding of the CPU reference (imp.sampling.cpu.apply_penalties; no contraction: __fmul_rn / __fsub_rn). The in-flight token adds one to its count
# if the history has it, else it is penalized alone with count 1.
# meta (int32): row[S] | off[S+1] | psrc[S] (-1: none) | params[3S] (float32 bits) | ids[E] | cnt[E]
PENALIZE_SRC = r"""
__device__ __forceinline__ float pen1(float x, float rep, float pres, float freq, float c) {
    if (rep != 1.0f) x = x > 0.0f ? __fdiv_rn(x, rep) : __fmul_rn(x, rep);
    x = __fsub_rn(x, pres);
    return __fsub_rn(x, __fmul_rn(freq, c));
}
extern "C" __global__ void penalize_segments(float* __restrict__ logits, int V, const int* __restrict__ meta, int S,
                                             const int* __restrict__ src) {
    const int s = blockIdx.x;
    if (s >= S) return;
    const int* off = meta + S;
    const int* psrc = off + S + 1;
    const float* prm = (const float*)(psrc + S) + 3 * s;
    const int* ids = psrc + 4 * S;
    const int* cnt = ids + off[S];
    const int r = meta[s], a = off[s], b = off[s + 1];
    int pend = psrc[s] >= 0 ? src[psrc[s]] : -1;
    if (pend >= V) pend = -1;
    const float rep = prm[0], pres = prm[1], freq = prm[2];
    float* L = logits + (size_t)r * V;
    int found = 0;
    for (int e = a + threadIdx.x; e < b; e += blockDim.x) {
        const int t = ids[e];
        const int hit = t == pend;
        found |= hit;
        L[t] = pen1(L[t], rep, pres, freq, (float)(cnt[e] + hit));
    }
    found = __syncthreads_or(found);
    if (threadIdx.x == 0 && pend >= 0 && !found) L[pend] = pen1(L[pend], rep, pres, freq, 1.0f);
}
"""


def penalize_segments(logits: torch.Tensor, meta: torch.Tensor, S: int, src: torch.Tensor | None) -> None:
    """In place on logits [R, V] fp32: the penalties that `imp.sampling.gpu.penalty_segments` packed
    into meta (int32, on logits' device); src: the device ids the segments' psrc index (int32), or None
    when no segment has one in flight. CUDA: one launch; CPU tensors: the same rule in numpy (tests)."""
    if not S:
        return
    V = logits.shape[1]
    if logits.is_cuda:
        cu.check(logits, "logits", torch.float32, 2)
        cu.check(meta, "meta", torch.int32, 1)
        if src is not None:
            cu.check(src, "src", torch.int32, 1)
        cu.launch(cu.function(PENALIZE_SRC, "penalize_segments"), (S,), (THREADS,),
                  (cu.ptr(logits), cu.i32(V), cu.ptr(meta), cu.i32(S), cu.ptr(src)))
        return
    m = meta.numpy()
    off = m[S:2 * S + 1]
    psrc = m[2 * S + 1:3 * S + 1]
    prm = m[3 * S + 1:6 * S + 1].view(np.float32).reshape(S, 3)
    ids, cnt = m[6 * S + 1:6 * S + 1 + off[S]], m[6 * S + 1 + off[S]:]
    L = logits.numpy()
    srcn = src.numpy() if src is not None else None
    f = np.float32

    def pen1(x, rep, pres, freq, c):
        if rep != f(1):
            x = x / rep if x > 0 else x * rep
        return f(f(x - pres) - f(freq * f(c)))

    for s_ in range(S):
        r, rep, pres, freq = m[s_], *prm[s_]
        pend = int(srcn[psrc[s_]]) if psrc[s_] >= 0 else -1
        pend = -1 if pend >= V else pend
        seg = range(off[s_], off[s_ + 1])
        for e in seg:
            t = ids[e]
            L[r, t] = pen1(L[r, t], rep, pres, freq, cnt[e] + (t == pend))
        if pend >= 0 and not any(ids[e] == pend for e in seg):
            L[r, pend] = pen1(L[r, pend], rep, pres, freq, 1)


# One thread per (penalized row, vocabulary id): the row's counts live on the device (imp.sampling.devcounts: a row
# of V int32 per sequence, kept across steps), so the host sends no history; an id with a zero count is untouched,
# the others get pen1 with their count, the rounding of the segment kernel and the CPU reference.
PENALIZE_DENSE_SRC = PENALIZE_SRC + r"""
extern "C" __global__ void penalize_dense(float* __restrict__ logits, int V, const int* __restrict__ table,
                                          const long long* __restrict__ rows, const long long* __restrict__ slots,
                                          const float* __restrict__ prm, int S) {
    const int s = blockIdx.y;
    const int v = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= S || v >= V) return;
    const int c = table[(size_t)slots[s] * V + v];
    if (c == 0) return;
    float* L = logits + (size_t)rows[s] * V;
    L[v] = pen1(L[v], prm[3 * s], prm[3 * s + 1], prm[3 * s + 2], (float)c);
}
"""


COUNT_ADD_SRC = r"""
extern "C" __global__ void count_add(int* __restrict__ table, int V, const long long* __restrict__ slots,
                                     const long long* __restrict__ ids, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(table + (size_t)slots[i] * V + ids[i], 1);
}
"""


def count_add(table: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> None:
    """table[slots[i], ids[i]] += 1 for every i (int32 [cap, V]; slots / ids int64 [n] on its device). CUDA: one
    launch of atomic adds (torch's index_put_(accumulate=True) sorts: several launches a step, and on the H100 the
    sampler with it ran 16-stream steps 1.6 -> 2.4 ms); CPU tensors: index_put_."""
    n = slots.shape[0]
    if not n:
        return
    if table.is_cuda:
        cu.check(table, "table", torch.int32, 2)
        cu.launch(cu.function(COUNT_ADD_SRC, "count_add"), ((n + THREADS - 1) // THREADS,), (THREADS,),
                  (cu.ptr(table), cu.i32(table.shape[1]), cu.ptr(slots.contiguous()), cu.ptr(ids.contiguous()),
                   cu.i32(n)))
        return
    table.index_put_((slots, ids), torch.ones(n, dtype=torch.int32), accumulate=True)


def penalize_dense(logits: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                   prm: torch.Tensor) -> None:
    """In place on logits [R, V] fp32: row rows[s] penalized by the counts table[slots[s]] ([cap, V] int32) with
    prm[s] = (repetition, presence, frequency) (float32 [S, 3]); rows / slots int64 [S]. CUDA: one launch; CPU
    tensors: the same rule in torch (tests)."""
    S, V = rows.shape[0], logits.shape[1]
    if not S:
        return
    if logits.is_cuda:
        cu.check(logits, "logits", torch.float32, 2)
        cu.check(table, "table", torch.int32, 2)
        cu.launch(cu.function(PENALIZE_DENSE_SRC, "penalize_dense"), ((V + THREADS - 1) // THREADS, S), (THREADS,),
                  (cu.ptr(logits), cu.i32(V), cu.ptr(table), cu.ptr(rows.contiguous()), cu.ptr(slots.contiguous()),
                   cu.ptr(prm.contiguous()), cu.i32(S)))
        return
    c = table.index_select(0, slots)  # [S, V]
    x = logits.index_select(0, rows)
    rep, pres, freq = (prm[:, i:i + 1] for i in range(3))
    y = torch.where(rep != 1.0, torch.where(x > 0, x / rep, x * rep), x)
    y = (y - pres) - freq * c.to(torch.float32)
    logits.index_copy_(0, rows, torch.where(c > 0, y, x))


@functools.lru_cache(maxsize=None)
def _nb_add_bias():
    global cuda  # a module global, so the CUDA simulator can swap it in tests
    cuda = cu.numba_cuda()

    @cuda.jit
    def add_bias(logits, rows, ids, vals):
        e = cuda.grid(1)
        if e < ids.shape[0]:
            logits[rows[e], ids[e]] += vals[e]

    return add_bias


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


def add_bias(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor,
             use_numba: bool = True) -> None:
    """logits[rows[e], ids[e]] += vals[e], in place; logits [R, V] fp32 contiguous, the rest [E]."""
    cu.check(logits, "logits", torch.float32, 2)
    cu.check(rows, "rows", torch.int32, 1)
    cu.check(ids, "ids", torch.int32, 1)
    cu.check(vals, "vals", torch.float32, 1)
    if not ids.shape[0]:
        return
    if use_numba:
        kernel = _nb_add_bias()
        cu.nb_launch(kernel, (ids.shape[0] + THREADS - 1) // THREADS, THREADS, logits, rows, ids, vals)
    else:
        logits.index_put_((rows.long(), ids.long()), vals, accumulate=True)


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
