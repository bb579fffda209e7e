"""The disk tier's read path, part by part, on 1 to N threads: where a restart's read-back of a long prompt goes
(issue 35: 20k tokens of the 8B shape are 2.6 GB of files, read back in 0.62 s on 16 threads of the H200's host
while one thread's dd reads the page cache at 6 GB/s).

    .venv/bin/python bench/tier_reads.py [--blocks 1250] [--block-mb 2] [--threads 1,4,16] [--dir DIR]

Files written once by `KvTier.save` (then in the page cache), then for each thread count, GB/s over all of them:
`readinto` alone (into each thread's buffer: pinned host memory where a GPU is, as the executor's staging
ring), the read and CRC-32 (the format before), the read and the tier's digest, and `KvTier.load` whole.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from imp.actors.kvtier import _HEAD, KvTier, _digest  # noqa: E402


def buffers(n: int, size: int) -> list[np.ndarray]:
    """A buffer a thread: pinned where torch sees a GPU (the executor reads into pinned staging), else numpy."""
    try:
        import torch
        if torch.cuda.is_available():
            return [torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy() for _ in range(n)]
    except ImportError:
        pass
    return [np.empty(size, np.uint8) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1250)
    ap.add_argument("--block-mb", type=float, default=2.0)
    ap.add_argument("--threads", default="1,4,16")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    size = int(a.block_mb * 2**20) // 8 * 8
    root = Path(tempfile.mkdtemp(dir=a.dir))
    try:
        t = KvTier(root, "f" * 64, "bench", 0)
        rng = np.random.default_rng(0)
        keys = [rng.bytes(32) for _ in range(a.blocks)]
        data = rng.integers(0, 256, size, dtype=np.uint8)
        t0 = time.perf_counter()
        for k in keys:
            t.save(k, data)
        print(f"wrote {a.blocks} files of {size / 1e6:.1f} MB in {time.perf_counter() - t0:.2f} s; "
              f"{os.cpu_count()} CPUs")
        paths = [t._path(k) for k in keys]
        total = a.blocks * size
        print("| threads | readinto GB/s | + CRC-32 | + digest | KvTier.load |")
        print("|---|---|---|---|---|")
        for n in [int(x) for x in a.threads.split(",")]:
            bufs = buffers(n, size + 4096)
            slot = {}

            def buf() -> np.ndarray:
                import threading
                return bufs[slot.setdefault(threading.get_ident(), len(slot) % n)]

            def read(i: int) -> memoryview:
                b = memoryview(buf())
                with open(paths[i], "rb", buffering=0) as f:
                    f.seek(_HEAD.size)
                    f.readinto(b[:size])
                return b[:size]

            parts = {"read": read, "crc": lambda i: zlib.crc32(read(i)), "digest": lambda i: _digest(read(i)),
                     "load": lambda i: t.load(keys[i], size, into=buf()[:size])}
            row = []
            with ThreadPoolExecutor(n) as ex:
                for name, fn in parts.items():
                    best = 0.0
                    for _ in range(2):
                        t0 = time.perf_counter()
                        list(ex.map(fn, range(a.blocks)))
                        best = max(best, total / (time.perf_counter() - t0) / 1e9)
                    row.append(best)
            print(f"| {n} | " + " | ".join(f"{x:.2f}" for x in row) + " |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
