"""An eager GPU step that admits K new shares, each a short prompt chunk after a cached prefix,
beside D decode rows (a burst of chat requests on a shared system prompt), on the real runner:
its host launch time, its total time, and a cProfile of the launches. The 64-stream stalls of
issue 14 were such steps (bench/step_timeline.py --gaps on a serving run's event log).

    python3 bench/eager_step.py --model /tmp/smol.gguf --new 12 --rows 2 --decode 37 --prefix 352
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import torch

    from imp.gpu.runner import GpuModelRunner
    from imp.messages import SamplingParams, SeqWork

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--new", type=int, default=12)
    ap.add_argument("--rows", type=int, default=2, help="prompt rows each new share brings")
    ap.add_argument("--decode", type=int, default=37)
    ap.add_argument("--prefix", type=int, default=352, help="cached prefix tokens (a multiple of 16)")
    ap.add_argument("--activations", default="int8", help="int8 | fp32 | invariant (int8, --batch-invariant)")
    ap.add_argument("--sdpa", action="store_true", help="prompt rows through torch SDPA per chunk (the old path)")
    a = ap.parse_args()
    if a.sdpa:
        import imp.gpu.forward

        imp.gpu.forward.PAGED_PREFILL = False
    r = GpuModelRunner.load(a.model, kv_tokens=65536, device="cuda:0", int8_act=a.activations != "fp32",
                                batch_invariant=a.activations == "invariant")
    bs, p = r.block_size, SamplingParams(max_tokens=64, temperature=0.0, repetition_penalty=1.0)
    nbp = a.prefix // bs
    pre = tuple(range(nbp))
    r.step([SeqWork("prefix", tuple(100 + i for i in range(a.prefix)), 0, pre, False, p)])
    own = nbp
    news = []
    for k in range(a.new):
        news.append(SeqWork(f"n{k}", tuple(200 + j for j in range(a.rows)), a.prefix, pre + (own,), True, p))
        own += 1
    decs = []
    for j in range(a.decode):
        decs.append(SeqWork(f"d{j}", (300 + j,), a.prefix + 4, pre + (own,), True, p))
        own += 1

    def timed(seqs, n=8):
        launch, total = [], []
        for _ in range(n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            h = r.launch(seqs)
            t1 = time.perf_counter()
            r.collect(h)
            torch.cuda.synchronize()
            launch.append(t1 - t0)
            total.append(time.perf_counter() - t0)
        return statistics.median(launch) * 1e3, statistics.median(total) * 1e3

    print(f"| step | shares | host launch ms | total ms |\n|---|---|---|---|")
    for name, seqs in (("decode only (graph)", decs), ("new shares only", news), ("mixed", news + decs)):
        lm, tm = timed(seqs)
        print(f"| {name} | {len(seqs)} | {lm:.2f} | {tm:.2f} |")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        r.collect(r.launch(news + decs))
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
