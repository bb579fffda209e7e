"""The GPU sampler's penalty bookkeeping on the host, a step at 16 / 64 / 256 penalized rows: the segment path
(`imp.sampling.counts.HistoryCounts` + `penalty_segments`, the meta copied up) against the device counts
(`imp.sampling.devcounts.DeviceCounts`: slots, parameters, the ids added after the draw). The kernels are the
device's and are stubbed here: this times what the executor's step thread does with the GIL held. CPU tensors.

    .venv/bin/python bench/penalty_cost.py
"""

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from imp.kernels.cuda import sampling as k  # noqa: E402
from imp.messages import SamplingParams, SeqWork  # noqa: E402
from imp.sampling import gpu as G  # noqa: E402
from imp.sampling.counts import HistoryCounts  # noqa: E402
from imp.sampling.devcounts import DeviceCounts  # noqa: E402

k.penalize_dense = lambda *a: None  # the device's work: not timed here
V = 2048
p = SamplingParams(max_tokens=999, repetition_penalty=1.05)
print("| penalized rows | segments: host ms a step | device counts: host ms a step |")
print("|---|---|---|")
for R in (16, 64, 256):
    rng = np.random.default_rng(0)
    out = []
    for name in ("segments", "table"):
        c = HistoryCounts() if name == "segments" else DeviceCounts(V, "cpu")
        gen = {f"s{i}": list(rng.integers(0, V, 234)) for i in range(R)}
        ts = []
        for step in range(80):
            works = [SeqWork(seq_id=s, token_ids=(0,), start_pos=5, block_table=(0,), sample=True, params=p,
                             history=tuple(h), gen_index=len(h)) for s, h in gen.items()]
            ids = torch.from_numpy(rng.integers(0, V, R))
            t = time.perf_counter()
            if name == "segments":
                meta, S = G.penalty_segments(works, None, V, c)
                G.to_device(torch.from_numpy(meta), torch.int32, "cpu")
            else:
                c.drop_taken()
                c.penalize(torch.zeros(R, V), works, list(range(R)), None)
                c.record(ids)
            ts.append(time.perf_counter() - t)
            for (s, h), i in zip(gen.items(), ids.tolist()):
                h.append(i)
        out.append(1e3 * np.median(ts[10:]))
    print(f"| {R} | {out[0]:.2f} | {out[1]:.2f} |")
