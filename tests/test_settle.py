"""imp/settle.py: what a booted process hands back (issue 15's memory goal)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from imp.settle import Mapping, droppable, parse_smaps

ROOT = Path(__file__).resolve().parent.parent

SMAPS = """\
7f00a0000000-7f00a0200000 r--p 00000000 08:01 42   /venv/llvmlite/binding/libllvmlite.so
Size:               2048 kB
Rss:                1900 kB
Anonymous:             0 kB
7f00a0200000-7f00a4000000 r-xp 00200000 08:01 42   /venv/llvmlite/binding/libllvmlite.so
Size:              63488 kB
Rss:               61000 kB
Anonymous:             0 kB
7f00a4000000-7f00a4400000 r--p 04000000 08:01 42   /venv/llvmlite/binding/libllvmlite.so
Size:               4096 kB
Rss:                4096 kB
Anonymous:          4000 kB
7f00a4400000-7f00a4410000 rw-p 04400000 08:01 42   /venv/llvmlite/binding/libllvmlite.so
Size:                 64 kB
Rss:                  64 kB
Anonymous:             0 kB
7f00a4410000-7f00a4420000 r-xp 00000000 08:01 43   /venv/numpy/_core/_multiarray_umath.so
Size:                 64 kB
Rss:                  64 kB
Anonymous:             0 kB
7f00a4420000-7f00a4430000 r-xp 00000000 00:00 0
Size:                 64 kB
Rss:                  64 kB
Anonymous:            64 kB
7f00a4430000-7f00a4440000 r-xp 00000000 08:01 44   /venv/x/libllvmlite.so.bak
Size:                 64 kB
Rss:                  64 kB
Anonymous:             0 kB
"""


def test_parse_smaps_reads_every_mapping():
    maps = parse_smaps(SMAPS)
    assert len(maps) == 7
    assert maps[1] == Mapping(0x7F00A0200000, 0x7F00A4000000, "r-xp", "/venv/llvmlite/binding/libllvmlite.so",
                              61000, 0)
    assert maps[5].path == "" and maps[5].anonymous_kb == 64


def test_only_clean_read_only_compiler_pages_are_droppable():
    picked = droppable(parse_smaps(SMAPS))
    # the code and the read-only data; never the relocated (copied-on-write) data, the
    # writable segment, another library, anonymous memory or a name that only contains it
    assert [(m.perms, m.rss_kb) for m in picked] == [("r--p", 1900), ("r-xp", 61000)]


def test_release_drops_llvm_pages_and_kernels_still_run(tmp_path):
    """In a fresh process: a cached Numba kernel runs, the compiler's pages go, the kernel
    still runs and a new compile (which needs LLVM again) still works and is right."""
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        from numba import njit, prange
        from imp.settle import parse_smaps, release_compiler_pages

        def llvm_kb():
            with open("/proc/self/smaps") as f:
                return sum(m.rss_kb for m in parse_smaps(f.read()) if m.path.endswith("libllvmlite.so"))

        @njit(parallel=True)
        def total(a):
            s = 0.0
            for i in prange(a.shape[0]):
                s += a[i]
            return s

        a = np.arange(1000, dtype=np.float64)
        assert total(a) == a.sum()
        before = llvm_kb()
        freed = release_compiler_pages()
        after = llvm_kb()
        assert total(a) == a.sum()
        b = np.arange(10, dtype=np.int32)
        assert total(b) == 45  # a new signature: LLVM compiles again from the dropped pages
        print(before, freed, after)
    """))
    out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "NUMBA_CACHE_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    before, freed, after = map(int, out.stdout.split())
    assert before > 20_000  # LLVM's pages are resident once numba has run (~105 MB here)
    assert freed > before // 2 and after < before - freed // 2
