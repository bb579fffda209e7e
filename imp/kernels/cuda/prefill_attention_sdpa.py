"""Prefill attention (many query rows of one sequence), through torch SDPA.

First step, as the issue allows: torch's scaled_dot_product_attention picks
FlashAttention-2 for bf16 (causal, no mask) and the memory-efficient kernel
for fp32 or masked calls; a tiled kernel of our own is future work. K/V heads
are repeated to H so every backend accepts GQA.

Two cases:
  no cached prefix: q, k, v are the chunk's own rows; causal.
  cached prefix: K/V come from the paged cache (blocks of the context, the
  chunk's rows already written there); row i sees positions <= start + i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                      kc: torch.Tensor, vc: torch.Tensor, ctx_blocks: torch.Tensor | None, start: int,
                      n_heads: int, out: torch.Tensor) -> torch.Tensor:
    """q [T, H*D] fp32; k/v [T, Hkv*D] fp32 (used when ctx_blocks is None);
    kc/vc [num_blocks, bs, Hkv, D]; ctx_blocks [nb] int64 block ids; out [T, H*D] fp32."""
    T = q.shape[0]
    _, bs, Hkv, D = kc.shape
    G = n_heads // Hkv
    dt = kc.dtype
    qs = q.reshape(T, n_heads, D).transpose(0, 1).unsqueeze(0).to(dt)  # [1, H, T, D]
    if ctx_blocks is None:
        ks = k.reshape(T, Hkv, D).to(dt)
        vs = v.reshape(T, Hkv, D).to(dt)
        mask, causal = None, True
    else:
        nb = ctx_blocks.shape[0]
        ks = kc.index_select(0, ctx_blocks).reshape(nb * bs, Hkv, D)
        vs = vc.index_select(0, ctx_blocks).reshape(nb * bs, Hkv, D)
        pos = torch.arange(nb * bs, device=q.device)
        mask = pos[None, :] <= (start + torch.arange(T, device=q.device))[:, None]  # [T, L]
        causal = False
    ks = ks.transpose(0, 1).repeat_interleave(G, dim=0).unsqueeze(0)  # [1, H, L, D]
    vs = vs.transpose(0, 1).repeat_interleave(G, dim=0).unsqueeze(0)
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal)  # [1, H, T, D]
    out.copy_(o[0].transpose(0, 1).reshape(T, n_heads * D))
    return out


def reference(q, k, v, n_heads: int) -> torch.Tensor:
    """Causal attention in float64, no cache: q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]."""
    T = q.shape[0]
    Hkv = k.shape[1] // (q.shape[1] // n_heads)
    D = q.shape[1] // n_heads
    G = n_heads // Hkv
    qs = q.double().view(T, n_heads, D).transpose(0, 1)
    ks = k.double().view(T, Hkv, D).transpose(0, 1).repeat_interleave(G, 0)
    vs = v.double().view(T, Hkv, D).transpose(0, 1).repeat_interleave(G, 0)
    s = qs @ ks.transpose(1, 2) / D ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ vs).transpose(0, 1).reshape(T, n_heads * D)
