"""Building blocks the non-llama architectures share (llama.py holds the rest:
Linear, KVCache, AttnPlan, make_plan, the SiLU-gated MLP).

Shapes as in llama.py: N new tokens, H / Hkv heads, D head_dim, d model width.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from imp.model.llama import Linear
from imp.model.paged import rope_table_ggml
from imp.formats.quants import dequantize


def rope_table(theta: float, dim: int, max_pos: int, linear_factor: float = 1.0, ggml: bool = False):
    """cos, sin [max_pos, dim/2]: pair i turns by (pos / linear_factor) * theta^(-2i/dim).

    ggml: the angles as llama.cpp's CPU rope computes them, in float32: theta_i = pos * s^i by
    repeated multiplication (s = powf(theta, -2/dim)), times 1/linear_factor, then cosf / sinf.
    Up to ~1e-6 relative from the exact angles at long positions: the GGUF forward takes them so
    that its greedy text follows llama.cpp's on near-ties (issue 15 §5)."""
    if ggml:
        return tuple(torch.from_numpy(a) for a in rope_table_ggml(theta, dim, max_pos, linear_factor))
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)) / linear_factor
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [N, heads, D]; cos/sin [N, 1, D/2]. "NEOX" rope (llama.cpp's name; HF's
    # rotate_half): element i pairs with i + D/2. llama.cpp's converter leaves
    # the Q/K rows of qwen2/qwen3/gemma3 in HF order, so these archs rotate
    # halves, where llama (whose rows the converter permutes) rotates adjacent pairs.
    x0, x1 = x.chunk(2, dim=-1)
    return torch.cat((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # over the last dim: [N, d] with w [d], or per head [N, heads, D] with w [D]
    return F.rms_norm(x, (x.shape[-1],), w, eps)


class Embedding:
    """Token id -> row, without an fp32 copy of the table when the GGUF has one.

    Gemma's table is 262144 x 640: 671 MB in fp32, 178 MB as the file's Q8_0
    blocks. From a memory-mapped GGUF we keep the encoded rows and dequantize
    only the rows a step looks up (dequantization is per block, so the values
    equal a full dequantization bit for bit). Other sources keep a tensor.
    """

    def __init__(self, table: torch.Tensor | None = None, raw: np.ndarray | None = None, qtype=None, dim: int = 0):
        self.table, self.raw, self.qtype, self.dim = table, raw, qtype, dim

    @classmethod
    def from_tensors(cls, tensors, name: str) -> "Embedding":
        if hasattr(tensors, "raw"):  # a lazy GGUF mapping (gguf_loader.GGUFTensors)
            info = tensors.info(name)
            return cls(raw=tensors.raw(name), qtype=info.qtype, dim=info.shape[-1])
        return cls(table=tensors[name].float().contiguous())

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens [N] -> [N, d] fp32
        if self.table is not None:
            return F.embedding(tokens, self.table)
        rows = self.raw[tokens.numpy()]  # [N, bytes_per_row], a copy out of the map
        return torch.from_numpy(dequantize(rows, self.qtype, (len(rows), self.dim)).copy())


def head_linear(tensors, name: str, weights: str, chunk: int = 16384) -> Linear:
    """The output head. It only ever sees B rows (last positions), never a
    prefill's N, so "hybrid" keeps just the int8 copy. From a GGUF, int8 is
    built from row chunks: Gemma's tied 262144 x 640 head never exists in fp32."""
    weights = "int8" if weights == "hybrid" else weights
    if weights != "int8" or not hasattr(tensors, "rows"):
        return Linear(tensors[name], weights)
    n = tensors.info(name).shape[0]
    return Linear.int8_from_chunks(tensors.rows(name, r, min(r + chunk, n)) for r in range(0, n, chunk))


def write_kv(cache, i: int, plan, k: torch.Tensor, v: torch.Tensor):
    """Store the step's k/v [N, Hkv, D] at their slots; return layer i's (kc, vc)."""
    kc, vc = cache.layer(i)  # [num_blocks, block_size, Hkv, D]
    Hkv, D = kc.shape[-2:]
    kc.view(-1, Hkv, D).index_copy_(0, plan.slots, k.to(kc.dtype))
    vc.view(-1, Hkv, D).index_copy_(0, plan.slots, v.to(vc.dtype))
    return kc, vc


def split_heads(qkv: torch.Tensor, H: int, Hkv: int, D: int):
    """[N, (H + 2 Hkv) D] -> q [N, H, D], k [N, Hkv, D], v [N, Hkv, D] (views)."""
    x = qkv.view(qkv.shape[0], H + 2 * Hkv, D)
    return x[:, :H], x[:, H : H + Hkv], x[:, H + Hkv :]
