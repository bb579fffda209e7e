"""Attention over the paged KV cache, shared by every architecture.

`paged_attention` runs one step's attention from an `AttnPlan` (built once
per step by `llama.make_plan`): the decode rows batched into one SDPA call,
each prefill chunk in its own. `window_plan` derives the plan of a
sliding-window layer from it: same gathers, masks that also hide keys more
than `window - 1` positions behind the query (Gemma 3's local layers). The
blocks behind the window stay allocated and are gathered, just masked: the
window only bounds what a token sees, not what the cache holds.

Shapes: q [N, H, D], k/v [N, Hkv, D], kc/vc [num_blocks, block_size, Hkv, D].
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


def paged_attention(q, k, v, kc, vc, plan, scale: float | None = None) -> torch.Tensor:
    """[N, H, D] attention output; `scale` None = 1/sqrt(D) (SDPA's default)."""
    N, H, D = q.shape
    Hkv = kc.shape[-2]
    if plan.num_decode == N and plan.dec_rows is None:
        out = None  # whole step is decode: no scatter back needed
    else:
        out = q.new_empty(N, H, D)
    if plan.num_decode:
        Bd, L = plan.num_decode, plan.dec_len
        qd = q[:Bd] if plan.dec_rows is None else q.index_select(0, plan.dec_rows)  # decode rows lead
        # gather whole blocks (a few large copies rather than one per position)
        kd = kc.index_select(0, plan.dec_ctx).view(Bd, L, Hkv, D).transpose(1, 2)  # [Bd, Hkv, L, D]
        vd = vc.index_select(0, plan.dec_ctx).view(Bd, L, Hkv, D).transpose(1, 2)
        od = F.scaled_dot_product_attention(
            qd.unsqueeze(2).to(kd.dtype), kd, vd, attn_mask=plan.dec_mask, enable_gqa=True, scale=scale
        ).squeeze(2).to(q.dtype)  # [Bd, H, D]
        if out is None:
            return od
        if plan.dec_rows is None:
            out[:Bd] = od
        else:
            out.index_copy_(0, plan.dec_rows, od)
    for a, b, ctx, mask in plan.prefill:
        qs = q[a:b].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        if ctx is None:
            ks, vs = k[a:b], v[a:b]  # [T, Hkv, D]
        else:
            ks = kc.index_select(0, ctx).flatten(0, 1)  # [L, Hkv, D], L = blocks * block_size
            vs = vc.index_select(0, ctx).flatten(0, 1)
        ks = ks.transpose(0, 1).unsqueeze(0).to(qs.dtype)  # [1, Hkv, L, D]
        vs = vs.transpose(0, 1).unsqueeze(0).to(qs.dtype)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=ctx is None and mask is None, enable_gqa=True, scale=scale
        )  # [1, H, T, D]
        out[a:b] = o[0].transpose(0, 1)
    return out


def window_plan(plan, window: int):
    """The plan of a sliding-window layer: query at position p sees keys p-window+1 .. p.

    Same rule as llama.cpp (masked when p - j >= window) and HF
    (kv_idx > q_idx - sliding_window). Returns `plan` itself when no query
    in the step reaches past the window (short contexts: no extra masks).
    """
    pos = plan.positions
    if pos.numel() == 0 or int(pos.max()) < window:
        return plan
    dec_mask = plan.dec_mask
    if plan.num_decode:
        qpos = pos[: plan.num_decode] if plan.dec_rows is None else pos.index_select(0, plan.dec_rows)
        j = torch.arange(plan.dec_len)
        m = (j[None, :] <= qpos[:, None]) & (j[None, :] > qpos[:, None] - window)  # [Bd, L]
        dec_mask = m.view(plan.num_decode, 1, 1, plan.dec_len)
    prefill = []
    for a, b, ctx, mask in plan.prefill:
        qp = pos[a:b]  # [T] absolute positions of the chunk's queries
        if int(qp.max()) >= window:
            # keys: the chunk's own rows (ctx None: positions 0..T-1) or the gathered blocks from 0
            L = (b - a) if ctx is None else mask.shape[1]
            j = torch.arange(L)
            mask = (j[None, :] <= qp[:, None]) & (j[None, :] > qp[:, None] - window)  # [T, L]
        prefill.append((a, b, ctx, mask))
    return dataclasses.replace(plan, dec_mask=dec_mask, prefill=prefill)
