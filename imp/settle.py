"""What a booted process hands back before it serves (issue 15's memory goal).

Three things the boot leaves resident that serving never needs again:
- garbage and the collector's walk over survivors: collect, then `gc.freeze` what is left
  (the vocabulary, templates, grammars and modules are never garbage, and a full collection
  walking them cost a request hundreds of milliseconds at random);
- heap pages the boot freed (the tokenizer, grammar vocabulary and warm-up peak at ~100 MB
  of short-lived objects for Gemma 3): glibc's `malloc_trim`, elsewhere a no-op;
- LLVM's code. Loading llvmlite runs LLVM's static constructors, which are spread over its
  179 MB library, and the kernel's fault-around maps their 64 KB neighbourhoods: ~105 MB of
  file-backed pages resident from `import numba` on. LLVM runs only while Numba compiles or
  loads a cached kernel, all of it at boot (the warm-up prefill). Those pages are clean
  copies of the file, so `madvise(MADV_DONTNEED)` drops them from this process and any later
  use (a kernel compiled for a signature the warm-up did not meet) faults them back in from
  the page cache: slower once, never wrong. Only mappings with no anonymous (copy-on-write)
  page and no write permission are touched: dropping those is exact by construction
  (madvise(2): private file mappings are repopulated from the file).
"""

from __future__ import annotations

import ctypes
import gc
import re
from typing import NamedTuple

MADV_DONTNEED = 4
COMPILER_LIBRARIES = ("libllvmlite.so",)  # what only compiling (boot) executes

_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


class Mapping(NamedTuple):
    start: int
    end: int
    perms: str
    path: str
    rss_kb: int
    anonymous_kb: int


def parse_smaps(text: str) -> list[Mapping]:
    """/proc/PID/smaps as (start, end, perms, path, Rss, Anonymous) per mapping."""
    out: list[Mapping] = []
    cur: list | None = None

    def close() -> None:
        if cur is not None:
            out.append(Mapping(*cur))

    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            close()
            cur = [int(m[1], 16), int(m[2], 16), m[3], m[4], 0, 0]
        elif cur is not None:
            key, _, value = line.partition(":")
            if key == "Rss":
                cur[4] = int(value.split()[0])
            elif key == "Anonymous":
                cur[5] = int(value.split()[0])
    close()
    return out


def droppable(mappings: list[Mapping], libraries=COMPILER_LIBRARIES) -> list[Mapping]:
    """The mappings of `libraries` whose resident pages are all clean file pages: never
    writable, no anonymous page (relocated data, copied on write, stays)."""
    return [m for m in mappings
            if m.path.rsplit("/", 1)[-1] in libraries and "w" not in m.perms and m.anonymous_kb == 0
            and m.rss_kb > 0]


def release_compiler_pages(libraries=COMPILER_LIBRARIES) -> int:
    """Drop the compiler's clean resident pages from this process; the kB released (0 where
    /proc or madvise is not there)."""
    try:
        with open("/proc/self/smaps") as f:
            maps = parse_smaps(f.read())
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    freed = 0
    for m in droppable(maps, libraries):
        if madvise(m.start, m.end - m.start, MADV_DONTNEED) == 0:
            freed += m.rss_kb
    return freed


def settle_after_boot() -> int:
    """Once everything is loaded, before serving: collect and freeze, trim the heap, drop
    the compiler's pages. Returns the kB of compiler pages released."""
    gc.collect()
    gc.freeze()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return release_compiler_pages()
