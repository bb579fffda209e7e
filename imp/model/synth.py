"""Synthetic random-weight GGUF files, for tests and benchmarks.

`write_synthetic_gguf` writes a llama, qwen2, qwen3 or gemma3 model of any
shape with random weights in a chosen GGML type, plus a minimal byte-level
tokenizer so the file loads like a real one. Keys and tensor names are the
ones llama.cpp's converter writes for each arch (`ARCH_TENSORS`). Tensors are generated and written one at a time
(GGUFWriter's streaming mode), so an 8B-shaped file needs only one tensor's
worth of memory.

Weights are scaled like a trained model's (std 1/sqrt(fan_in), norms near 1)
so activations stay O(1) through the layers and logits are not all ties.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter, quant_shape_to_byte_shape
from gguf import quants as gq

from imp.model.tokenizer import bytes_to_unicode

# types gguf.quants can write (the k-quants it can only read)
WRITABLE = (T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def synthetic_vocab(vocab: int) -> list[str]:
    """3 specials, the 256 byte tokens, the one merge's result ("Ġt": a BPE
    tokenizer refuses a merge whose result is not in the vocabulary), then
    filler tokens up to `vocab`."""
    toks = SPECIALS + _bytes_to_unicode() + ["Ġt"]
    assert vocab >= len(toks), f"vocab must be >= {len(toks)}"
    return toks + [f"<unused{i}>" for i in range(vocab - len(toks))]


def add_shape(w: GGUFWriter, arch: str, n_layers: int, context_length: int, d_model: int, d_ff: int, n_heads: int,
              n_kv_heads: int, rope_theta: float, rms_eps: float, vocab: int) -> None:
    """The model-shape keys every synthetic GGUF carries (synth and synth_raw)."""
    w.add_uint32(f"{arch}.block_count", n_layers)
    w.add_uint32(f"{arch}.context_length", context_length)
    w.add_uint32(f"{arch}.embedding_length", d_model)
    w.add_uint32(f"{arch}.feed_forward_length", d_ff)
    w.add_uint32(f"{arch}.attention.head_count", n_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", n_kv_heads)
    w.add_float32(f"{arch}.rope.freq_base", rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", rms_eps)
    w.add_uint32(f"{arch}.vocab_size", vocab)


def add_synthetic_tokenizer(w: GGUFWriter, vocab: int) -> None:
    """A byte-level BPE tokenizer over `synthetic_vocab` (loads like a real one)."""
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", synthetic_vocab(vocab))
    w.add_array("tokenizer.ggml.token_type", [3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
    w.add_array("tokenizer.ggml.merges", ["Ġ t"])  # one merge; BPE needs a non-empty list
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)


# per-layer tensors beyond llama's, as llama.cpp names them
ARCH_TENSORS = {
    "llama": (),
    "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight"),
    "gemma3": ("attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight", "post_ffw_norm.weight"),
}


def _encode(x: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F32:
        return x.astype(np.float32)
    if qtype == T.F16:
        return x.astype(np.float16)
    return gq.quantize(x, qtype)


def write_synthetic_gguf(
    path,
    arch: str = "llama",
    n_layers: int = 2,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    d_ff: int = 128,
    vocab: int = 512,
    qtype: T = T.Q8_0,
    embed_qtype: T | None = None,
    tied: bool = True,
    context_length: int = 2048,
    rope_theta: float = 10000.0,
    rms_eps: float = 1e-5,
    seed: int = 0,
    head_dim: int | None = None,
    sliding_window: int = 512,
) -> str:
    """Write a random `arch` GGUF to `path`; return the path.

    head_dim defaults to d_model // n_heads; qwen3 and gemma3 record it as
    `{arch}.attention.key_length` (their released models have H * D != d).
    sliding_window: gemma3 only (its local layers' window).
    """
    assert arch in ARCH_TENSORS, f"{arch}: synthetic archs are {sorted(ARCH_TENSORS)}"
    assert qtype in WRITABLE, f"{qtype.name}: gguf cannot quantize it"
    embed_qtype = qtype if embed_qtype is None else embed_qtype
    head_dim = head_dim or d_model // n_heads
    rng = np.random.default_rng(seed)

    def mat(rows, cols):  # [rows, cols] numpy order; cols = fan_in
        return (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # (name, numpy shape, GGML type, generator); generated lazily, in order
    specs = [("token_embd.weight", (vocab, d_model), embed_qtype, lambda: rng.standard_normal((vocab, d_model), dtype=np.float32))]
    for i in range(n_layers):
        p = f"blk.{i}."
        specs += [
            (p + "attn_norm.weight", (d_model,), T.F32, lambda: norm(d_model)),
            (p + "attn_q.weight", (n_heads * head_dim, d_model), qtype, lambda: mat(n_heads * head_dim, d_model)),
            (p + "attn_k.weight", (n_kv_heads * head_dim, d_model), qtype, lambda: mat(n_kv_heads * head_dim, d_model)),
            (p + "attn_v.weight", (n_kv_heads * head_dim, d_model), qtype, lambda: mat(n_kv_heads * head_dim, d_model)),
            (p + "attn_output.weight", (d_model, n_heads * head_dim), qtype, lambda: mat(d_model, n_heads * head_dim)),
            (p + "ffn_norm.weight", (d_model,), T.F32, lambda: norm(d_model)),
            (p + "ffn_gate.weight", (d_ff, d_model), qtype, lambda: mat(d_ff, d_model)),
            (p + "ffn_up.weight", (d_ff, d_model), qtype, lambda: mat(d_ff, d_model)),
            (p + "ffn_down.weight", (d_model, d_ff), qtype, lambda: mat(d_model, d_ff)),
        ]
        # extra tensors after llama's, so a llama file's random draws stay as they were
        extra = {
            "attn_q.bias": ((n_heads * head_dim,), lambda: 0.5 * rng.standard_normal(n_heads * head_dim, dtype=np.float32)),
            "attn_k.bias": ((n_kv_heads * head_dim,), lambda: 0.5 * rng.standard_normal(n_kv_heads * head_dim, dtype=np.float32)),
            "attn_v.bias": ((n_kv_heads * head_dim,), lambda: 0.5 * rng.standard_normal(n_kv_heads * head_dim, dtype=np.float32)),
            "attn_q_norm.weight": ((head_dim,), lambda: norm(head_dim)),
            "attn_k_norm.weight": ((head_dim,), lambda: norm(head_dim)),
            "post_attention_norm.weight": ((d_model,), lambda: norm(d_model)),
            "post_ffw_norm.weight": ((d_model,), lambda: norm(d_model)),
        }
        specs += [(p + n, extra[n][0], T.F32, extra[n][1]) for n in ARCH_TENSORS[arch]]
    specs.append(("output_norm.weight", (d_model,), T.F32, lambda: norm(d_model)))
    if not tied:
        specs.append(("output.weight", (vocab, d_model), embed_qtype, lambda: mat(vocab, d_model)))

    w = GGUFWriter(str(path), arch)
    w.add_name(f"synthetic-{arch}-{n_layers}L-{d_model}d")
    add_shape(w, arch, n_layers, context_length, d_model, d_ff, n_heads, n_kv_heads, rope_theta, rms_eps, vocab)
    if arch in ("llama", "qwen2"):  # what llama.cpp's converter writes per arch
        w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    else:
        w.add_uint32(f"{arch}.attention.key_length", head_dim)
        w.add_uint32(f"{arch}.attention.value_length", head_dim)
    if arch == "gemma3":
        w.add_uint32(f"{arch}.attention.sliding_window", sliding_window)
    add_synthetic_tokenizer(w, vocab)
    w.add_string(
        "tokenizer.chat_template",
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )

    for name, shape, qt, _ in specs:
        if qt in (T.F32, T.F16):
            dt = np.dtype(np.float32 if qt == T.F32 else np.float16)
            w.add_tensor_info(name, shape, dt, int(np.prod(shape)) * dt.itemsize)
        else:
            bshape = quant_shape_to_byte_shape(shape, qt)
            w.add_tensor_info(name, bshape, np.dtype(np.uint8), int(np.prod(bshape)), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, qt, gen in specs:
        w.write_tensor_data(np.ascontiguousarray(_encode(gen(), qt)))
    w.close()
    return str(path)
