"""Read a GGUF file: metadata, model shape, dequantized tensors, fingerprint.

`open_gguf` parses the header directly (`gguf_file.py`, ~0.3 s even for
Gemma's 262k vocabulary) and memory-maps the file; its `tensors` mapping
dequantizes a tensor only when the model asks for it, so a model built from
it peaks at its own weights plus one dequantized tensor, never the whole
fp32 model. `load_gguf` is the eager form (every tensor dequantized).
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
from collections.abc import Mapping
from dataclasses import dataclass, field
from imp.formats.gguf_file import GGUFHeader, TensorInfo, read_header, tensor_bytes
from imp.formats.quants import dequantize
from imp.formats.requant import Requant
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, as GGUF describes it."""

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_eps: float
    tied_embeddings: bool
    extras: dict[str, Any] = field(default_factory=dict)  # other `{arch}.*` keys, prefix dropped

    def replace(self, **kw) -> ModelConfig:
        return dataclasses.replace(self, **kw)


@dataclass
class LoadedGGUF:
    arch: str
    config: ModelConfig
    metadata: dict[str, Any]  # every KV field as a plain python value
    tensors: Mapping[str, "torch.Tensor"]  # GGUF tensor name -> dequantized, numpy shape order (lazy: GGUFTensors)
    fingerprint: str  # sha256 hex of header + KV + tensor infos
    qtypes: dict[str, str] = field(default_factory=dict)  # tensor name -> GGML type name


def _plain(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _field_value(f) -> Any:
    """A ReaderField as a plain python value (str, int, float, bool or list)."""
    if not f.types:
        return None
    t0 = f.types[0]
    if t0 == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8", errors="replace")
    if t0 == GGUFValueType.ARRAY:
        sub = f.types[-1] if len(f.types) > 1 else None
        if sub == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        if sub == GGUFValueType.ARRAY:  # nested arrays: rare; let gguf unpack them
            return _plain(f.contents())
        if not f.data:
            return []
        # numeric arrays: each element is its own 1-element part; concatenate in one go
        return np.concatenate([f.parts[i] for i in f.data]).tolist()
    return _plain(f.parts[f.data[0]][0])


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {name: _field_value(f) for name, f in reader.fields.items()}


def config_from_metadata(md: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = md["general.architecture"]
    p = arch + "."

    def get(key, default=None):
        return md.get(p + key, default)

    d_model = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    d_ff = get("feed_forward_length")
    # some archs store per-layer lists; this runtime uses uniform layers
    n_kv = int(n_kv[0] if isinstance(n_kv, list) else n_kv)
    d_ff = int(d_ff[0] if isinstance(d_ff, list) else d_ff)
    vocab = get("vocab_size") or len(md.get("tokenizer.ggml.tokens", []))
    consumed = {
        "block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
        "feed_forward_length", "vocab_size", "context_length", "rope.freq_base",
        "attention.layer_norm_rms_epsilon", "attention.key_length",
    }
    extras = {k[len(p):]: v for k, v in md.items() if k.startswith(p) and k[len(p):] not in consumed}
    return ModelConfig(
        arch=arch,
        n_layers=int(get("block_count")),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=int(get("attention.key_length", d_model // n_heads)),
        d_ff=d_ff,
        vocab_size=int(vocab),
        context_length=int(get("context_length", 2048)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tied_embeddings="output.weight" not in tensor_names,
        extras=extras,
    )


def fingerprint(path: str, reader: "GGUFReader | GGUFHeader") -> str:
    """sha256 of everything before the tensor data: header, KV and tensor infos.

    Names, shapes, types and offsets pin the weights' layout; the weights
    themselves are not hashed (a full hash of a large model takes seconds).
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(reader.data_offset))
    return h.hexdigest()


class GGUFTensors(Mapping):
    """name -> dequantized tensor, computed on each access from the memory map."""

    def __init__(self, path: str, header: GGUFHeader, dtype=None, requant: str = "native"):
        self.dtype = dtype  # of the torch tensors `[]` returns (None: float32)
        self._mm = np.memmap(path, dtype=np.uint8, mode="r")
        self.requant = Requant(header, self._mm, requant, blob=True)  # --weights: matrices stored another way
        self.infos = self.requant.infos

    def __getitem__(self, name: str) -> "torch.Tensor":
        import torch  # only the torch forwards index tensors; the fused CPU path reads `array`/`raw`

        return torch.from_numpy(self.array(name)).to(self.dtype or torch.float32)

    def array(self, name: str) -> np.ndarray:
        """The tensor dequantized, numpy shape order, an array of its own (not a view of the map)."""
        info = self.infos[name]
        arr = dequantize(self.raw(name), info.qtype, info.shape, name=name)
        if not arr.flags.writeable:  # F32 data is a view of the read-only map: own a copy
            arr = arr.copy()
        return arr

    def raw(self, name: str) -> np.ndarray:
        """[rows, bytes_per_row] uint8 view of the tensor's encoded bytes (a converted matrix's: made once, kept)."""
        return self.requant.raw(name)

    def rows(self, name: str, start: int, stop: int) -> "torch.Tensor":
        """Rows start..stop-1 of a matrix, dequantized (rows hold whole blocks)."""
        import torch

        info = self.infos[name]
        raw = self.raw(name)[start:stop]
        return torch.from_numpy(dequantize(raw, info.qtype, (raw.shape[0], info.shape[-1]), name=name).copy())

    def info(self, name: str) -> TensorInfo:
        return self.infos[name]

    def base(self, names: list[str]) -> np.ndarray | None:
        """The buffer these tensors' info offsets index (the file's map, or the converted matrices' buffer); None
        where they are in two (the fused kernels read every layer matrix from one)."""
        return self.requant.base(names)

    def drop_pages(self, name: str) -> None:
        """Tell the kernel this tensor's pages of the map are not needed now (MADV_DONTNEED on
        the whole pages inside it): a tensor copied elsewhere at load stops counting in RSS; a
        later read of it pages it in again from the file, as a first read would."""
        if self.requant.is_converted(name):  # converted at load: its bytes are not the map's
            return
        raw = self.raw(name)
        mm = getattr(self._mm, "_mmap", None)
        if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = raw.ctypes.data - self._mm.ctypes.data
        page = mmap.PAGESIZE
        lo, hi = -(-start // page) * page, (start + raw.nbytes) // page * page
        if hi > lo:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def __iter__(self):
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def __contains__(self, name) -> bool:
        return name in self.infos


def open_gguf(path: str, dtype=None, requant: str = "native") -> LoadedGGUF:
    """Metadata and config now; tensors dequantized lazily (see `GGUFTensors`). requant: `--weights` (imp.formats.
    requant: "q8_0" serves a BF16 / F16 / F32 model's matrices as Q8_0)."""
    path = str(path)
    header = read_header(path)
    config = config_from_metadata(header.metadata, set(header.tensors))
    tensors = GGUFTensors(path, header, dtype, requant)
    return LoadedGGUF(
        arch=config.arch,
        config=config,
        metadata=header.metadata,
        tensors=tensors,
        fingerprint=fingerprint(path, header),
        qtypes={n: t.qtype.name for n, t in tensors.infos.items()},
    )


def load_gguf(path: str, dtype=None) -> LoadedGGUF:
    """`open_gguf` with every tensor dequantized up front (a plain dict)."""
    g = open_gguf(path, dtype)
    g.tensors = {name: g.tensors[name] for name in g.tensors}
    return g
