"""Numba CPU kernels over the GGUF file's own blocks (no torch):

    gemm_int8_act   activations quantized to int8 per block of 32; GEMV / small GEMM over the blocks
    row_dot_loop    the LLVM loop of one weight row . T tokens (gguf_block_ir: the blocks decoded in IR)
    predecoded      a prefill's weight rows decoded once into a scratch, then few tokens a call
    head_q8         a Q8_0 output head repacked at load
    isa             what the target CPU has: the int8 dot, AVX-512's registers or AVX2's
    gemm_q8_0_amx   Q8_0 GEMM on AMX int8 tiles (output heads)
    paged_attention attention over the paged fp16 KV cache, query heads of one KV head together
    fused_forward   every decoder layer of one step in one Numba call
    float_lanes     16-lane float intrinsics: dot, axpy, fp16 stores, exp

Nothing here imports imp.kernels.cuda (tests/test_architecture.py).

Numba's on-disk cache (`cache=True`) keys a function on its own file's mtime only, so an
edit to an intrinsic or to a callee in another file would leave stale machine code behind.
These kernels therefore cache under a directory named by a hash of all this package's
sources, set here, before any of them is decorated (importing one imports this first);
other Numba functions decorated later cache there too, harmlessly.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numba


def _cache_dir() -> str:
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(here.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    base = os.environ.get("NUMBA_CACHE_DIR") or str(here / "__pycache__")
    return os.path.join(base, "numba-cpu-" + h.hexdigest()[:12])


numba.config.CACHE_DIR = _cache_dir()
