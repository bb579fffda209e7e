"""Gemma 3 (text): sliding-window and global layers, q/k norms, GeGLU, four
norms per block, scaled embeddings, tied head.

Per layer, as llama.cpp's `llm_build_gemma3_iswa` and HF's Gemma3DecoderLayer:
    h = rms_norm(x)                            attn_norm
    q, k, v = h Wq, h Wk, h Wv ; q, k = rms_norm(q), rms_norm(k)   per head, [D] weights
    q, k = rope(q), rope(k)                    NEOX; theta 10k local, rope.freq_base global
    x = x + rms_norm(attn(q, k, v) Wo)         post_attention_norm
    x = x + rms_norm(W2 (gelu_tanh(h' Wg) * h' Wu)), h' = rms_norm(x)   ffn_norm, post_ffw_norm
and x0 = embedding * sqrt(d), logits = rms_norm(x) E^T (tied).

Norm weights: HF computes x_normed * (1 + w); llama.cpp's converter stores
1 + w in the GGUF, so GGUF norms are plain multipliers (HF's GGUF loader
subtracts 1 again). An HF directory (hf_dir.py) adds the 1 when it loads.

Layer pattern: llama.cpp hard-codes a period of 6 for gemma3 (layers 5, 11,
17 global, the rest see the last `attention.sliding_window` = 512 tokens);
HF's config has the same `layer_types`. An explicit per-layer bool list in
`attention.sliding_window_pattern` (newer converters) wins.

Query scale: 1/sqrt(query_pre_attn_scalar), which llama.cpp sets to
1/sqrt(head_dim) for every size but 27B (where it is d / H = 168 != D = 128);
a GGUF does not record it, so `attention.query_pre_attn_scalar` (set by
hf_dir.py from config.json) overrides head_dim. Gemma 3 has no attention or
final-logit softcapping; a `final_logit_softcapping` key is still honoured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from imp.model.attention import paged_attention, window_plan
from imp.model.blocks import Embedding, apply_rope_neox, head_linear, rms_norm, rope_table, split_heads, write_kv
from imp.formats.gguf_loader import ModelConfig
from imp.model.llama import AttnPlan, KVCache, Linear
from imp.model.paged import LOCAL_THETA, SWA_PERIOD, sliding_layers  # noqa: F401 (re-exported)



@dataclass
class GemmaLayer:
    attn_norm: torch.Tensor  # [d]
    wqkv: Linear  # [(H + 2 Hkv) D, d]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    wo: Linear  # [d, H D]
    post_attn_norm: torch.Tensor  # [d]
    ffn_norm: torch.Tensor  # [d]
    w13: Linear  # [2 d_ff, d]  (gate rows, then up rows)
    w2: Linear  # [d, d_ff]
    post_ffn_norm: torch.Tensor  # [d]
    sliding: bool


class Gemma3:
    def __init__(self, cfg: ModelConfig, tensors, weights: str = "int8", compile: bool = False):
        del compile  # accepted for the runner's signature
        self.cfg = cfg
        self.weights = weights
        ex = cfg.extras
        if ex.get("attn_logit_softcapping"):
            raise NotImplementedError("gemma3: attention logit softcapping not supported")
        self.window = int(ex.get("attention.sliding_window", 0)) or None
        self.final_softcap = float(ex.get("final_logit_softcapping") or 0.0)
        self.scale = float(ex.get("attention.query_pre_attn_scalar", cfg.head_dim)) ** -0.5
        self.embed_scale = math.sqrt(cfg.d_model)
        t = tensors
        self.tok_embd = Embedding.from_tensors(t, "token_embd.weight")
        flags = sliding_layers(cfg)
        self.layers = [self._layer(t, f"blk.{i}.", weights, flags[i] and self.window is not None)
                       for i in range(cfg.n_layers)]
        self.out_norm = t["output_norm.weight"].float()
        self.head = head_linear(t, "token_embd.weight" if cfg.tied_embeddings else "output.weight", weights)
        D, P = cfg.head_dim, cfg.context_length
        # local layers: plain RoPE at 10k; global: rope.freq_base, with linear scaling if the file says so
        self.rope_local = rope_table(float(ex.get("rope.freq_base_swa", LOCAL_THETA)), D, P)
        scaling = ex.get("rope.scaling.type", "none")
        if scaling not in ("none", None, "linear"):
            raise NotImplementedError(f"gemma3: rope scaling {scaling!r} not supported")
        factor = float(ex.get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        self.rope_global = rope_table(cfg.rope_theta, D, P, factor)

    @staticmethod
    def _layer(t, p: str, weights: str, sliding: bool) -> GemmaLayer:
        def norm(name):
            return t[p + name + ".weight"].float()

        return GemmaLayer(
            attn_norm=norm("attn_norm"),
            wqkv=Linear(torch.cat([t[p + f"attn_{x}.weight"] for x in "qkv"]), weights),
            q_norm=norm("attn_q_norm"),
            k_norm=norm("attn_k_norm"),
            wo=Linear(t[p + "attn_output.weight"], weights),
            post_attn_norm=norm("post_attention_norm"),
            ffn_norm=norm("ffn_norm"),
            w13=Linear(torch.cat([t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"]]), weights),
            w2=Linear(t[p + "ffn_down.weight"], weights),
            post_ffn_norm=norm("post_ffw_norm"),
            sliding=sliding,
        )

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, plan: AttnPlan, cache: KVCache) -> torch.Tensor:
        """tokens [N] -> logits [B, vocab] fp32 at plan.last_rows."""
        cfg, eps = self.cfg, self.cfg.rms_eps
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        x = self.tok_embd(tokens) * self.embed_scale  # [N, d]
        ropes = {}
        for name, (c, s) in (("local", self.rope_local), ("global", self.rope_global)):
            ropes[name] = (c.index_select(0, plan.positions).unsqueeze(1),  # [N, 1, D/2]
                           s.index_select(0, plan.positions).unsqueeze(1))
        local_plan = window_plan(plan, self.window) if self.window else plan  # masks built once per step
        for i, lyr in enumerate(self.layers):
            cos, sin = ropes["local" if lyr.sliding else "global"]
            q, k, v = split_heads(lyr.wqkv(rms_norm(x, lyr.attn_norm, eps)), H, Hkv, D)
            q = apply_rope_neox(rms_norm(q, lyr.q_norm, eps), cos, sin)
            k = apply_rope_neox(rms_norm(k, lyr.k_norm, eps), cos, sin)
            kc, vc = write_kv(cache, i, plan, k, v)
            a = paged_attention(q, k, v, kc, vc, local_plan if lyr.sliding else plan, scale=self.scale)
            x = x + rms_norm(lyr.wo(a.flatten(1)), lyr.post_attn_norm, eps)
            g, u = lyr.w13(rms_norm(x, lyr.ffn_norm, eps)).chunk(2, dim=-1)  # [N, d_ff] each
            x = x + rms_norm(lyr.w2(F.gelu(g, approximate="tanh") * u), lyr.post_ffn_norm, eps)
        if plan.last_rows.numel() == 0:  # the step only filled the cache
            return x.new_empty(0, cfg.vocab_size)
        x = rms_norm(x.index_select(0, plan.last_rows), self.out_norm, eps)  # [B, d]
        logits = self.head(x)  # [B, vocab]
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
