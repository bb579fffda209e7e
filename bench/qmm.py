"""The skinny-GEMM question on the GPU: for the 8B Q4_K_M matrices at 1..512 rows, device µs of
the int8 tensor-core GEMM (`imp.kernels.cuda.gemm_int8_act`), the best dp4a GEMV variant (`gemv_int8_act`, up to 64
rows) and cuBLAS over a dense fp16 copy (what the server keeps today). Prints a markdown table.

    python3 bench/qmm.py [--rows 1,8,16,32,64,128,256,512] [--copies 3]

Each cell is a CUDA graph replaying the call over `copies` distinct copies of the matrix in turn, so
a matrix smaller than L2 is not timed from L2 (as `imp.gpu.linear.Linear.time_us` does). The
effective bandwidth column is the quantized weight bytes read once per call.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from imp.kernels.cuda import gemm_int8_act, gemv_int8_act, quantize_act_int8  # noqa: E402
from imp.kernels.cuda.quant_weight import repack  # noqa: E402
from tests.fixtures.synth_raw import random_blocks  # noqa: E402

# Llama-3-8B matrices as Q4_K_M lays them out (attn_v / ffn_down Q6_K in half the layers: both shown)
SHAPES = [("qkv", "Q4_K", 6144, 4096), ("o", "Q4_K", 4096, 4096), ("gate_up", "Q4_K", 28672, 4096),
          ("down", "Q6_K", 4096, 14336), ("down_q4k", "Q4_K", 4096, 14336)]
BE = {"Q4_K": 256, "Q6_K": 256}
FT = {"Q4_K": T.Q4_K, "Q6_K": T.Q6_K}


def graph_us(fns, reps: int = 6) -> float:
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=s):
        for i in range(reps):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / reps * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,16,32,64,128,256,512")
    ap.add_argument("--copies", type=int, default=3)
    a = ap.parse_args()
    Ms = [int(v) for v in a.rows.split(",")]
    rng = np.random.default_rng(0)
    lines = ["| matrix | fmt | N x K | M | qmm µs | best q8 GEMV µs (variant) | dense fp16 cuBLAS µs | qmm vs dense | qmm GB/s | max rel diff qmm vs GEMV |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, fmt, N, K in SHAPES:
        raw = random_blocks(FT[fmt], N * K // BE[fmt], K ** -0.5, rng)
        ws = [repack(raw, fmt, N, K).to("cuda") for _ in range(a.copies)]
        dense = [torch.randn(N, K, dtype=torch.float16, device="cuda") * K ** -0.5 for _ in range(a.copies)]
        nbytes = ws[0].nbytes
        for M in Ms:
            x = torch.randn(M, K, device="cuda")
            xa = quantize_act_int8.quantize(x)
            xh = x.half()
            outs = [torch.empty(M, N, device="cuda") for _ in range(a.copies)]
            t_qmm = graph_us([lambda w=w, o=o: gemm_int8_act.qmm(w, xa, o) for w, o in zip(ws, outs)])
            t_dense = graph_us([lambda d=d: torch.mm(xh, d.t()) for d in dense])
            gv, gname, diff = float("nan"), "-", float("nan")
            if M <= 64:
                for v, (r, sp) in gemv_int8_act.VARIANTS.items():
                    t = graph_us([lambda w=w, o=o, r=r, sp=sp: gemv_int8_act.gemv(w, xa, o, rows=r, split=sp)
                                  for w, o in zip(ws, outs)])
                    if not t >= gv:
                        gv, gname = t, v
                ref = gemv_int8_act.gemv(ws[0], xa, rows=1)
                got = gemm_int8_act.qmm(ws[0], xa)
                diff = float(((got - ref).abs().max() / ref.abs().max()).item())
            lines.append(f"| {name} | {fmt} | {N}x{K} | {M} | {t_qmm:.1f} | {gv:.1f} ({gname}) | {t_dense:.1f} | "
                         f"{t_dense / t_qmm:.2f}x | {nbytes / t_qmm / 1e3:.0f} | {diff:.1e} |")
            print(lines[-1], flush=True)
        del ws, dense
        torch.cuda.empty_cache()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
