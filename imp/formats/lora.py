"""LoRA adapter files: a PEFT directory (adapter_config.json + adapter_model.safetensors) or
a single .safetensors file, read into per-(layer, matrix) A and B factors.

Only safetensors are read (never a pickle: adapter_model.bin is refused). Paths come from
an admin call, so `confine` keeps them under --lora-dir: `..`, absolute paths outside it
and symlinks that lead out of it are refused before anything is opened.

Layout: PEFT names a factor `...layers.{l}.{self_attn|mlp}.{q_proj|...}.lora_A.weight`
([r, in]) and `...lora_B.weight` ([out, r]); the update is W x + (alpha / r) B A x
(alpha / sqrt(r) with use_rslora). A single-file adapter carries `lora_alpha` (and
optionally `r`) in its safetensors metadata, else alpha = r. The GGUF converter
permutes llama's q and k rows (HF's rotate-half order -> GGML's interleaved RoPE), so
B's rows of q_proj/k_proj are permuted the same way (`check`).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# PEFT target module -> index into the model's seven matrices (imp.kernels.cpu.fused_forward's mats)
MODULES = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "o_proj": 3, "gate_proj": 4, "up_proj": 5, "down_proj": 6}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
MAX_RANK = 256


class LoraError(ValueError):
    """Why an adapter cannot be loaded (a 400 lora_load_failed, the message says why)."""


@dataclass
class Adapter:
    rank: int
    scale: float
    factors: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # (l, m) -> A, B
    targets: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values())


def confine(lora_dir: str | None, path: str) -> Path:
    """The adapter path resolved inside lora_dir, or LoraError."""
    if not lora_dir:
        raise LoraError("LoRA loading is off: start the server with --lora-dir DIR")
    if not isinstance(path, str) or not path:
        raise LoraError("'path' must be a non-empty string")
    if "\x00" in path:
        raise LoraError("'path' must not contain NUL bytes")
    root = Path(lora_dir).resolve()
    raw = Path(path)
    if ".." in raw.parts:
        raise LoraError(f"'path' {path!r} must not contain '..'")
    cand = raw if raw.is_absolute() else root / raw
    real = Path(os.path.realpath(cand))  # follows every symlink on the way
    if real != root and root not in real.parents:
        raise LoraError(f"'path' {path!r} is outside --lora-dir" + (" (through a symlink)" if
                                                                   not raw.is_absolute() else ""))
    if not real.exists():
        raise LoraError(f"'path' {path!r} does not exist under --lora-dir")
    return real


def read_adapter(path: Path) -> Adapter:
    from safetensors import safe_open

    if path.is_dir():
        cfg_file, st_file = path / "adapter_config.json", path / "adapter_model.safetensors"
        if not st_file.exists():
            if (path / "adapter_model.bin").exists():
                raise LoraError("adapter_model.bin is a pickle and is never loaded; save with safetensors")
            raise LoraError(f"{path.name}: no adapter_model.safetensors (not a PEFT adapter)")
        try:
            cfg = json.loads(cfg_file.read_text())
        except (OSError, ValueError) as exc:
            raise LoraError(f"{path.name}: adapter_config.json unreadable: {exc}") from None
        if cfg.get("peft_type", "LORA") != "LORA":
            raise LoraError(f"{path.name}: peft_type {cfg.get('peft_type')!r} is not LORA")
        if cfg.get("fan_in_fan_out"):
            raise LoraError(f"{path.name}: fan_in_fan_out adapters are not supported")
        if cfg.get("bias", "none") != "none":
            raise LoraError(f"{path.name}: adapters with trained biases are not supported")
        if cfg.get("use_dora"):
            raise LoraError(f"{path.name}: DoRA adapters are not supported")
        if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
            raise LoraError(f"{path.name}: per-module rank or alpha patterns are not supported")
        rank, alpha, rs = cfg.get("r"), cfg.get("lora_alpha"), bool(cfg.get("use_rslora"))
    elif path.suffix == ".safetensors":
        st_file, rank, alpha, rs = path, None, None, False
    else:
        raise LoraError(f"{path.name}: a LoRA is a PEFT directory or a .safetensors file")
    try:
        with safe_open(str(st_file), framework="numpy") as f:
            meta = f.metadata() or {}
            raw = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - a damaged file is the caller's 400, with its reason
        raise LoraError(f"{st_file.name}: not a readable safetensors file: {exc}") from None
    pairs: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    names = set()
    for key, t in raw.items():
        m = _KEY.search(key)
        if m is None:
            raise LoraError(f"{st_file.name}: tensor {key!r} is not a LoRA factor of a known module")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES:
            raise LoraError(f"{st_file.name}: target module {module!r} is not one of {sorted(MODULES)}")
        names.add(module)
        pairs.setdefault((layer, MODULES[module]), {})[ab] = np.ascontiguousarray(t, dtype=np.float32)
    if not pairs:
        raise LoraError(f"{st_file.name}: no LoRA factors")
    ranks = set()
    factors = {}
    for (layer, mi), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{st_file.name}: layer {layer} module {mi} lacks lora_{'AB'[('A' in ab)]}")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"{st_file.name}: layer {layer}: A {a.shape} and B {b.shape} do not chain")
        ranks.add(a.shape[0])
        factors[(layer, mi)] = (a, b)
    if len(ranks) != 1:
        raise LoraError(f"{st_file.name}: mixed ranks {sorted(ranks)}")
    r = ranks.pop()
    if rank is None:
        rank = int(meta.get("r", r))
        alpha = float(meta.get("lora_alpha", rank))
    if rank != r or not 1 <= r <= MAX_RANK:
        raise LoraError(f"{st_file.name}: rank {r} (config says {rank}); 1..{MAX_RANK} supported")
    alpha = float(alpha if alpha is not None else rank)
    scale = alpha / math.sqrt(rank) if rs else alpha / rank
    return Adapter(rank=r, scale=scale, factors=factors, targets=tuple(sorted(names)))


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute on the output rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def check(ad: Adapter, cfg, arch: str) -> Adapter:
    """Shapes against the model (ModelConfig), and llama's q/k row permutation applied."""
    H, Hkv, D, d, ff, L = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model, cfg.d_ff, cfg.n_layers
    shapes = {0: (H * D, d), 1: (Hkv * D, d), 2: (Hkv * D, d), 3: (d, H * D), 4: (ff, d), 5: (ff, d), 6: (d, ff)}
    out = {}
    for (layer, mi), (a, b) in ad.factors.items():
        if not 0 <= layer < L:
            raise LoraError(f"layer {layer} does not exist: the model has {L}")
        want_out, want_in = shapes[mi]
        if a.shape[1] != want_in or b.shape[0] != want_out:
            name = next(k for k, v in MODULES.items() if v == mi)
            raise LoraError(f"layer {layer} {name}: the adapter is [{b.shape[0]} x {a.shape[1]}], the model "
                            f"[{want_out} x {want_in}]: made for another model")
        if arch == "llama" and mi in (0, 1):
            b = np.ascontiguousarray(_permute(b, H if mi == 0 else Hkv))
        out[(layer, mi)] = (a, b)
    return Adapter(ad.rank, ad.scale, out, ad.targets)


class LoraFiles:
    """What the engine is handed at boot (it may not import this layer): confine a requested
    path to --lora-dir, and read + check an adapter against a model's config."""

    def __init__(self, lora_dir: str | None):
        self.lora_dir = lora_dir

    def confine(self, path: str) -> str:
        return str(confine(self.lora_dir, path))

    def read(self, path: str, cfg) -> Adapter:
        return check(read_adapter(Path(path)), cfg, cfg.arch)
