"""The default CPU model: every layer of a step in one Numba call over the GGUF's own blocks.

Weights are never converted: each matrix is a (byte offset, rows, bytes per
row, GGML type) entry into the memory-mapped file, read by the kernels in
imp/kernels/cpu/gemm_int8_act.py (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).
Loading is the header parse plus the small fp32 vectors (norms, biases) and
the RoPE tables; resident memory grows only with the pages the steps touch
(all of them after the first step: RSS ~ file size + KV used + ~100 MB).

The architectures differ only in flags and optional vectors (see
imp/kernels/cpu/fused_forward.py): llama (adjacent-pair RoPE), qwen2 (q/k/v biases,
NEOX RoPE), qwen3 (per-head q/k norms), gemma3 (q/k norms, post norms, GELU,
sliding-window layers with their own RoPE base, scaled embedding, tied head,
query scale). The torch classes in llama.py / qwen2.py / gemma3.py remain the
readable reference (`weights="f32"`), which the tests hold this one against.

KV cache: fp16 by default (half the bytes of fp32; what it costs in accuracy is
measured in tests/test_model_logits.py against an fp32 cache, which this path
also runs: `ModelRunner.load(..., kv_dtype="float32")`).

No torch here (imp/model/paged.py says why): numpy in, numpy out.
"""

from __future__ import annotations

import math

import numpy as np

from imp.formats.gguf_loader import ModelConfig
from imp.formats.quants import dequantize
from imp.kernels.cpu import fused_forward as cf
from imp.kernels.cpu import gemm_int8_act as qd
from imp.kernels.cpu import gemm_q8_0_amx, head_q8
from imp.kernels.cpu.kinds import Kinds
from imp.model.paged import LOCAL_THETA, RopeTables, sliding_layers

MATS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
VECS = ("attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")


class Unsupported(NotImplementedError):
    """The file has a matrix type the kernels do not read (the runner falls back to torch)."""


def _mat(tensors, name: str) -> list[int]:
    info = tensors.info(name)
    if int(info.qtype) not in qd.SUPPORTED:
        raise Unsupported(f"{name}: {info.qtype.name} has no CPU kernel")
    rows, cols = info.shape
    return [info.offset, rows, qd.row_bytes(int(info.qtype), cols), int(info.qtype)]


