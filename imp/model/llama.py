"""Llama forward in torch on CPU, over a paged KV cache (gpt-fast style).

One call runs every new token of every sequence of a step: the tokens are
concatenated ragged (`N` rows) for all matmuls, and only attention looks at
sequences one group at a time (see `AttnPlan`).

Shapes (names as in the comments below):
    N   new tokens in the step, all sequences concatenated
    B   sequences in the step
    H   query heads, Hkv key/value heads (GQA: H % Hkv == 0), D head_dim
    L   context length a sequence attends over (cached + new)
    KV cache: [n_layers, num_blocks, block_size, Hkv, D]; a flat "slot" is
    block * block_size + offset.

RoPE layout: llama.cpp's converter permutes HF's Q/K rows so that GGUF rotates
*adjacent pairs* (x[2i], x[2i+1]) by angle pos * theta^(-2i/D) ("normal" rope,
as gpt-fast and Meta's reference). HF's GGUF loader undoes that permutation
and uses rotate_half; both give the same logits (tests/test_model_logits.py).

Weight formats of this torch forward (`weights=`; the runner's default is
"gguf", which is not this class but fused.FusedModel: Numba kernels on the
file's own blocks, batch-invariant, ~10 ms a SmolLM2 decode step on 2 cores).
Measured on the 2-core dev box, SmolLM2-135M, torch 2.13, 2 threads, one
step's wall time (min of 15; context 200 tokens):
                decode b1   decode b8   prefill 234 tok
    "f32"       51.7 ms     106 ms      586 ms
    "bf16"      28.0 ms     142 ms      3329 ms
    "int8"      26.9 ms     64.5 ms     1048 ms
    "hybrid"    26.8 ms     62.0 ms     795 ms
    "f32"    dense fp32 everywhere: same logits as HF (< 1e-4): the reference the
             tests hold the fused path to
    "int8"   weight-only int8 per output row (`_weight_int8pack_mm`, bf16
             activations into the GEMV), re-quantized at load (~60 % of an 8 s
             load); the fallback for files the fused kernels cannot read
    "hybrid" int8 when a matmul has <= INT8_MAX_ROWS rows, dense fp32 above.
`_weight_int8pack_mm` is batch-invariant (a row's result is bit-identical
whatever else is in the matmul), dense fp32 MKL GEMM is not (row 0 alone vs
in a batch differs by ~3e-5), and "hybrid" switches arithmetic with the
step's row count.
torch.compile of the glue (compile=True) did not speed decode up here: the
int8 GEMVs and attention dominate, not Python dispatch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from imp.model.attention import paged_attention
from imp.model import paged
from imp.model.paged import default_num_blocks  # noqa: F401 (the GPU runner's import)
from imp.formats.gguf_loader import ModelConfig

import numpy as np
import torch
import torch.nn.functional as F

INT8_MAX_ROWS = 16  # above this many rows the fp32 GEMM beats the int8 GEMV kernel


@dataclass
class KVCache:
    k: torch.Tensor  # [n_layers, num_blocks, block_size, Hkv, D]
    v: torch.Tensor  # [n_layers, num_blocks, block_size, Hkv, D]

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_blocks: int, block_size: int, dtype=torch.float32):
        shape = (cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        return cls(lazy_zeros(shape, dtype), lazy_zeros(shape, dtype))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cache: ([num_blocks, block_size, Hkv, D], same for v)."""
        return self.k[i], self.v[i]


def lazy_zeros(shape, dtype) -> torch.Tensor:
    """Zeros whose pages the OS commits only when first written (imp.model.paged.lazy_zeros)."""
    return torch.from_numpy(paged.lazy_zeros(shape, torch.empty((), dtype=dtype).numpy().dtype))


