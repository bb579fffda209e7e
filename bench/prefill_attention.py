"""Prefill attention over the paged cache, one layer: paged_prefill (a block a tile and KV head, key tiles staged once
for the group's warps; one or two heads a warp) against paged_prefill_warp (a warp a tile and head), and torch's flash
SDPA as the tensor-core rate to aim at.

    python3 bench/prefill_attention.py [--chunks 128,256,512,1024,2048] [--prefix 0,4096,16384] [--shapes 8b,smollm2]

Each cell: a chunk of C rows after a cached prefix of P positions (what the server's chunked prefill runs: a 16k
prompt is 16 chunks of 1,024 at P = 0, 1,024, ... 15,360), µs a call (CUDA events, median of 20 after 3 warm-ups),
TFLOP/s of the causal work (4 x H x D x the keys each row sees), and the same rows' bits compared between the two
kernels. SDPA: torch.nn.functional.scaled_dot_product_attention on one causal P + C sequence (bf16), its rate over
its own causal work: what flash attention reaches on this card at that length.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

SHAPES = {"8b": (32, 8, 128), "smollm2": (9, 3, 64)}


def _time(fn, reps: int = 20) -> float:
    from imp.gpu.mixed import event_ns

    for _ in range(3):
        fn()
    return statistics.median(event_ns(fn, reps)) / 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="128,256,512,1024,2048")
    ap.add_argument("--prefix", default="0,4096,16384")
    ap.add_argument("--shapes", default="8b,smollm2")
    a = ap.parse_args()
    from imp.kernels.cuda import paged_prefill_attention as pp

    print(f"{torch.cuda.get_device_name(0)}")
    print("| shape | chunk | prefix | warp µs | TFLOP/s | 1 head a warp µs | TFLOP/s | 2 heads a warp µs | TFLOP/s | "
          "best / warp | same bits | SDPA TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    bs = 16
    for name in a.shapes.split(","):
        H, Hkv, D = SHAPES[name]
        kinds = [dict(warp=True), dict(hpw=1)] + ([dict(hpw=2)] if (H // Hkv) % 2 == 0 else [])
        for P in (int(x) for x in a.prefix.split(",")):
            for C in (int(x) for x in a.chunks.split(",")):
                L = P + C
                nb = -(-L // bs)
                kc = torch.randn(nb + 1, bs, Hkv, D, device="cuda").to(torch.bfloat16)
                vc = torch.randn_like(kc)
                blocks = np.random.default_rng(L).permutation(nb + 1)[:nb].astype(np.int32)
                tiles, bt = pp.plan([(0, C, blocks, P)])
                tiles, bt = torch.from_numpy(tiles).cuda(), torch.from_numpy(bt).cuda()
                q = torch.randn(C, (H + 2 * Hkv) * D, device="cuda")
                outs, us = [], []
                for kw in kinds:
                    out = torch.empty(C, H * D, device="cuda")
                    us.append(_time(lambda: pp.paged_prefill(q, kc, vc, tiles, bt, H, out, last=L - 1, **kw)))
                    outs.append(out)
                flop = 4 * H * D * (C * P + C * (C + 1) / 2)
                same = all(torch.equal(o, outs[0]) for o in outs[1:])
                qs = torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16)
                ks = torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16)
                vs = torch.randn_like(ks)
                sd = _time(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
                sd_flop = 4 * H * D * L * (L + 1) / 2
                cells = " | ".join(f"{u:,.1f} | {flop / u / 1e6:.1f}" for u in us)
                if len(us) == 2:
                    cells += " |  | "
                print(f"| {name} | {C:,} | {P:,} | {cells} | {min(us[1:]) / us[0]:.2f} | {'yes' if same else 'NO'} | "
                      f"{sd_flop / sd / 1e6:.0f} |", flush=True)
                del kc, vc, qs, ks, vs
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
