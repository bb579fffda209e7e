"""Apply grammar bitmasks to logits before sampling: disallowed -> -inf, in place.

After the mask a disallowed token has logit -inf, so softmax gives it
probability exactly 0 and it shows so in logprobs; the sampler needs no
other change. Rows of a batch without a constraint are left alone: pass
`rows` (the logits row of each bitmask row) and a bitmask with one row per
constrained sequence only.

CPU: numpy unpacks the bits (llguidance's little-endian words, so bit j of
byte b is token 8b + j) and writes -inf into the masked entries through an
int32 view of the logits (branch-free; see _apply_cpu), on numpy arrays (or CPU torch
tensors, read in place). CUDA: the kernel in imp/kernels/cuda/token_mask.py, on torch's current
stream (torch is imported only there: the CPU server runs without it).
"""

from __future__ import annotations

import sys
from typing import Sequence

import numpy as np

from imp.constrain.matcher import mask_words

_NEG_INF_BITS = np.float32(-np.inf).view(np.int32)  # 0xff800000


def alloc_bitmask(n_rows: int, vocab_size: int) -> np.ndarray:
    """A [n_rows, ceil(V/32)] int32 host bitmask (numpy), all tokens allowed."""
    return np.full((n_rows, mask_words(vocab_size)), -1, dtype=np.int32)


def apply_mask(logits, bitmask, rows: Sequence[int] | None = None) -> None:
    """logits [R, V] fp32 (CPU or CUDA), bitmask [k, >= ceil(V/32)] int32; rows: the logits
    row of each bitmask row (k entries, < 0 skips one), or None for k == R.

    A row index >= R is an error on CPU; the GPU kernel cannot raise and skips it.

    On CUDA the bitmask (and rows) should already be device tensors in fixed buffers (that
    path is graph-capturable: copy the host bitmask in with `copy_(..., non_blocking=True)`
    from pinned memory, and do not refill the host buffer until that copy has run). A CPU
    bitmask or a list of rows is copied over here for convenience, synchronously."""
    if getattr(logits, "is_cuda", False):
        import torch

        from imp.kernels.cuda import token_mask

        dev = logits.device
        if isinstance(bitmask, np.ndarray):
            bitmask = torch.from_numpy(bitmask)
        bm = bitmask if bitmask.device == dev else bitmask.to(dev)
        if rows is not None and not (isinstance(rows, torch.Tensor) and rows.device == dev):
            rows = torch.as_tensor(rows, dtype=torch.int32).to(dev)
        token_mask.apply_token_mask(logits, bm, rows)
        return
    _apply_cpu(logits, bitmask, rows)


def _apply_cpu(logits, bitmask, rows) -> None:
    if getattr(bitmask, "is_cuda", False):
        raise ValueError("bitmask must be in host memory for CPU logits")
    logits, bitmask = np.asarray(logits), np.asarray(bitmask)  # CPU torch tensors: their memory, in place
    if logits.dtype != np.float32 or logits.ndim != 2:
        raise ValueError(f"logits must be [R, V] float32, got {logits.dtype} rank {logits.ndim}")
    if bitmask.dtype != np.int32 or bitmask.ndim != 2:
        raise ValueError("bitmask must be a [k, words] int32 array for CPU logits")
    R, V = logits.shape
    k = bitmask.shape[0]
    if bitmask.shape[1] * 32 < V:
        raise ValueError(f"bitmask has {bitmask.shape[1]} words per row, V={V} needs {mask_words(V)}")
    if rows is None and k != R:
        raise ValueError(f"bitmask has {k} rows, logits {R} (pass rows=)")
    targets = list(range(k)) if rows is None else [int(r) for r in rows]
    if len(targets) != k:
        raise ValueError(f"rows has {len(targets)} entries for {k} bitmask rows")
    if any(r >= R for r in targets):
        raise ValueError(f"rows {targets} outside the {R} logits rows")
    if k == 0:
        return
    words = np.ascontiguousarray(bitmask)
    # unpackbits reads bytes; llguidance's words are little-endian u32, so on a little-endian
    # host byte order == token order. (Every platform torch ships for is little-endian.)
    assert sys.byteorder == "little"
    rows_np = logits  # shares memory with the caller's logits
    for i, r in enumerate(targets):
        if r < 0:
            continue
        # Branch-free and exact, one row at a time (a 49k row stays in L2): on the float's
        # bits, row = (row & keep) | (-inf & ~keep), keep = all-ones where allowed. A masked_fill
        # on a mixed mask (letters allowed, the rest not) mispredicts and runs ~5x slower.
        allowed = np.unpackbits(words[i].view(np.uint8), bitorder="little")[:V]  # 0/1 per token
        masked = allowed.astype(np.int32)
        masked -= 1  # 0 where allowed, -1 (all ones) where masked
        bits = rows_np[r].view(np.int32)
        bits &= ~masked
        masked &= _NEG_INF_BITS
        bits |= masked