class Linear:
    """y = x @ W.T for W [out, in], in the format chosen at load time."""

    def __init__(self, w: torch.Tensor, weights: str):
        assert weights in ("f32", "bf16", "int8", "hybrid"), weights
        w = w.float().contiguous()
        self.out_features = w.shape[0]
        self.dense = None
        self.q8 = None
        if weights in ("int8", "hybrid"):
            self.q8, scale = quantize_int8(w)
            self.scale = scale.to(torch.bfloat16)
        if weights in ("f32", "hybrid"):
            self.dense = w
        if weights == "bf16":
            self.dense = w.to(torch.bfloat16)

        if self.q8 is None:
            self.scale = None

    @classmethod
    def int8_from_chunks(cls, chunks) -> "Linear":
        """An "int8" Linear from row chunks of W (fp32 [rows_i, in] each): the
        same bytes as Linear(cat(chunks), "int8") without the whole fp32 W."""
        parts = [quantize_int8(c) for c in chunks]
        self = cls.__new__(cls)
        self.q8 = torch.cat([q for q, _ in parts])
        self.scale = torch.cat([s for _, s in parts]).to(torch.bfloat16)
        self.dense = None
        self.out_features = self.q8.shape[0]
        return self

    @property
    def args(self) -> tuple:
        """Plain tensors for `linear()` (compiled code takes tensors, not objects)."""
        return (self.q8, self.scale, self.dense)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, *self.args)


