"""A step's head rows and prompt scoring, shared by the CPU and GPU runners.

The head (final norm + vocabulary projection) runs only on the rows a step
needs: each sampling sequence's last new token, and every row of a chunk
whose prompt tokens are scored (vLLM prompt_logprobs).
"""

from __future__ import annotations

import msgspec
import numpy as np

from imp.messages import PromptLogprob, SampledToken, SeqWork
from imp.sampling.cpu import LOGPROB_FLOOR, topk


def host(x) -> np.ndarray:
    """fp32 rows on the host as numpy: a numpy array as it is, a torch tensor (any device) copied."""
    return x if isinstance(x, np.ndarray) else x.float().cpu().numpy()


def head_rows(seqs: list[SeqWork]) -> tuple[list[int], dict[int, int], dict[int, tuple[int, int]]]:
    """Which of a step's new-token rows the head runs on (both runners).

    Returns rows (indices into the step's N new tokens), sample_at (seq index ->
    index in rows of its last token, for seqs that sample; of the first of its draft + 1 last
    tokens for a verify share, whose rows follow in order) and plp_at (seq index ->
    (first index in rows, count) for seqs scoring prompt tokens: row j scores the
    token at position start+j+1, the last one prompt_next when given).
    """
    rows: list[int] = []
    sample_at: dict[int, int] = {}
    plp_at: dict[int, tuple[int, int]] = {}
    base = 0
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        if s.prompt_logprobs >= 0:
            count = n if s.prompt_next >= 0 else n - 1
            plp_at[i] = (len(rows), count)
            rows.extend(range(base, base + count))
        if s.sample:
            sample_at[i] = len(rows)
            rows.extend(range(base + n - 1 - s.draft, base + n))
        base += n
    return rows, sample_at, plp_at


def with_prompt_logprobs(seqs: list[SeqWork], drawn: dict[int, SampledToken], plp_at: dict[int, tuple[int, int]],
                         logits) -> list[SampledToken]:
    """One SampledToken per seq that sampled or scored prompt tokens, in seq order;
    prompt rows scored from logits (any device) by `prompt_logprobs`. A seq that
    only scored gets token_id -1."""
    out = []
    for i, s in enumerate(seqs):
        t = drawn.get(i)
        if i in plp_at:
            first, count = plp_at[i]
            scored = prompt_logprobs(host(logits[first:first + count]), s)
            t = msgspec.structs.replace(t or SampledToken(seq_id=s.seq_id, token_id=-1), prompt=scored)
        if t is not None:
            out.append(t)
    return out


def prompt_logprobs(logits: np.ndarray, s: SeqWork) -> tuple[PromptLogprob, ...]:
    """Raw log-softmax scores of the prompt tokens after each row of the chunk (logits [T, vocab])."""
    if logits.shape[0] == 0:
        return ()
    targets = (list(s.token_ids[1:]) + ([s.prompt_next] if s.prompt_next >= 0 else []))[: logits.shape[0]]
    x = host(logits).astype(np.float32, copy=False)
    m = x.max(-1, keepdims=True)
    logp = np.maximum((x - m) - np.log(np.exp(x - m).sum(-1, keepdims=True)), np.float32(LOGPROB_FLOOR))
    tgt = np.asarray(targets, dtype=np.int64)
    chosen = logp[np.arange(len(targets)), tgt]  # [T]
    ranks = (logp[: len(targets)] > chosen[:, None]).sum(-1) + 1
    k = s.prompt_logprobs
    tops = [()] * len(targets)
    if k > 0:
        tops = []
        for j in range(len(targets)):
            v, i = topk(logp[j], k)
            tops.append(tuple(zip(i.tolist(), v.tolist())))
    return tuple(
        PromptLogprob(position=s.start_pos + j + 1, token_id=t, logprob=lp, rank=r, top=tops[j])
        for j, (t, lp, r) in enumerate(zip(targets, chosen.tolist(), ranks.tolist()))
    )
