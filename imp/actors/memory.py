"""What suspend frees, measured: the process's resident bytes and the card's free bytes.

The executor (a shell) reads these around an Unload or a reload and reports them
in `MemoryState`; `release()` hands freed memory back (Python's collector, the
CUDA caching allocators of torch and CuPy, glibc's heap via malloc_trim).
"""

from __future__ import annotations

import ctypes
import gc
import os

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def device_free_bytes(device: str | None) -> int:
    if not device or not str(device).startswith("cuda"):
        return 0
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def release(device: str | None) -> None:
    gc.collect()
    if device and str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(torch.device(device))
        torch.cuda.empty_cache()
        try:
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
            cupy.get_default_pinned_memory_pool().free_all_blocks()
        except ImportError:  # pragma: no cover - the GPU build has CuPy
            pass
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass
