"""Fast random-weight GGUFs of any shape, in any GPU format (k-quants too).

`synth.py` quantizes real-valued random weights with `gguf.quants` (exact,
but slow for an 8B shape, and it cannot write k-quants). Here the *encoded*
blocks are drawn directly: random quant bytes, with the block scales set so
each dequantized weight has std ~ 1/sqrt(fan_in), like a trained model. A
pool of random blocks is drawn once and tiled with a random offset per
tensor, so writing a 16 GB file is disk-bound, not RNG-bound.

Used by the GPU tests (Q4_K/Q6_K small models) and `bench/gpu.py`.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from imp.model.synth import add_shape, add_synthetic_tokenizer

BLOCK = {T.Q4_0: (32, 18), T.Q4_1: (32, 20), T.Q8_0: (32, 34), T.Q4_K: (256, 144), T.Q6_K: (256, 210), T.BF16: (1, 2), T.F32: (1, 4)}
_POOL_BLOCKS = 1 << 16


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(qtype: T, n_blocks: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """[n_blocks, type_size] uint8 of valid blocks whose values have ~`std` spread."""
    be, bs = BLOCK[qtype]
    b = rng.integers(0, 256, size=(n_blocks, bs), dtype=np.uint8)
    jitter = (0.75 + 0.5 * rng.random(n_blocks)).astype(np.float32)
    if qtype == T.Q4_0:  # q in -8..7 uniform: std ~4.6
        b[:, 0:2] = _f16_bytes(std / 4.6 * jitter)
    elif qtype == T.Q4_1:  # d*q + m, q 0..15: centre with m = -7.5 d
        d = std / 4.6 * jitter
        b[:, 0:2] = _f16_bytes(d)
        b[:, 2:4] = _f16_bytes(-7.5 * d)
    elif qtype == T.Q8_0:  # q int8 uniform: std ~74
        b[:, 0:2] = _f16_bytes(std / 74.0 * jitter)
    elif qtype == T.Q4_K:  # d*sc*q - dmin*m; sc, m 6-bit random; q 0..15
        d = std / (4.6 * 32.0) * jitter
        b[:, 0:2] = _f16_bytes(d)
        b[:, 2:4] = _f16_bytes(d * 7.5)  # dmin*m ~ d*sc*7.5 on average (m ~ sc)
    elif qtype == T.Q6_K:  # d*sc*(q-32), sc int8 random; q 0..63: std ~18.5
        b[:, 208:210] = _f16_bytes(std / (18.5 * 74.0) * jitter)
    elif qtype == T.BF16:
        v = (rng.standard_normal(n_blocks).astype(np.float32) * std).view(np.uint32)
        b[:, :] = (v >> 16).astype(np.uint16).view(np.uint8).reshape(-1, 2)
    elif qtype == T.F32:
        b[:, :] = (rng.standard_normal(n_blocks).astype(np.float32) * std).view(np.uint8).reshape(-1, 4)
    else:
        raise ValueError(f"{qtype.name}: not supported here")
    return b


def _tensor_bytes(qtype: T, rows: int, cols: int, std: float, rng, pools: dict) -> np.ndarray:
    be, bs = BLOCK[qtype]
    n = rows * cols // be
    key = (qtype, std)
    nblk = max(_POOL_BLOCKS, (32 << 20) // bs)  # a 32 MB pool: no short repeats inside a row
    if key not in pools:
        pools[key] = random_blocks(qtype, nblk, std, rng).reshape(-1)
    pool = pools[key]
    need = n * bs
    off = int(rng.integers(0, nblk)) * bs
    reps = (off + need) // pool.size + 1
    return np.tile(pool, reps)[off:off + need] if reps > 1 else pool[off:off + need]


def write_raw_gguf(
    path, n_layers: int = 2, d_model: int = 64, n_heads: int = 4, n_kv_heads: int = 2,
    d_ff: int = 128, vocab: int = 512, qtype: T = T.Q4_K, embed_qtype: T | None = None,
    head_qtype: T | None = None, tied: bool = True, context_length: int = 2048,
    rope_theta: float = 10000.0, rms_eps: float = 1e-5, seed: int = 0, overrides: dict | None = None,
) -> str:
    """A llama GGUF with random encoded blocks; `overrides` maps tensor-name suffixes
    (e.g. "attn_v.weight") to another type, as Q4_K_M files mix Q6_K in."""
    rng = np.random.default_rng(seed)
    embed_qtype = qtype if embed_qtype is None else embed_qtype
    head_qtype = embed_qtype if head_qtype is None else head_qtype
    overrides = overrides or {}
    hd = d_model // n_heads
    specs = [("token_embd.weight", vocab, d_model, embed_qtype, 1.0)]
    for i in range(n_layers):
        p = f"blk.{i}."
        specs += [
            (p + "attn_norm.weight", 1, d_model, T.F32, None),
            (p + "attn_q.weight", n_heads * hd, d_model, qtype, d_model ** -0.5),
            (p + "attn_k.weight", n_kv_heads * hd, d_model, qtype, d_model ** -0.5),
            (p + "attn_v.weight", n_kv_heads * hd, d_model, qtype, d_model ** -0.5),
            (p + "attn_output.weight", d_model, n_heads * hd, qtype, (n_heads * hd) ** -0.5),
            (p + "ffn_norm.weight", 1, d_model, T.F32, None),
            (p + "ffn_gate.weight", d_ff, d_model, qtype, d_model ** -0.5),
            (p + "ffn_up.weight", d_ff, d_model, qtype, d_model ** -0.5),
            (p + "ffn_down.weight", d_model, d_ff, qtype, d_ff ** -0.5),
        ]
    specs.append(("output_norm.weight", 1, d_model, T.F32, None))
    if not tied:
        specs.append(("output.weight", vocab, d_model, head_qtype, d_model ** -0.5))
    specs = [(n, r, c, next((t for s, t in overrides.items() if n.endswith(s)), q) if q != T.F32 else q, sd)
             for n, r, c, q, sd in specs]

    arch = "llama"
    w = GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-raw-{n_layers}L-{d_model}d")
    add_shape(w, arch, n_layers, context_length, d_model, d_ff, n_heads, n_kv_heads, rope_theta, rms_eps, vocab)
    w.add_uint32(f"{arch}.rope.dimension_count", hd)
    add_synthetic_tokenizer(w, vocab)
    for name, r, c, qt, _ in specs:
        be, bs = BLOCK[qt]
        shape = (c,) if r == 1 else (r, c)
        if qt == T.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), r * c * 4)
        else:
            w.add_tensor_info(name, (r, c // be * bs) if r > 1 else (c // be * bs,), np.dtype(np.uint8), r * c // be * bs, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    pools: dict = {}
    for name, r, c, qt, sd in specs:
        if sd is None:  # norm weights near 1
            data = (1.0 + 0.1 * rng.standard_normal(c)).astype(np.float32)
        else:
            data = _tensor_bytes(qt, r, c, sd, rng, pools)
        w.write_tensor_data(np.ascontiguousarray(data))
    w.close()
    return str(path)
