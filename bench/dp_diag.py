"""Diagnose a runner on a second GPU: load on cuda:1 (eager, untuned, then tuned + graphs) and step once.

    CUDA_LAUNCH_BLOCKING=1 python3 bench/dp_diag.py MODEL
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from imp.messages import SamplingParams, SeqWork  # noqa: E402
from imp.gpu.runner import GpuModelRunner  # noqa: E402

path = sys.argv[1]
work = [SeqWork(seq_id="a", token_ids=[1, 2, 3, 4, 5], start_pos=0, block_table=[0], sample=True,
                params=SamplingParams(max_tokens=4))]
for kw in (dict(graphs=False, tune=False), dict(graphs=False, tune=True), dict(graphs=True, tune=True)):
    for dev in ("cuda:0", "cuda:1"):
        try:
            r = GpuModelRunner.load(path, device=dev, kv_tokens=4096, max_graph_batch=4, **kw)
            t = r.step(work)
            torch.cuda.synchronize(dev)
            print("OK", dev, kw, r.use_numba_sampling, r.notes, t[0].token_id, flush=True)
        except Exception:  # noqa: BLE001
            print("FAIL", dev, kw, flush=True)
            traceback.print_exc(limit=12)
            sys.exit(1)
