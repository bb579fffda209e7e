"""The CPU decode GEMV (one token) on a GGUF's own matrices, 1 and 2 threads: µs and GB/s of weights.

    .venv/bin/python bench/cpu_gemv.py --model ~/.cache/imp/SmolLM2-135M-Instruct.Q4_1.gguf \
        --tensors token_embd.weight,blk.0.ffn_gate.weight,blk.0.ffn_down.weight,blk.0.attn_q.weight

Each matrix runs many times inside one Numba loop (no Python dispatch between calls), so a small
matrix is measured from the caches (the kernel's own speed) and the head from memory; a real step
streams every matrix from memory once.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import gguf
    import numba
    import numpy as np
    from numba import njit

    from imp.kernels.cpu import gemm_int8_act as qd
    from imp.kernels.cpu.kinds import Kinds

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tensors", default="token_embd.weight,blk.0.ffn_gate.weight,blk.0.ffn_down.weight,"
                                         "blk.0.attn_q.weight,blk.0.attn_output.weight")
    ap.add_argument("--bytes", type=float, default=2e9, help="weight bytes each timing reads")
    a = ap.parse_args()

    @njit(nogil=True)
    def loop(n, blob, off, kinds, qt, rb, R, K, xq, xu, xd, xs, out):
        for _ in range(n):
            qd.gemm_into(blob, off, kinds, qt, rb, R, K, xq, xu, xd, xs, out, 0)

    names = a.tensors.split(",")
    blob = np.memmap(a.model, dtype=np.uint8, mode="r")
    print(f"| tensor | type | rows x cols | MB | 1 thread µs | GB/s | 2 threads µs | GB/s |\n|---|---|---|---|---|---|---|---|")
    for t in gguf.GGUFReader(a.model).tensors:
        if t.name not in names:
            continue
        K, R, qt = int(t.shape[0]), int(t.shape[1]), int(t.tensor_type)
        rb = qd.row_bytes(qt, K)
        xq, xd, xs = qd.quantize(np.random.default_rng(0).standard_normal((1, K)).astype(np.float32))
        xu = np.empty_like(xq)
        qd.widen_rows(xq, xu)
        out = np.empty((1, R), np.float32)
        cells = []
        for th in (1, 2):
            numba.set_num_threads(th)
            n = max(3, int(a.bytes / (R * rb)))
            loop(2, blob, int(t.data_offset), Kinds((qt,)), qt, rb, R, K, xq, xu, xd, xs, out)
            t0 = time.perf_counter()
            loop(n, blob, int(t.data_offset), Kinds((qt,)), qt, rb, R, K, xq, xu, xd, xs, out)
            s = (time.perf_counter() - t0) / n
            cells += [f"{s * 1e6:,.1f}", f"{R * rb / s / 1e9:.1f}"]
        print(f"| {t.name} | {t.tensor_type.name} | {R} x {K} | {R * rb / 1e6:.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
