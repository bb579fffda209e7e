"""Qwen2: llama's block with biases on q/k/v and NEOX (rotate-half) RoPE.

Per layer, as llama.cpp's `llm_build_qwen2` and HF's Qwen2DecoderLayer:
    h = rms_norm(x) ; q, k, v = h Wq + bq, h Wk + bk, h Wv + bv ; rope(q, k)
    x = x + attn(q, k, v) Wo ; x = x + W2 (silu(h' Wg) * h' Wu), h' = rms_norm(x)
GGUF tensors: blk.N.attn_{q,k,v}.{weight,bias}, attn_output, attn_norm,
ffn_{gate,up,down}, ffn_norm; token_embd, output_norm, output (absent: tied).

`Qwen3` (qwen3.py) overrides `qkv()`; everything else is shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from imp.model.attention import paged_attention
from imp.model.blocks import Embedding, apply_rope_neox, head_linear, rms_norm, rope_table, split_heads, write_kv
from imp.formats.gguf_loader import ModelConfig
from imp.model.llama import AttnPlan, KVCache, Linear, attn_out_mlp


@dataclass
class QwenLayer:
    attn_norm: torch.Tensor  # [d]
    wqkv: Linear  # [(H + 2 Hkv) D, d]
    bqkv: torch.Tensor | None  # [(H + 2 Hkv) D] (qwen2) or None (qwen3)
    q_norm: torch.Tensor | None  # [D] (qwen3) or None (qwen2)
    k_norm: torch.Tensor | None  # [D]
    wo: Linear  # [d, H D]
    ffn_norm: torch.Tensor  # [d]
    w13: Linear  # [2 d_ff, d]  (gate rows, then up rows)
    w2: Linear  # [d, d_ff]


class Qwen2:
    def __init__(self, cfg: ModelConfig, tensors, weights: str = "int8", compile: bool = False):
        del compile  # accepted for the runner's signature; the glue is not compiled here
        self.cfg = cfg
        self.weights = weights
        scaling = cfg.extras.get("rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise NotImplementedError(f"{cfg.arch}: rope scaling {scaling!r} not supported yet")
        t = tensors
        self.tok_embd = Embedding.from_tensors(t, "token_embd.weight")
        self.layers = [self._layer(t, f"blk.{i}.", weights) for i in range(cfg.n_layers)]
        self.out_norm = t["output_norm.weight"].float()
        self.head = head_linear(t, "token_embd.weight" if cfg.tied_embeddings else "output.weight", weights)
        self.cos, self.sin = rope_table(cfg.rope_theta, cfg.head_dim, cfg.context_length)

    def _layer(self, t, p: str, weights: str) -> QwenLayer:
        qkv = [p + f"attn_{x}.weight" for x in "qkv"]
        biases = [p + f"attn_{x}.bias" for x in "qkv"]
        return QwenLayer(
            attn_norm=t[p + "attn_norm.weight"].float(),
            wqkv=Linear(torch.cat([t[n] for n in qkv]), weights),
            bqkv=torch.cat([t[n].float() for n in biases]) if biases[0] in t else None,
            q_norm=t[p + "attn_q_norm.weight"].float() if p + "attn_q_norm.weight" in t else None,
            k_norm=t[p + "attn_k_norm.weight"].float() if p + "attn_k_norm.weight" in t else None,
            wo=Linear(t[p + "attn_output.weight"], weights),
            ffn_norm=t[p + "ffn_norm.weight"].float(),
            w13=Linear(torch.cat([t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"]]), weights),
            w2=Linear(t[p + "ffn_down.weight"], weights),
        )

    def qkv(self, lyr: QwenLayer, h: torch.Tensor):
        """h [N, d] (normed) -> q [N, H, D], k, v [N, Hkv, D], before RoPE."""
        y = lyr.wqkv(h)
        if lyr.bqkv is not None:
            y = y + lyr.bqkv
        return split_heads(y, self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, plan: AttnPlan, cache: KVCache) -> torch.Tensor:
        """tokens [N] -> logits [B, vocab] fp32 at plan.last_rows."""
        cfg, eps = self.cfg, self.cfg.rms_eps
        x = self.tok_embd(tokens)  # [N, d]
        cos = self.cos.index_select(0, plan.positions).unsqueeze(1)  # [N, 1, D/2]
        sin = self.sin.index_select(0, plan.positions).unsqueeze(1)
        for i, lyr in enumerate(self.layers):
            q, k, v = self.qkv(lyr, rms_norm(x, lyr.attn_norm, eps))
            q, k = apply_rope_neox(q, cos, sin), apply_rope_neox(k, cos, sin)
            kc, vc = write_kv(cache, i, plan, k, v)
            a = paged_attention(q, k, v, kc, vc, plan)  # [N, H, D]
            x = attn_out_mlp(x, a, lyr.wo.args, lyr.ffn_norm, lyr.w13.args, lyr.w2.args, eps)
        if plan.last_rows.numel() == 0:  # the step only filled the cache
            return x.new_empty(0, cfg.vocab_size)
        x = rms_norm(x.index_select(0, plan.last_rows), self.out_norm, eps)  # [B, d]
        return self.head(x)  # [B, vocab]
