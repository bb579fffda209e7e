"""Direct GGUF header parse: metadata, tensor infos, data offset; tensor bytes
as numpy views of one memory map.

Why not `gguf.GGUFReader`: it builds a numpy view per element of every array
field, which takes ~5 s for SmolLM2's 49k-token vocabulary and ~20 s for
Gemma's 262k on this box. Here string arrays are read in a loop over one
mmap and numeric arrays are a single `np.frombuffer`: ~0.3 s for Gemma; long
ones stay packed (PACK_FROM), so the metadata a runner keeps is ~5 MB, not ~40.

Layout (GGUF v2/v3, little-endian):
    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x (key: string, type: u32, value)
    n_tensors x (name: string, n_dims u32, ne[n_dims] u64, type u32, offset u64)
    padding to `general.alignment` (default 32), then tensor data; a tensor's
    bytes start at data_offset + offset.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from imp.formats.packed import PackedStr

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
# Arrays this long (vocabularies, merges, scores) are kept compact: a string array as a
# PackedStr, a numeric one as a read-only numpy array. Shorter ones (per-layer values,
# tags) stay lists, which is what the code reading them expects.
PACK_FROM = 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: GGUF ne[] reversed ([rows, cols] for a matrix)
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]  # in file order
    data_offset: int  # where tensor data starts; everything before it is the "header"


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return out

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        self.pos += n
        return self.buf[self.pos - n : self.pos].decode("utf-8", "replace")

    def strings(self, n: int) -> PackedStr:
        """n length-prefixed strings as one blob (the bytes between the prefixes, joined)."""
        buf, pos = self.buf, self.pos
        starts, lens = np.empty(n, np.int64), np.empty(n, np.int64)
        for j in range(n):
            (k,) = struct.unpack_from("<Q", buf, pos)
            starts[j], lens[j] = pos + 8, k
            pos += 8 + k
        self.pos = pos
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        return PackedStr(b"".join([buf[a : a + k] for a, k in zip(starts.tolist(), lens.tolist())]), offsets)

    def value(self, t: int) -> Any:
        if t == STRING:
            return self.string()
        if t == ARRAY:
            et, n = self.unpack("<IQ")
            if et == STRING and n >= PACK_FROM:
                return self.strings(n)
            if et in (STRING, ARRAY):
                return [self.value(et) for _ in range(n)]
            a = np.frombuffer(self.buf, dtype=_DTYPES[et], count=n, offset=self.pos)
            self.pos += a.nbytes
            out = a.tolist() if n < PACK_FROM else a.copy()  # a copy: the mmap closes after the parse
            del a  # drop the view, or the mmap cannot close
            if isinstance(out, np.ndarray):
                out.flags.writeable = False
            return out
        return self.unpack(_SCALARS[t])[0]


class ModelFileError(ValueError):
    """A model file that cannot be read as what it says it is: the server says so in one line and exits."""


def read_header(path) -> GGUFHeader:
    try:
        return _read_header(path)
    except ModelFileError:
        raise
    except (struct.error, IndexError, UnicodeDecodeError, KeyError) as exc:  # a header cut short or garbled
        raise ModelFileError(f"{path}: not a readable GGUF header ({type(exc).__name__}: {exc})") from exc
    except ValueError as exc:  # an empty file (mmap), an unknown tensor type
        raise ModelFileError(f"{path}: {exc}") from exc


def _read_header(path) -> GGUFHeader:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        c = _Cursor(mm)
        magic, version, n_tensors, n_kv = c.unpack("<4sIQQ")
        if magic != b"GGUF" or version < 2:
            raise ModelFileError(f"{path}: not a GGUF v2+ file")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            (t,) = c.unpack("<I")
            meta[key] = c.value(t)
        raw = []
        for _ in range(n_tensors):
            name = c.string()
            (nd,) = c.unpack("<I")
            ne = c.unpack(f"<{nd}Q")
            qt, off = c.unpack("<IQ")
            raw.append((name, ne, qt, off))
        align = int(meta.get("general.alignment", 32))
        data_offset = (c.pos + align - 1) // align * align
        size = len(mm)
    tensors = {}
    for name, ne, qt, off in raw:
        qtype = GGMLQuantizationType(qt)
        block, type_size = GGML_QUANT_SIZES[qtype]
        # a row that is not whole blocks, or data past the end of the file, would be read as
        # garbage by every kernel (and out of bounds by some): refused here, naming the tensor
        if ne and (ne[0] == 0 or ne[0] % block):
            raise ModelFileError(f"{path}: tensor {name}: a row of {ne[0]} values is not whole {qtype.name} blocks of {block}")
        n = int(np.prod(ne, dtype=np.int64))
        if data_offset + off + n // block * type_size > size:
            raise ModelFileError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
        tensors[name] = TensorInfo(name, tuple(int(x) for x in reversed(ne)), qtype,
                                   data_offset + off, n // block * type_size)
    return GGUFHeader(meta, tensors, data_offset)


def tensor_bytes(mm: np.ndarray, info: TensorInfo) -> np.ndarray:
    """[rows, bytes_per_row] uint8 view of a tensor in the file's memmap (no copy)."""
    rows = int(np.prod(info.shape[:-1], dtype=np.int64)) if len(info.shape) > 1 else 1
    return mm[info.offset : info.offset + info.nbytes].reshape(rows, -1)