def quantize_int8(w: torch.Tensor, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w [out, in] -> (q8 int8 [out, in], scale fp32 [out]), w ~ q8 * scale.

    scale = max|w_row| / 127, so |w / scale| <= 127 and round() needs no clamp.
    Row chunks bound the fp32 temporaries (Gemma's head has 262144 rows).
    """
    scale = torch.empty(w.shape[0])
    q8 = torch.empty(w.shape, dtype=torch.int8)
    for r in range(0, w.shape[0], chunk):
        wc = w[r : r + chunk].float()
        lo, hi = torch.aminmax(wc, dim=1)  # one pass; max(hi, -lo) == max|w| exactly
        sc = scale[r : r + chunk] = (torch.maximum(hi, lo.neg_()) / 127.0).clamp_(min=1e-12)
        q8[r : r + chunk] = (wc / sc[:, None]).round_()  # integral floats: the int8 copy is exact
    return q8, scale


def linear(x, q8, scale, dense) -> torch.Tensor:
    # x [N, in] fp32 -> [N, out] fp32
    if q8 is not None and (dense is None or x.shape[0] <= INT8_MAX_ROWS):
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q8, scale).float()
    if dense.dtype != x.dtype:
        return F.linear(x.to(dense.dtype), dense).float()
    return F.linear(x, dense)


@dataclass
class Layer:
    attn_norm: torch.Tensor  # [d]
    wqkv: Linear  # [(H + 2 Hkv) D, d]
    wo: Linear  # [d, H D]
    ffn_norm: torch.Tensor  # [d]
    w13: Linear  # [2 d_ff, d]  (gate rows, then up rows)
    w2: Linear  # [d, d_ff]


@dataclass
class AttnPlan:
    """How the step's tokens attend, computed once per step (not per layer).

    decode: sequences with exactly one new token, batched into one SDPA call:
        dec_rows [Bd] row of each in the N new tokens (None: rows are 0..N-1)
        dec_ctx  [Bd * nb] block ids of each one's context, padded to nb blocks
                 (L = nb * block_size: whole blocks are gathered, the tail masked)
        dec_mask [Bd, 1, 1, L] bool, True = attend (None: nothing to mask)
    prefill: the other sequences, one SDPA call each:
        (row_start, row_end, ctx [nb] block ids or None, mask [T, nb * block_size] or None)
        ctx None means no cached prefix: attend causally over the new rows only.
    """

    slots: torch.Tensor  # [N] cache slot each new token's K/V is written to
    positions: torch.Tensor  # [N] absolute position of each new token
    last_rows: torch.Tensor  # [B] row of each sequence's last new token
    dec_rows: torch.Tensor | None = None
    dec_ctx: torch.Tensor | None = None
    dec_len: int = 0  # L of the decode group
    dec_mask: torch.Tensor | None = None
    num_decode: int = 0
    prefill: list = None
    tables: "np.ndarray | None" = None  # int64 [*] every sequence's block table, concatenated
    row_tab: "np.ndarray | None" = None  # int64 [N] where row i's table starts in `tables`


def rope_tables(cfg: ModelConfig, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_pos, D/2] for pair i rotated by pos * theta^(-2i/D)."""
    d = int(cfg.extras.get("rope.dimension_count", cfg.head_dim))
    assert d == cfg.head_dim, "partial rotary not supported"
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [N, heads, D]; cos/sin [N, 1, D/2]; pairs (x[2i], x[2i+1]) rotate together
    xp = x.unflatten(-1, (-1, 2))  # [N, heads, D/2, 2]
    x0, x1 = xp[..., 0], xp[..., 1]
    return torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)


def attn_in(x, norm_w, wqkv: tuple, cos, sin, H: int, Hkv: int, D: int, eps: float):
    """x [N, d] -> q [N, H, D], k [N, Hkv, D] (both rotated), v [N, Hkv, D]."""
    N = x.shape[0]
    h = F.rms_norm(x, (x.shape[-1],), norm_w, eps)
    qkv = linear(h, *wqkv).view(N, H + 2 * Hkv, D)  # [N, H + 2 Hkv, D]
    qk = apply_rope(qkv[:, : H + Hkv], cos, sin)  # q and k heads rotate alike
    return qk[:, :H], qk[:, H:], qkv[:, H + Hkv :]


def attn_out_mlp(x, a, wo: tuple, norm_w, w13: tuple, w2: tuple, eps: float):
    """Residual stream after attention output a [N, H, D] and the SiLU-gated MLP."""
    x = x + linear(a.flatten(1), *wo)
    h = F.rms_norm(x, (x.shape[-1],), norm_w, eps)
    g, u = linear(h, *w13).chunk(2, dim=-1)  # [N, d_ff] each
    return x + linear(F.silu(g) * u, *w2)


class Llama:
    def __init__(
        self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], weights: str = "int8",
        compile: bool = False,
    ):
        self.cfg = cfg
        self.weights = weights
        # Optional torch.compile of the glue between matmuls (norm, rope, SiLU):
        # one graph serves all layers (weights are arguments), dynamic in N. It
        # cost ~60 s of start-up and did not speed SmolLM2 decode up on 2 cores,
        # so it is off by default; kept for larger models / other CPUs.
        self._attn_in = torch.compile(attn_in, dynamic=True) if compile else attn_in
        self._attn_out_mlp = torch.compile(attn_out_mlp, dynamic=True) if compile else attn_out_mlp
        scaling = cfg.extras.get("rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise NotImplementedError(f"rope scaling {scaling!r} not supported yet")
        t = tensors
        self.tok_embd = t["token_embd.weight"].float().contiguous()  # [vocab, d]
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            wqkv = torch.cat([t[p + "attn_q.weight"], t[p + "attn_k.weight"], t[p + "attn_v.weight"]])
            w13 = torch.cat([t[p + "ffn_gate.weight"], t[p + "ffn_up.weight"]])
            self.layers.append(
                Layer(
                    attn_norm=t[p + "attn_norm.weight"].float(),
                    wqkv=Linear(wqkv, weights),
                    wo=Linear(t[p + "attn_output.weight"], weights),
                    ffn_norm=t[p + "ffn_norm.weight"].float(),
                    w13=Linear(w13, weights),
                    w2=Linear(t[p + "ffn_down.weight"], weights),
                )
            )
        self.out_norm = t["output_norm.weight"].float()
        head = t["token_embd.weight"] if cfg.tied_embeddings else t["output.weight"]
        # the head only ever sees B rows (last positions), never a prefill's N: int8 only
        self.head = Linear(head, "int8" if weights == "hybrid" else weights)
        self.cos, self.sin = rope_tables(cfg, cfg.context_length)

    def _attention(self, q, k, v, kc, vc, plan: AttnPlan) -> torch.Tensor:
        # q [N, H, D], k/v [N, Hkv, D] (already in the cache), kc/vc [num_blocks, block_size, Hkv, D]
        return paged_attention(q, k, v, kc, vc, plan)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, plan: AttnPlan, cache: KVCache) -> torch.Tensor:
        """tokens [N] -> logits [B, vocab] fp32 at each sequence's last new token."""
        cfg = self.cfg
        H, Hkv, D, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_eps
        d = cfg.d_model
        x = F.embedding(tokens, self.tok_embd)  # [N, d]
        cos = self.cos.index_select(0, plan.positions).unsqueeze(1)  # [N, 1, D/2]
        sin = self.sin.index_select(0, plan.positions).unsqueeze(1)
        for i, lyr in enumerate(self.layers):
            q, k, v = self._attn_in(x, lyr.attn_norm, lyr.wqkv.args, cos, sin, H, Hkv, D, eps)
            kc, vc = cache.layer(i)  # [num_blocks, block_size, Hkv, D]
            kc.view(-1, Hkv, D).index_copy_(0, plan.slots, k.to(kc.dtype))
            vc.view(-1, Hkv, D).index_copy_(0, plan.slots, v.to(vc.dtype))
            a = self._attention(q, k, v, kc, vc, plan)  # [N, H, D]
            x = self._attn_out_mlp(x, a, lyr.wo.args, lyr.ffn_norm, lyr.w13.args, lyr.w2.args, eps)
        if plan.last_rows.numel() == 0:  # nothing to sample: the step only filled the cache
            return x.new_empty(0, cfg.vocab_size)
        x = x.index_select(0, plan.last_rows)  # [B, d]
        x = F.rms_norm(x, (d,), self.out_norm, eps)
        return self.head(x)  # [B, vocab]


