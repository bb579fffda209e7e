"""Is the CPU decode GEMV waiting on memory? A plain Numba stream over B bytes against the Q8_0 GEMV over a
synthetic matrix of the same size (Gemma 3's head: 262144 x 640) and over a copy small enough to stay in
cache, 1 and 2 threads. The GEMV at the stream's rate is memory-bound; far below it while the cached copy
runs fast, it is waiting on loads (the prefetch distance, `imp.kernels.cpu.row_dot_loop.PREFETCH`).

    PYTHONPATH=. .venv/bin/python bench/cpu_stream.py [--rows 262144] [--cols 640]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import numba
    import numpy as np
    from numba import njit, prange

    from imp.kernels.cpu import gemm_int8_act as qd
    from imp.kernels.cpu.kinds import Kinds
    from imp.kernels.cpu import row_dot_loop

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=262144)
    ap.add_argument("--cols", type=int, default=640)
    a = ap.parse_args()

    @njit(parallel=True)
    def stream(v):
        t = 0
        for i in prange(v.shape[0]):
            t += v[i]
        return t

    @njit(nogil=True)
    def gemv(n, blob, rb, R, K, xq, xu, xd, xs, out):
        for _ in range(n):
            qd.gemm_into(blob, 0, Kinds((qd.Q8_0,)), qd.Q8_0, rb, R, K, xq, xu, xd, xs, out, 0)

    K, rng = a.cols, np.random.default_rng(0)
    rb = qd.row_bytes(qd.Q8_0, K)
    xq, xd, xs = qd.quantize(rng.standard_normal((1, K)).astype(np.float32))
    xu = np.empty_like(xq)
    qd.widen_rows(xq, xu)
    print(f"PREFETCH {row_dot_loop.PREFETCH} bytes\n\n| what | MB | 1 thread GB/s | 2 threads GB/s |\n|---|---|---|---|")
    for R in (1024, a.rows):
        blob = rng.integers(0, 255, R * rb, dtype=np.uint8)
        blob.reshape(R, rb)[:, :2] = (0, 0x3C)  # fp16 scale 1.0
        out = np.empty((1, R), np.float32)
        cells, scells = [], []
        for th in (1, 2):
            numba.set_num_threads(th)
            n = max(3, int(2e9 / (R * rb)))
            gemv(2, blob, rb, R, K, xq, xu, xd, xs, out)
            best = min(_timed(lambda: gemv(n, blob, rb, R, K, xq, xu, xd, xs, out)) / n for _ in range(3))
            cells.append(f"{R * rb / best / 1e9:.1f}")
            words = blob[: R * rb // 8 * 8].view(np.uint64)
            stream(words)
            sbest = min(_timed(lambda: stream(words)) for _ in range(5))
            scells.append(f"{words.nbytes / sbest / 1e9:.1f}")
        mb = R * rb / 1e6
        print(f"| Q8_0 GEMV, {R} x {K} | {mb:.1f} | {cells[0]} | {cells[1]} |")
        print(f"| plain stream, same bytes | {mb:.1f} | {scells[0]} | {scells[1]} |")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
