"""Hugging Face model directories: config.json + *.safetensors, presented as
a GGUF would be (ModelConfig, GGUF-named tensors, metadata) so the same
architecture modules run them.

What llama.cpp's converter does to HF weights, done here at load time:
  - names: model.layers.N.self_attn.q_proj.weight -> blk.N.attn_q.weight, ...
  - llama: Q/K rows permuted so RoPE rotates adjacent pairs (llama.py's
    convention); qwen2/qwen3/gemma3 keep HF's order (NEOX RoPE, blocks.py)
  - gemma3: every `*norm.weight` + 1 (HF normalizes with (1 + w); the GGUF
    stores the multiplier)
Tensors are read lazily through `safetensors.safe_open` (memory-mapped), one
at a time, as the model asks for them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from imp.formats.gguf_loader import LoadedGGUF, ModelConfig

HF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}

_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",  # llama/qwen: the norm before the MLP
}
_GEMMA_LAYER = {  # gemma3 has four norms per block
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_name(hf: str, arch: str) -> str | None:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    m = _LAYER_RE.fullmatch(hf)
    if not m:
        return None
    rest = (_GEMMA_LAYER.get(m[2]) if arch == "gemma3" else None) or _LAYER.get(m[2])
    return f"blk.{m[1]}.{rest}" if rest else None


def permute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half rows -> GGUF adjacent-pair rows (convert_hf_to_gguf's `permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_config(d: Path) -> tuple[ModelConfig, dict]:
    c = json.loads((d / "config.json").read_text())
    mt = c.get("model_type")
    if mt not in HF_ARCH:
        raise ValueError(f"{d}: model_type {mt!r} not supported (have {sorted(HF_ARCH)})")
    arch = HF_ARCH[mt]
    d_model, H = int(c["hidden_size"]), int(c["num_attention_heads"])
    D = int(c.get("head_dim") or d_model // H)
    rp = c.get("rope_parameters") or {}  # transformers >= 5; older configs: rope_theta / rope_scaling
    full, local = rp.get("full_attention", rp), rp.get("sliding_attention", {})
    theta = float(c.get("rope_theta") or full.get("rope_theta") or 10000.0)
    scaling = c.get("rope_scaling") or full
    extras: dict = {"rope.dimension_count": D}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in ("default", None):
        extras["rope.scaling.type"] = kind
        extras["rope.scaling.factor"] = float(scaling.get("factor", 1.0))
    if arch == "qwen2" and c.get("use_sliding_window"):
        raise NotImplementedError(f"{d}: qwen2 with use_sliding_window")
    if arch == "gemma3":
        extras["attention.sliding_window"] = int(c.get("sliding_window") or 0)
        types = c.get("layer_types")
        if types:
            extras["attention.sliding_window_pattern"] = [t == "sliding_attention" for t in types]
        extras["rope.freq_base_swa"] = float(c.get("rope_local_base_freq") or local.get("rope_theta") or 10000.0)
        extras["attention.query_pre_attn_scalar"] = float(c.get("query_pre_attn_scalar") or D)
        for k in ("final_logit_softcapping", "attn_logit_softcapping"):
            if c.get(k):
                extras[k] = float(c[k])
    tie = c.get("tie_word_embeddings", arch == "gemma3")
    cfg = ModelConfig(
        arch=arch, n_layers=int(c["num_hidden_layers"]), d_model=d_model, n_heads=H,
        n_kv_heads=int(c.get("num_key_value_heads") or H), head_dim=D, d_ff=int(c["intermediate_size"]),
        vocab_size=int(c["vocab_size"]), context_length=int(c.get("max_position_embeddings", 2048)),
        rope_theta=theta, rms_eps=float(c.get("rms_norm_eps", 1e-6)), tied_embeddings=bool(tie), extras=extras,
    )
    return cfg, c


class HFTensors(Mapping):
    """GGUF name -> fp32 tensor in GGUF conventions, read from the safetensors on access."""

    def __init__(self, d: Path, cfg: ModelConfig):
        self.cfg = cfg
        self._where: dict[str, tuple[object, str]] = {}
        self._files = [safe_open(str(f), framework="pt") for f in sorted(d.glob("*.safetensors"))]
        if not self._files:
            raise ValueError(f"{d}: no *.safetensors")
        for f in self._files:
            for hf in f.keys():
                name = gguf_name(hf.removeprefix("language_model."), cfg.arch)
                if name and not (name == "output.weight" and cfg.tied_embeddings):
                    self._where[name] = (f, hf)

    def __getitem__(self, name: str) -> torch.Tensor:
        f, hf = self._where[name]
        w = f.get_tensor(hf).float()
        cfg = self.cfg
        if cfg.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            w = permute_rope(w, cfg.n_heads if "attn_q" in name else cfg.n_kv_heads)
        if cfg.arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0
        return w

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name) -> bool:
        return name in self._where


def chat_template(d: Path) -> str | None:
    """The directory's chat template: chat_template.jinja (transformers >= 4.47
    saves it there) or tokenizer_config.json's `chat_template` (a string, or
    a list of named templates: the "default" one)."""
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    tc = d / "tokenizer_config.json"
    if not tc.is_file():
        return None
    t = json.loads(tc.read_text()).get("chat_template")
    if isinstance(t, list):
        t = next((x["template"] for x in t if x.get("name") == "default"), None)
    return t


def fingerprint(d: Path) -> str:
    """sha256 of config.json and each safetensors file's name, size and header."""
    h = hashlib.sha256((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(f.name.encode() + f.stat().st_size.to_bytes(8, "little") + fh.read(n))
    return h.hexdigest()


def open_hf_dir(path) -> LoadedGGUF:
    d = Path(path)
    cfg, raw = read_config(d)
    p = cfg.arch + "."
    md = {
        "general.architecture": cfg.arch, "general.name": d.name, "general.source": "hf-dir",
        p + "block_count": cfg.n_layers, p + "embedding_length": cfg.d_model,
        p + "attention.head_count": cfg.n_heads, p + "attention.head_count_kv": cfg.n_kv_heads,
        p + "feed_forward_length": cfg.d_ff, p + "context_length": cfg.context_length,
        p + "vocab_size": cfg.vocab_size, p + "rope.freq_base": cfg.rope_theta,
        p + "attention.layer_norm_rms_epsilon": cfg.rms_eps, p + "attention.key_length": cfg.head_dim,
        **{p + k: v for k, v in cfg.extras.items()},
    }
    template = chat_template(d)
    if template:
        md["tokenizer.chat_template"] = template
    tensors = HFTensors(d, cfg)
    return LoadedGGUF(arch=cfg.arch, config=cfg, metadata=md, tensors=tensors, fingerprint=fingerprint(d),
                      qtypes={})