def make_plan(
    starts: list[int], lens: list[int], block_tables: list[list[int]], block_size: int
) -> AttnPlan:
    """AttnPlan for sequences with new tokens at positions start .. start+len-1."""
    import numpy as np

    bs = block_size
    rp = paged.rows_plan(starts, lens, block_tables, bs)
    plan = AttnPlan(slots=torch.from_numpy(rp.slots), positions=torch.from_numpy(rp.positions),
                    last_rows=torch.from_numpy(rp.last_rows), prefill=[], tables=rp.tables, row_tab=rp.row_tab)
    dec, pre, row = [], [], 0
    for s, n, bt in zip(starts, lens, block_tables):
        table = np.asarray(bt, dtype=np.int64)
        (dec if n == 1 else pre).append((row, s, n, table))
        row += n
    if dec:
        nb = max(s // bs + 1 for _, s, _, _ in dec)  # blocks covering the longest context
        ctx = np.zeros((len(dec), nb), dtype=np.int64)  # padding gathers block 0, masked out
        lens_ = np.empty(len(dec), dtype=np.int64)
        for j, (_, s, _, table) in enumerate(dec):
            ctx[j, : s // bs + 1] = table[: s // bs + 1]
            lens_[j] = s + 1
        L = nb * bs
        plan.num_decode = len(dec)
        plan.dec_len = L
        plan.dec_ctx = torch.from_numpy(ctx.reshape(-1))
        rows = [r for r, _, _, _ in dec]
        if rows != list(range(len(dec))):
            plan.dec_rows = torch.tensor(rows, dtype=torch.int64)
        if (lens_ != L).any():
            m = np.arange(L)[None, :] < lens_[:, None]
            plan.dec_mask = torch.from_numpy(m).view(len(dec), 1, 1, L)
    for r, s, n, table in pre:
        if s == 0:
            plan.prefill.append((r, r + n, None, None))
            continue
        nb = (s + n - 1) // bs + 1
        ctx = torch.from_numpy(np.ascontiguousarray(table[:nb]))
        # new token i (position s+i) sees context positions j <= s+i (the rest of the last block too)
        mask = torch.from_numpy(np.arange(nb * bs)[None, :] <= (s + np.arange(n))[:, None])
        plan.prefill.append((r, r + n, ctx, mask))
    return plan


