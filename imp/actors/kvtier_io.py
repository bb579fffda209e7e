"""The disk tier's files read a chunk at a time, and its digest, without the GIL.

Why: a restart reads a long prompt's KV back as ~1,250 files of 2 MB on up to 16 threads while the event
loop's thread runs Python (the request's admission, the allocator, every KvLoad / KvLoaded message). Each
`open`, `read`, `readinto`, `close` and numpy reduction lets go of the GIL, and taking it back from a thread
that is running Python waits for that thread's switch interval (5 ms). Read file by file in Python, a
load took ~4 such waits: 0.11 GB/s beside one busy Python thread against 4 GB/s alone on this box's core
(bench/tier_reads.py --busy), and on the H200's host 2.6 GB came back in 0.62 s on 16 threads, 5.6 ms a block.
Here a whole chunk of files is opened, read and digested inside one compiled call that holds no GIL: one
wait a chunk, not several a file.

`read_files` calls libc's open / pread / close by name (LLVM declarations the JIT links against the
process's libc: unlike a ctypes pointer this stays in Numba's disk cache). Everything else about a file
(its header's fields, what a bad one means) is imp.actors.kvtier's; this only moves bytes and sums them.
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_I8P = ir.IntType(8).as_pointer()
FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
NO_FILE, SHORT_HEAD, LONGER, FAILED = -1, -2, -3, -4  # read_files' codes besides a payload's byte count
PAGE_WORDS = 512  # 4 KB pages of 64-bit words: the digest's second sum weights each page's sum by its place


@intrinsic
def _open(typingctx, addr, flags):
    sig = types.int32(types.intp, types.int32)

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), [_I8P, ir.IntType(32)], var_arg=True), "open")
        return builder.call(fn, [builder.inttoptr(args[0], _I8P), args[1]])
    return sig, codegen


@intrinsic
def _pread(typingctx, fd, addr, n, off):
    sig = types.int64(types.int32, types.intp, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(64), [ir.IntType(32), _I8P, ir.IntType(64), ir.IntType(64)]),
            "pread")
        return builder.call(fn, [args[0], builder.inttoptr(args[1], _I8P), args[2], args[3]])
    return sig, codegen


@intrinsic
def _close(typingctx, fd):
    sig = types.int32(types.int32)

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [ir.IntType(32)]),
                                            "close")
        return builder.call(fn, [args[0]])
    return sig, codegen


@njit(nogil=True, cache=True)
def _sums(b):
    """(sum of b's 64-bit words, sum of its 4 KB pages' sums times 1, 3, 5, ...), mod 2**64; b: uint8, its
    length a multiple of 8 (the caller sums the bytes past the last word otherwise)."""
    w = b.view(np.uint64)
    n = w.size
    p = n // PAGE_WORDS
    total = np.uint64(0)
    placed = np.uint64(0)
    for j in range(p):
        s = np.uint64(0)
        for k in range(j * PAGE_WORDS, (j + 1) * PAGE_WORDS):
            s += w[k]
        total += s
        placed += s * np.uint64(2 * j + 1)
    for k in range(p * PAGE_WORDS, n):
        total += w[k]
    return total, placed


@njit(nogil=True, cache=True)
def _read_files(names, starts, slots, flags, heads, out, size, extra, got, sums):
    hsize = heads.shape[1]
    words = size // 8 * 8
    for i in range(starts.size):
        fd = _open(names[starts[i]:].ctypes.data, np.int32(flags))
        if fd < 0:
            got[i] = NO_FILE
            continue
        h = _pread(fd, heads[i].ctypes.data, np.int64(hsize), np.int64(0))
        if h < hsize:
            _close(fd)
            got[i] = FAILED if h < 0 else SHORT_HEAD
            continue
        dst = out[slots[i] * size:(slots[i] + 1) * size]
        n = 0
        failed = False
        while n < size and not failed:  # a regular file's pread returns all it asked for but at its end; loop
            r = _pread(fd, dst[n:].ctypes.data, np.int64(size - n), np.int64(hsize + n))
            if r <= 0:
                failed = r < 0
                break
            n += r
        more = _pread(fd, extra.ctypes.data, np.int64(1), np.int64(hsize + size)) if n == size else 0
        _close(fd)
        if failed or more < 0:  # an I/O error, not a bad file: the block is computed, the file left alone
            got[i] = FAILED
            continue
        if more > 0:
            got[i] = LONGER
            continue
        got[i] = n
        if n == size:
            sums[i, 0], sums[i, 1] = _sums(dst[:words])


def read_files(paths: list[bytes], head_size: int, out: np.ndarray, size: int, slots=None):
    """Each path's first head_size bytes and then up to `size` more into its slot of `out` (uint8, C-contiguous,
    slot j at j x size; path i's slot is slots[i], else i), in one call without the GIL. (heads uint8
    [n, head_size]; got int64 [n]: the payload bytes read, or NO_FILE / SHORT_HEAD / LONGER (the file holds more
    than size after its head) / FAILED (a read error: a directory, EIO); sums uint64 [n, 2]: `_sums` of each
    whole payload's words, where got == size.)"""
    n = len(paths)
    names = np.frombuffer(b"\0".join(paths) + b"\0", np.uint8)
    starts = np.zeros(n, np.int64)
    if n > 1:
        np.cumsum([len(p) + 1 for p in paths[:-1]], out=starts[1:])
    heads = np.empty((n, head_size), np.uint8)
    got = np.empty(n, np.int64)
    sums = np.zeros((n, 2), np.uint64)
    slots = np.arange(n, dtype=np.int64) if slots is None else np.asarray(slots, np.int64)
    if n and (slots.min() < 0 or (int(slots.max()) + 1) * size > out.size):
        raise ValueError("a slot past the buffer")
    _read_files(names, starts, slots, FLAGS, heads, out, size, np.empty(1, np.uint8), got, sums)
    return heads, got, sums


def sums(payload) -> tuple[int, int]:
    """`_sums` of a payload's whole words (bytes, memoryview or array), without the GIL."""
    b = np.frombuffer(memoryview(payload).cast("B"), np.uint8)
    t, p = _sums(b[:len(b) // 8 * 8])
    return int(t), int(p)


def warm() -> None:
    """Compile (or load from Numba's disk cache) every variant the tier calls: at boot, inside the precompile
    window on a CPU, so that no restart's first load and no save waits for a compile."""
    read_files([b"/nonexistent/imp-tier-warm"], 8, np.empty(8, np.uint8), 8)
    sums(bytes(8))
    sums(bytearray(8))
