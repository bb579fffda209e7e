"""A BF16 / F16 / F32 model's matrices stored as Q8_0 at load (`--weights q8_0`).

Why: a BF16 checkpoint reads 2 bytes a weight every decode step; Q8_0 (int8, one fp16 scale per 32: 1.06 bytes)
halves what a step reads and what the weights take in memory, and every executor already runs Q8_0 (the CPU's fused
kernels, the GPU's GEMVs with fp32 or int8 activations, MMQ, the dense copies). Measured on the real SmolLM2 upcast to
BF16 (`bench/fp8_accuracy.py`, 20 chat prompts, 852 answer tokens): Q8_0 keeps 98.6 % of BF16's greedy tokens
teacher-forced (logits' RMS error 3.2 % of their RMS, KL 0.0016 nats a token), where FP8 E4M3 with a scale a row keeps
91.5 % (9.7 %, 0.039) and with a scale per 32 weights 94.1 % (8.3 %, 0.019): at the same bytes, int8 with a block
scale is the closer 8-bit form of a BF16 matrix (E4M3 has 3 mantissa bits).

Which tensors: two-dimensional `*.weight` tensors stored as BF16, F16 or F32 whose rows are whole 32-weight blocks
(the matrices and the token embedding); vectors (norms) and already-quantized matrices are left as they are. The
bytes are gguf-py's Q8_0 (ggml's reference rounding) of the dequantized values, made once a tensor on first use and
kept (`Requant.raw`), so a loader that reads a tensor twice pays once.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

from imp.formats.gguf_file import GGUFHeader, TensorInfo, tensor_bytes
from imp.formats.quants import dequantize

FORMATS = ("native", "q8_0")  # --weights
_FROM = {"BF16", "F16", "F32"}
_ROWS = 4096  # rows quantized at a time: bounds the float32 copy (an 8B's embedding is 128k x 4096)


def converts(info: TensorInfo) -> bool:
    """A matrix this module stores as Q8_0."""
    return (info.name.endswith(".weight") and "norm" not in info.name and len(info.shape) == 2
            and info.shape[0] > 1 and info.qtype.name in _FROM and info.shape[-1] % 32 == 0)


def q8_0_bytes(raw: np.ndarray, info: TensorInfo) -> np.ndarray:
    """[rows, cols / 32 x 34] uint8: the tensor's values (raw = its encoded bytes, [rows, bytes a row]) as Q8_0."""
    rows, cols = info.shape
    out = np.empty((rows, cols // 32 * 34), np.uint8)
    for r in range(0, rows, _ROWS):
        part = raw[r:r + _ROWS]
        vals = dequantize(part, info.qtype, (part.shape[0], cols), name=info.name)
        out[r:r + part.shape[0]] = quants.quantize(np.ascontiguousarray(vals, np.float32), T.Q8_0)
    return out


class Requant:
    """A GGUF's tensors as a loader should see them under `fmt`: `info(name)` and `raw(name)` ([rows, bytes a row]
    uint8) of the converted matrices, the file's own for the rest. fmt "native" converts nothing.

    blob=True (the CPU's fused kernels, which read every layer matrix at an offset of one buffer): the converted
    matrices live in one buffer, `self.blob`, filled on first use, at the offsets their infos give; else each is its
    own array (the GPU's upload: `release` drops it once on the device) and its info's offset is -1."""

    def __init__(self, header: GGUFHeader, mm: np.ndarray, fmt: str = "native", blob: bool = False):
        if fmt not in FORMATS:
            raise ValueError(f"--weights must be one of {FORMATS}, not {fmt!r}")
        self.fmt, self._mm = fmt, mm
        self.infos = dict(header.tensors)
        self.converted: list[str] = []
        end = 0
        if fmt == "q8_0":
            for name, info in header.tensors.items():
                if converts(info):
                    rows, cols = info.shape
                    nbytes = rows * cols // 32 * 34
                    self.infos[name] = dataclasses.replace(info, qtype=T.Q8_0, offset=end if blob else -1, nbytes=nbytes)
                    self.converted.append(name)
                    end += -(-nbytes // 64) * 64  # rows of each matrix from a 64-byte boundary
        self.blob = np.empty(end, np.uint8) if blob and end else None
        self._orig = header.tensors
        self._cache: dict[str, np.ndarray] = {}

    def is_converted(self, name: str) -> bool:
        return self.infos[name] is not self._orig[name]

    def raw(self, name: str) -> np.ndarray:
        if not self.is_converted(name):
            return tensor_bytes(self._mm, self.infos[name])
        got = self._cache.get(name)
        if got is None:
            made = q8_0_bytes(tensor_bytes(self._mm, self._orig[name]), self._orig[name])
            if self.blob is not None:
                got = tensor_bytes(self.blob, self.infos[name])
                got[:] = made
            else:
                got = made
            self._cache[name] = got
        return got

    def base(self, names: list[str]) -> np.ndarray | None:
        """The one buffer `names`' info offsets index (all converted: the blob, filled; none: the file's map); None
        for a mix, or converted matrices without a blob."""
        conv = [self.is_converted(n) for n in names]
        if not any(conv):
            return self._mm
        if not all(conv) or self.blob is None:
            return None
        for n in names:
            self.raw(n)
        return self.blob

    def release(self, name: str) -> None:
        """Forget a converted tensor's bytes (a loader that copied them elsewhere: the GPU's upload)."""
        if self.blob is None:
            self._cache.pop(name, None)

    def layout_tag(self) -> str:
        """For the KV tier's layout string: a converted model's KV is not the native model's."""
        return f":w={self.fmt}" if self.converted else ""

    def summary(self) -> str:
        if self.fmt == "native":
            return ""
        if not self.converted:
            return f"--weights {self.fmt}: no BF16 / F16 / F32 matrix in this model; its weights load as they are"
        before = sum(self._orig[n].nbytes for n in self.converted)
        after = sum(self.infos[n].nbytes for n in self.converted)
        return (f"--weights {self.fmt}: {len(self.converted)} matrices to Q8_0 ({before / 1e9:.2f} -> "
                f"{after / 1e9:.2f} GB)")
