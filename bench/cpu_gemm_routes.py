"""The CPU GEMM's two routes for a batch of tokens, one table: the row loops (each weight block
decoded once per tile of tokens) against the predecoded rows (imp/kernels/cpu/predecoded.py:
each row decoded once into a scratch, then tiles of 4 / 8 tokens), GMAC/s, on random matrices.

    .venv/bin/python bench/cpu_gemm_routes.py --types Q5_0,Q4_K,Q6_K,Q8_0 --rows 2048 --cols 1024 \
        --tokens 8,16,512 [--threads 1] [--tier avx2]

--tier avx2 compiles for Haswell with its own features (NUMBA_CPU_NAME=haswell,
NUMBA_CPU_FEATURES=""), the AVX2 tier on any x86 box. Each route runs in its own process with
its own Numba cache: the row-loop route sets gemm_int8_act._PRE_MIN (a global array Numba reads
as a constant when it compiles) past any batch before anything compiles. Both routes give the
same bits (tests/test_cpu_kernels.py); the child prints a checksum of the outputs to show it. The
routes alternate for --rounds rounds and each cell keeps its best (a VM's speed drifts: one round
here had the same code run at 30 and 14 GMAC/s).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys, time
import numba, numpy as np
sys.path.insert(0, {root!r})
from gguf import GGMLQuantizationType as T
from imp.kernels.cpu import gemm_int8_act as g
from imp.kernels.cpu.kinds import Kinds
if {rows_route!r}:
    g._PRE_MIN[:] = 1 << 40
numba.set_num_threads({threads})
rng = np.random.default_rng(0)
res = {{}}
for name in {types!r}:
    qt = int(T[name])
    n_, size = g.BLOCKS[qt]
    R, K = {rows}, {cols}
    w = rng.integers(0, 256, (R, g.row_bytes(qt, K)), dtype=np.uint8)
    blocks = w.reshape(R, K // n_, size)
    d = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # finite scales: d (and dmin) = 0.01
    if qt == int(T.Q6_K):
        blocks[:, :, 208:210] = d
    else:
        blocks[:, :, 0:2] = d
        if qt in (int(T.Q4_1), int(T.Q5_1), int(T.Q4_K), int(T.Q5_K)):
            blocks[:, :, 2:4] = d
    kinds = Kinds((qt,))
    for N in {tokens!r}:
        x = rng.standard_normal((N, K)).astype(np.float32)
        xq, xd, xs = g.quantize(x)
        xu = np.empty_like(xq)
        g.widen_rows(xq, xu)
        out = np.empty((N, R), np.float32)
        wf = w.reshape(-1)
        g.gemm_into(wf, 0, kinds, qt, w.shape[1], R, K, xq, xu, xd, xs, out, 0)
        best = 1e9
        for _ in range(7):
            t0 = time.perf_counter()
            g.gemm_into(wf, 0, kinds, qt, w.shape[1], R, K, xq, xu, xd, xs, out, 0)
            best = min(best, time.perf_counter() - t0)
        res[f"{{name}} {{N}}"] = (R * K * N / best / 1e9, float(np.abs(out).sum()))
print(json.dumps(res))
"""


def run_route(rows_route: bool, a, cache: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    if a.tier == "avx2":
        env.update(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="")
    code = _CHILD.format(root=str(ROOT), rows_route=rows_route, threads=a.threads, types=a.types.split(","),
                         rows=a.rows, cols=a.cols, tokens=[int(t) for t in a.tokens.split(",")])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode:
        sys.exit(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="Q5_0,Q4_K,Q6_K,Q8_0,Q4_1")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--tokens", default="8,16,512")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tier", choices=("native", "avx2"), default="native")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    rows: dict = {}
    pre: dict = {}
    with tempfile.TemporaryDirectory() as c1, tempfile.TemporaryDirectory() as c2:
        for _ in range(a.rounds):  # alternated; each cell's best round (this VM's speed drifts by 20 % and more)
            for route, cache, best in ((True, c1, rows), (False, c2, pre)):
                for key, (gm, chk) in run_route(route, a, cache).items():
                    best[key] = max(best.get(key, (0.0, chk)), (gm, chk))
    flags = subprocess.run("grep -m1 '^flags' /proc/cpuinfo", shell=True, capture_output=True, text=True).stdout
    want = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_int8")
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}  tier {a.tier}, {a.threads} thread(s), {a.rows} x {a.cols}, "
          f"flags: {' '.join(f for f in want if f in flags.split())}\n")
    print("| type | tokens | row loops GMAC/s | predecoded GMAC/s | predecoded / row loops | same outputs |")
    print("|---|---|---|---|---|---|")
    for key, (g_rows, s_rows) in rows.items():
        g_pre, s_pre = pre[key]
        name, n = key.split()
        print(f"| {name} | {n} | {g_rows:.1f} | {g_pre:.1f} | {g_pre / g_rows:.2f} | {'yes' if s_rows == s_pre else 'NO'} |")


if __name__ == "__main__":
    main()
