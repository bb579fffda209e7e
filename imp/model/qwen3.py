"""Qwen3: Qwen2's block without q/k/v biases, with a per-head RMSNorm of q and
k (weights [D], shared by the heads) before RoPE, as llama.cpp's
`llm_build_qwen3` and HF's Qwen3Attention. GGUF adds blk.N.attn_q_norm and
attn_k_norm; head_dim comes from `qwen3.attention.key_length` (128 in the
released models, where H * D != d).
"""

from __future__ import annotations

import torch

from imp.model.blocks import rms_norm
from imp.model.qwen2 import Qwen2, QwenLayer


class Qwen3(Qwen2):
    def qkv(self, lyr: QwenLayer, h: torch.Tensor):
        q, k, v = super().qkv(lyr, h)  # no bias in the file: the add is skipped
        eps = self.cfg.rms_eps
        return rms_norm(q, lyr.q_norm, eps), rms_norm(k, lyr.k_norm, eps), v
