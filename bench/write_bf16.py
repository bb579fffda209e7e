"""A GGUF's matrices upcast to BF16, metadata kept: a real model as a BF16 checkpoint would hold it, for the weight
formats' benchmarks (`--weights q8_0` against BF16 as it is; llama.cpp on the same file).

    .venv/bin/python bench/write_bf16.py SRC.gguf DST.gguf

Every two-dimensional tensor named `*.weight` (not a norm) is dequantized and written as BF16 (round to nearest
even); vectors and everything in the header are copied as they are.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import gguf  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from imp.formats.quants import dequantize  # noqa: E402


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def main(src: str, dst: str) -> int:
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vtype, sub_type=sub)
    n = 0
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))  # numpy order
        raw = np.asarray(t.data)
        if t.name.endswith(".weight") and "norm" not in t.name and len(shape) == 2 and t.tensor_type != T.BF16:
            vals = dequantize(raw.reshape(shape[0], -1) if t.tensor_type not in (T.F32, T.F16) else raw,
                              t.tensor_type, shape, name=t.name)
            w.add_tensor(t.name, to_bf16_bits(vals).reshape(shape), raw_dtype=T.BF16)  # uint16 [rows, cols]
            n += 1
        else:
            w.add_tensor(t.name, raw, raw_shape=shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {dst}: {n} matrices as BF16 ({Path(dst).stat().st_size / 1e6:.0f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
