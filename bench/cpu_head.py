"""A model's output head (the whole matrix) at decode batch sizes, on every Q8_0 route the CPU has, ms: the
file loop (`imp.kernels.cpu.gemm_int8_act.gemm`, `amx=False`; "vnni", the AVX2 loop on that tier), the repacked
head the server uses (`imp.kernels.cpu.head_q8`, "packed": VNNI / AVX2 tiers) and AMX tiles
(`imp.kernels.cpu.gemm_q8_0_amx`, where the CPU has them).

    .venv/bin/python bench/cpu_head.py --model ~/.cache/imp/gemma-3-270m-q4_k_m.gguf [--threads 2]

The routes alternate, best of --reps each; the activations are random (the kernels' time does
not depend on the values). Both read the mmapped GGUF, so a head larger than the caches is
measured from memory, as in a step; the packed copy is in anonymous memory, as the server holds it.
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

    from imp.kernels.cpu import gemm_q8_0_amx, head_q8
    from imp.kernels.cpu import gemm_int8_act as qd

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tensor", default=None, help="default: output.weight, else token_embd.weight")
    ap.add_argument("--batches", default="1,2,3,4,6,8,12,16,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args()
    numba.set_num_threads(a.threads)
    tensors = {t.name: t for t in gguf.GGUFReader(a.model).tensors}
    t = tensors[a.tensor or ("output.weight" if "output.weight" in tensors else "token_embd.weight")]
    K, R, qt = int(t.shape[0]), int(t.shape[1]), int(t.tensor_type)
    blob = np.memmap(a.model, dtype=np.uint8, mode="r")
    rb = qd.row_bytes(qt, K)
    w = np.asarray(blob[int(t.data_offset): int(t.data_offset) + R * rb]).reshape(R, rb)
    routes = [("vnni", False)] + ([("amx", True)] if gemm_q8_0_amx.AMX and qt == qd.Q8_0 else [])
    packed = head_q8.PackedQ8(w) if qt == qd.Q8_0 and head_q8.DP4 else None
    if packed is not None:
        routes.append(("packed", None))

    def run(amx, x):
        return head_q8.gemm(packed, x) if amx is None else qd.gemm(w, qt, x, amx=amx)
    print(f"{t.name} {t.tensor_type.name} {R} x {K} ({R * rb / 1e6:.1f} MB), {a.threads} threads, "
          f"AMX {'on' if gemm_q8_0_amx.AMX else 'off'} here")
    print("| tokens | " + " | ".join(f"{n} ms" for n, _ in routes) + "".join(f" | vnni / {n}" for n, _ in routes[1:])
          + " |")
    print("|---" * (2 * len(routes)) + "|")
    rng = np.random.default_rng(0)
    for N in (int(v) for v in a.batches.split(",")):
        x = rng.standard_normal((N, K)).astype(np.float32)
        best = {n: float("inf") for n, _ in routes}
        for n, amx in routes:
            run(amx, x)  # compile / warm
        for _ in range(a.reps):
            for n, amx in routes:
                t0 = time.perf_counter()
                run(amx, x)
                best[n] = min(best[n], time.perf_counter() - t0)
        cells = [f"{best[n] * 1e3:.2f}" for n, _ in routes]
        cells += [f"{best['vnni'] / best[n]:.2f}" for n, _ in routes[1:]]
        print(f"| {N} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
