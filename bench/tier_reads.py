"""The disk tier's read path, part by part, on 1 to N threads, alone and beside busy Python threads: where a
restart's read-back of a long prompt goes (issue 35: 20k tokens of the 8B shape are 2.6 GB of files, read back in
0.62 s on 16 threads of the H200's host while one thread's dd reads the page cache at 6 GB/s).

    .venv/bin/python bench/tier_reads.py [--blocks 1250] [--block-mb 2] [--threads 1,4,16] [--busy 0,1] [--dir DIR]

Files written once by `KvTier.save` (then in the page cache), then for each count of busy threads (each a pure
Python loop, as the server's event loop is while a restart's request is admitted) and of read threads, GB/s over
all of them: Python's `readinto` file by file (into each thread's buffer: pinned host memory where a GPU is, as
the executor's staging ring), that and the tier's digest, `KvTier.load` a file a call, and `KvTier.fetch_many`
in chunks of --chunk files (the executor's read threads' path: a chunk read and summed in one call without the
GIL, imp.actors.kvtier_io). A thread that lets go of the GIL for a read waits up to the switch interval (5 ms)
to take it back from a busy one: the busy rows are the ones a restart meets.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
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


def spin(stop: threading.Event) -> None:
    """A thread that runs Python until told to stop (the event loop's thread during a restart's admission)."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1250)
    ap.add_argument("--block-mb", type=float, default=2.0)
    ap.add_argument("--threads", default="1,4,16")
    ap.add_argument("--busy", default="0,1", help="busy Python threads beside the reads, a row each")
    ap.add_argument("--chunk", type=int, default=32, help="files a fetch_many call (the GPU's chunk of blocks)")
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
        print("| busy threads | read threads | readinto GB/s | + digest | KvTier.load | fetch_many chunks |")
        print("|---|---|---|---|---|---|")
        for busy, n in [(int(b), int(x)) for b in a.busy.split(",") for x in a.threads.split(",")]:
            bufs = buffers(n, max(size + 4096, a.chunk * size))
            slot = {}

            def buf() -> np.ndarray:
                return bufs[slot.setdefault(threading.get_ident(), len(slot) % n)]

            def read(i: int) -> memoryview:
                b = memoryview(buf())
                with open(paths[i], "rb", buffering=0) as f:
                    f.seek(_HEAD.size)
                    f.readinto(b[:size])
                return b[:size]

            def chunk(i: int) -> list[str]:
                return t.fetch_many(keys[i:i + a.chunk], size, buf())

            parts = {"read": (read, 1), "digest": (lambda i: _digest(read(i)), 1),
                     "load": (lambda i: t.load(keys[i], size, into=buf()[:size]), 1), "chunks": (chunk, a.chunk)}
            row = []
            stop = threading.Event()
            spinners = [threading.Thread(target=spin, args=(stop,), daemon=True) for _ in range(busy)]
            for s in spinners:
                s.start()
            with ThreadPoolExecutor(n) as ex:
                for name, (fn, step) in parts.items():
                    best = 0.0
                    for _ in range(2):
                        t0 = time.perf_counter()
                        list(ex.map(fn, range(0, a.blocks, step)))
                        best = max(best, total / (time.perf_counter() - t0) / 1e9)
                    row.append(best)
            stop.set()
            for s in spinners:
                s.join()
            print(f"| {busy} | {n} | " + " | ".join(f"{x:.2f}" for x in row) + " |", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