def _kth_bound(z: np.ndarray, k: int) -> np.ndarray:
    """Per row of z [R, V], a value at most its k-th largest (so `row >= bound` holds the top k): the k-th
    largest of the rows' chunk maxima (k chunk maxima are k values at least that large). Few values pass it."""
    R, V = z.shape
    C = 256
    if V % C or V // C < 1 or C < k:
        return np.partition(z, V - k, axis=1)[:, V - k]
    cm = z.reshape(R, C, V // C).max(axis=2)
    return np.partition(cm, C - k, axis=1)[:, C - k]


class FusedModel:
    def __init__(self, cfg: ModelConfig, tensors):
        if not hasattr(tensors, "raw"):
            raise Unsupported("fused CPU path needs a memory-mapped GGUF")
        arch = cfg.arch
        if arch not in ("llama", "qwen2", "qwen3", "gemma3"):
            raise Unsupported(arch)
        ex = cfg.extras
        if ex.get("rope.scaling.type", "none") not in ("none", None) and arch != "gemma3":
            raise Unsupported(f"rope scaling {ex.get('rope.scaling.type')!r}")
        if ex.get("attn_logit_softcapping"):
            raise Unsupported("attention logit softcapping")
        self.cfg = cfg
        self.weights = "gguf"
        t = tensors
        L, D = cfg.n_layers, cfg.head_dim
        self.mats = np.array([[_mat(t, f"blk.{i}.{m}.weight") for m in MATS] for i in range(L)], dtype=np.int64)
        # the whole file, read-only map: rows are read in place (or, under --weights q8_0, the converted matrices'
        # buffer: imp.formats.requant)
        base = t.base([f"blk.{i}.{m}.weight" for i in range(L) for m in MATS]) if hasattr(t, "base") else t._mm
        if base is None:
            raise Unsupported("layer matrices partly converted by --weights")
        self.blob = np.asarray(base)
        if len({int(r) for r in self.mats[:, 4, 1]}) != 1:
            raise Unsupported("per-layer d_ff")
        vecs, fo, n = [], np.full((L, 7), -1, dtype=np.int64), 0
        for i in range(L):
            names = [f"blk.{i}.{v}.weight" for v in VECS] + [None]
            bias = [f"blk.{i}.attn_{x}.bias" for x in "qkv"]
            for j, name in enumerate(names):
                if name is None:
                    v = np.concatenate([t.array(b) for b in bias]) if bias[0] in t else None
                else:
                    v = t.array(name).reshape(-1) if name in t else None
                if v is not None:
                    fo[i, j] = n
                    vecs.append(v.astype(np.float32))
                    n += v.size
        self.fv = np.concatenate(vecs).astype(np.float32)
        self.fo = fo
        # the token table stays the file's blocks: only a step's rows are dequantized (Gemma's
        # 262144 x 640 table is 671 MB in fp32, 178 MB as Q8_0)
        info = t.info("token_embd.weight")
        self.tok_embd = (t.raw("token_embd.weight"), info.qtype, info.shape[-1])
        self.out_norm = t.array("output_norm.weight").astype(np.float32)
        head = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        info = t.info(head)
        if int(info.qtype) not in qd.SUPPORTED:
            raise Unsupported(f"{head}: {info.qtype.name}")
        self.head = (t.raw(head), int(info.qtype))  # [vocab, row_bytes] view of the map
        # A Q8_0 head (SmolLM2's, Gemma's tied table) is repacked once for its own loop
        # (imp.kernels.cpu.head_q8: the same bits, Gemma's head 2-3x faster), except where AMX
        # tiles take Q8_0 heads (gemm_int8_act.gemm: a matrix takes one route on a machine).
        self.packed_head = None
        if self.head[1] == qd.Q8_0 and head_q8.DP4 and not gemm_q8_0_amx.AMX:
            self.packed_head = head_q8.PackedQ8(self.head[0])
            t.drop_pages(head)  # the map's pages of it: read once for the copy, no longer resident
        # the layers' and the head's GGML types: only their loops compile (imp.kernels.cpu.kinds)
        head_kind = [] if self.packed_head is not None else [self.head[1]]
        self.kinds = Kinds([*(int(q) for q in np.unique(self.mats[:, :, 3])), *head_kind])
        P = cfg.context_length
        self.embed_scale = 1.0
        self.final_softcap = 0.0
        self.window = 0
        self.scale = D ** -0.5
        self.neox = arch != "llama"  # llama.cpp permutes llama's q/k rows only
        self.act = cf.SILU
        if arch == "gemma3":
            self.act = cf.GELU_TANH
            self.embed_scale = math.sqrt(cfg.d_model)
            self.final_softcap = float(ex.get("final_logit_softcapping") or 0.0)
            self.window = int(ex.get("attention.sliding_window", 0))
            self.scale = float(ex.get("attention.query_pre_attn_scalar", D)) ** -0.5
            scaling = ex.get("rope.scaling.type", "none")
            factor = float(ex.get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
            self.rope_g = RopeTables(cfg.rope_theta, D, P, factor)
            self.rope_l = RopeTables(float(ex.get("rope.freq_base_swa", LOCAL_THETA)), D, P)
            flags = sliding_layers(cfg) if self.window else [False] * L
        else:
            self.rope_g = self.rope_l = RopeTables(cfg.rope_theta, D, P)
            flags = [False] * L
        self.sliding = np.array(flags, dtype=np.int64)
        self._kv = None  # (cache id, k bits, v bits)
        self._no_lora = (np.zeros((0, L, 7, 3), np.int64), np.zeros(0, np.float32), np.zeros(0, np.float32),
                         np.zeros(0, np.float32))

    def _cache_bits(self, cache):
        """The pool's k and v as flat numpy arrays: fp16 as its bits (Numba has no float16
        arrays), fp32 as it is. cache: paged.HostKV, or a torch KVCache (the tests' fp32 runs)."""
        if self._kv is None or self._kv[0] is not cache:
            bits = []
            for c in (cache.k, cache.v):
                a = np.asarray(c)  # a torch CPU tensor shares its memory
                assert a.dtype in (np.float16, np.uint16, np.float32), a.dtype
                bits.append((a.view(np.uint16) if a.dtype == np.float16 else a).reshape(-1))
            self._kv = (cache, *bits)
        return self._kv[1], self._kv[2]

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """tokens [N] -> [N, d] fp32, a fresh array (per-block dequantization: the same bits as
        dequantizing the whole table)."""
        raw, qtype, dim = self.tok_embd
        return np.array(dequantize(raw[tokens], qtype, (len(tokens), dim)), dtype=np.float32)

    def forward(self, tokens, plan, cache, lora=None, keep_rows=None):
        """tokens [N] -> logits [B, vocab] fp32 at plan.last_rows. plan: paged.RowsPlan (or a
        torch AttnPlan: its CPU tensors are read as numpy). lora: (lo, la, lb, scale, row slots
        [N]) from imp.model.lora, or None. keep_rows (the logit lens): rows whose residual after
        each layer is kept; then (logits, residuals [L, len(keep_rows), d]) are returned."""
        cfg = self.cfg
        tokens, positions = np.asarray(tokens, dtype=np.int64), np.asarray(plan.positions, dtype=np.int64)
        x = self.embed(tokens)  # [N, d] fp32
        if self.embed_scale != 1.0:
            x *= np.float32(self.embed_scale)
        kc, vc = self._cache_bits(cache)
        top = int(positions.max()) if positions.size else 0
        cos_g, sin_g = self.rope_g.upto(top)
        cos_l, sin_l = self.rope_l.upto(top)
        lo = lora if lora is not None else (*self._no_lora, np.full(x.shape[0], -1, np.int64))

        def layers(a: int, b: int):  # layers a..b-1: their slices of every per-layer array (the same types)
            per = kc.size // cfg.n_layers
            whole = (a, b) == (0, cfg.n_layers)
            cut = (lambda v: v) if whole else (lambda v: np.ascontiguousarray(v[a:b]))
            cf.forward_layers(
                self.blob, cut(self.mats), self.fv, cut(self.fo), cut(self.sliding), x,
                positions, np.asarray(plan.slots, dtype=np.int64), plan.tables, plan.row_tab,
                cos_g, sin_g, cos_l, sin_l, kc[a * per:b * per], vc[a * per:b * per], cache.num_blocks,
                cache.block_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, self.window, self.neox, self.act,
                np.float32(cfg.rms_eps), np.float32(self.scale),
                lo[0] if whole else np.ascontiguousarray(lo[0][:, a:b]), *lo[1:], self.kinds,
            )

        resid = None
        if keep_rows is None:
            layers(0, cfg.n_layers)
        else:  # one layer at a time, the kept rows' residual after each (the same arithmetic as one call)
            keep = np.asarray(keep_rows, dtype=np.int64)
            resid = np.empty((cfg.n_layers, keep.size, cfg.d_model), np.float32)
            for layer in range(cfg.n_layers):
                layers(layer, layer + 1)
                resid[layer] = x[keep]
        logits = self._final(x, plan)
        return logits if resid is None else (logits, resid)

    def _final(self, x: np.ndarray, plan) -> np.ndarray:
        cfg = self.cfg
        rows = np.asarray(plan.last_rows, dtype=np.int64)
        if rows.size == 0:
            return np.empty((0, cfg.vocab_size), np.float32)
        h = np.empty((rows.size, cfg.d_model), np.float32)
        cf._rms_norm_rows(np.ascontiguousarray(x[rows]), self.out_norm, 0, np.float32(cfg.rms_eps), h)
        logits = self.head_logits(h)  # [B, vocab]
        if self.final_softcap:
            cap = np.float32(self.final_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits

    def lens(self, resid: np.ndarray, token: int, top_n: int) -> list[tuple[int, float, float, list]]:
        """The logit lens of one row: resid [L, d] (its residual after each layer) -> per layer (rank of
        `token` (1 = the most likely), its logprob, the entropy in nats, the top_n (id, logprob)) of the raw
        distribution the final norm and LM head give that residual."""
        cfg = self.cfg
        h = np.empty_like(resid)
        cf._rms_norm_rows(np.ascontiguousarray(resid), self.out_norm, 0, np.float32(cfg.rms_eps), h)
        z = self.head_logits(h)  # [L, vocab] fp32
        if self.final_softcap:
            z = np.tanh(z / np.float32(self.final_softcap)) * np.float32(self.final_softcap)
        z -= z.max(axis=1, keepdims=True)  # every layer at once, in place (float32, as the sampler's logprobs)
        e = np.exp(z)
        s = e.sum(axis=1, keepdims=True)
        z -= np.log(s)  # log-softmax
        ent = -np.einsum("lv,lv->l", e, z) / s[:, 0]  # entropy in nats: -sum p log p
        at = z[:, token].copy()
        rank = 1 + (z > at[:, None]).sum(axis=1)
        thr = _kth_bound(z, top_n)
        out = []
        for layer in range(z.shape[0]):
            cand = np.flatnonzero(z[layer] >= thr[layer])  # holds the top_n (argpartition: 16 ms for 30 x 49k)
            ids = cand[np.lexsort((cand, -z[layer, cand]))][:top_n]  # largest first, ties: lower id first
            out.append((int(rank[layer]), float(at[layer]), float(ent[layer]),
                        [(int(i), float(z[layer, i])) for i in ids]))
        return out

    def compile_layer_parts(self, cache) -> None:
        """Compile the layers' non-GEMM kernels with the types forward() gives them, running
        nothing (fused_forward.compile_layer_parts: a cold boot's second compile child)."""
        cfg = self.cfg
        kc, vc = self._cache_bits(cache)
        cos_g, sin_g = self.rope_g.upto(0)
        cf.compile_layer_parts(self.blob, self.kinds, self.mats, self.fv, self.fo, cfg.d_model, cos_g, sin_g, kc, vc,
                               cache.num_blocks, cache.block_size, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                               self.window, self.neox, self.act, np.float32(cfg.rms_eps), np.float32(self.scale),
                               *self._no_lora)

    def head_logits(self, h: np.ndarray) -> np.ndarray:
        """h [B, d] fp32 (normed) -> [B, vocab] fp32, before any softcap."""
        if self.packed_head is not None:
            return head_q8.gemm(self.packed_head, h)  # the same bits as the file loop below
        w, qt = self.head
        return qd.gemm(w, qt, h, kinds=self.kinds)
