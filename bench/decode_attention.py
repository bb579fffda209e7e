"""Decode attention at agents' context lengths: paged_decode_split (a CTA a KV head and its group, keys split over S
CTAs) against paged_decode_mma (tensor cores; rows sharing a prefix read it once), one layer, bf16 KV cache, on the
GPU, with each row's own blocks and with the rows' tables sharing all but their last block.

    python3 bench/decode_attention.py [--ctx 1024,4096,16384,32768] [--batch 1,16,64]

Shapes: the 8B (H 32, Hkv 8, D 128), SmolLM2 135M (H 9, Hkv 3, D 64), Gemma 3 270M (H 4, Hkv 1, D 256). Each cell:
µs a call inside a CUDA graph of 10 calls (as the server replays them; CUDA events, median of 10 replays), the K+V bytes it must read (B x ctx x Hkv x D x 2 x 2) over
that time, and the split kernel's S (`splits`: the server's rule; segments by `seg_keys_for`). Prints one table; checks each cell's outputs agree
(rel < 2e-2: mma rounds q and the probabilities to bf16) before timing it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

SHAPES = {"8b": (32, 8, 128), "smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}


def _time(fn, reps: int = 50) -> float:
    """µs: the median of `reps` runs after 5 warm-ups."""
    from imp.gpu.mixed import event_ns

    for _ in range(5):
        fn()
    return statistics.median(event_ns(fn, reps)) / 1e3


def _time_graph(fn, calls: int = 10) -> float:
    """µs a call as the server runs it: `calls` launches captured in one CUDA graph, replayed (no Python between
    kernels; an eager call's ~30-60 µs of host time would hide a short context's kernel)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return _time(g.replay, reps=10) / calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", default="1024,4096,16384,32768")
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--shapes", default="8b,smollm2,gemma3")
    ap.add_argument("--max-ctx", type=int, default=32768, help="the server's context: sets the segment length")
    ap.add_argument("--seg", type=int, default=0, help="keys a segment (default: the server's rule for --max-ctx)")
    a = ap.parse_args()
    from imp.kernels.cuda import paged_decode_mma as pm
    from imp.kernels.cuda import paged_decode_split as ps

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs; segments of {a.seg or ps.seg_keys_for(a.max_ctx)} keys "
          f"(contexts up to {a.max_ctx:,})")
    print("own: each row its own blocks; shared: the rows' tables hold the same blocks but for the last one (a "
          "shared prompt). GB/s: the K+V bytes the rows attend to over the time (shared: counted once a row)")
    print("| shape | batch | context | split µs (S) | GB/s | mma µs | GB/s | mma / split | shared: split µs | "
          "mma µs | mma / split |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    bs = 16
    for name in a.shapes.split(","):
        H, Hkv, D = SHAPES[name]
        mma = pm.supports(H, Hkv, D, torch.bfloat16)
        for B in (int(x) for x in a.batch.split(",")):
            for L in (int(x) for x in a.ctx.split(",")):
                nb = -(-L // bs)
                if B * nb * bs * Hkv * D * 2 * 2 > 24 << 30:
                    continue  # past 24 GiB of cache: not this bench's cell
                kc = torch.randn(B * nb + B + 1, bs, Hkv, D, device="cuda").to(torch.bfloat16)
                vc = torch.randn_like(kc)
                own = torch.arange(B * nb, dtype=torch.int32, device="cuda").view(B, nb).contiguous()
                shr = own[:1].repeat(B, 1)
                shr[:, -1] = B * nb + torch.arange(B, dtype=torch.int32, device="cuda")
                shr = shr.contiguous()
                ln = torch.full((B,), L, dtype=torch.int32, device="cuda")
                q = torch.randn(B, (H + 2 * Hkv) * D, device="cuda")
                seg = a.seg or ps.seg_keys_for(a.max_ctx)
                nseg = -(-a.max_ctx // seg)
                S = ps.splits(B, Hkv, sms, nseg)
                work = (torch.empty(B * H * nseg, 2, device="cuda"), torch.empty(B * H * nseg, D, device="cuda"),
                        torch.zeros(B * Hkv, dtype=torch.int32, device="cuda"))
                o1, o2 = torch.empty(B, H * D, device="cuda"), torch.empty(B, H * D, device="cuda")
                split = lambda bt: ps.paged_decode_split(q, kc, vc, bt, ln, H, a.max_ctx, out=o1, work=work,  # noqa: E731
                                                         seg_keys=seg)
                gb = B * L * Hkv * D * 2 * 2 / 1e9
                t1, t1s = _time_graph(lambda: split(own)), _time_graph(lambda: split(shr))
                cells = ["-"] * 5
                if mma:
                    wk = pm.Work(pm.Shape(H, Hkv, D, seg, nseg, pm.target_items(sms, Hkv)), B, "cuda")
                    run = lambda bt: pm.paged_decode_mma(q, kc, vc, bt, ln, wk, out=o2)  # noqa: E731
                    bad = []
                    for bt in (own, shr):
                        split(bt)
                        run(bt)
                        rel = float((o1 - o2).norm() / o1.norm())
                        if rel > 2e-2:
                            bad.append(f"rel {rel:.2e}")
                    if bad:
                        print(f"| {name} | {B} | {L} | outputs differ: {bad} |")
                        continue
                    t2, t2s = _time_graph(lambda: run(own)), _time_graph(lambda: run(shr))
                    cells = [f"{t2:,.1f}", f"{gb / t2 * 1e6:,.0f}", f"{t2 / t1:.2f}", f"{t2s:,.1f}", f"{t2s / t1s:.2f}"]
                print(f"| {name} | {B} | {L:,} | {t1:,.1f} ({S}) | {gb / t1 * 1e6:,.0f} | {cells[0]} | {cells[1]} | "
                      f"{cells[2]} | {t1s:,.1f} | {cells[3]} | {cells[4]} |")
                del kc, vc
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
