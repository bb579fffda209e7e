"""What the CPU forward needs around its kernels, in numpy only: the paged KV pool, a step's
row plan, RoPE tables, and the per-layer facts two forwards share.

Why a module without torch: the default CPU server (`make serve`) runs the fused Numba forward
(fused.py), which needs none of torch's ops, and `import torch` alone holds ~185 MB of RSS (issue
15 §4). So this file, fused.py, the CPU sampler and the constraint masks keep torch out; the torch
reference forwards (llama.py and the rest) build on these same facts and import torch themselves.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np

# Gemma 3's layer layout (llama.cpp: hparams.set_swa_pattern(6), rope_freq_base_train_swa)
SWA_PERIOD = 6
LOCAL_THETA = 10000.0


def sliding_layers(cfg) -> list[bool]:
    """Which of a Gemma 3's layers attend through the sliding window (the file's pattern, else
    five sliding then one global)."""
    pattern = cfg.extras.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        assert len(pattern) == cfg.n_layers, pattern
        return [bool(p) for p in pattern]
    period = int(pattern) if pattern else SWA_PERIOD
    return [i % period < period - 1 for i in range(cfg.n_layers)]


def lazy_zeros(shape, dtype) -> np.ndarray:
    """Zeros whose pages the OS commits only when first written.

    A zeroed allocation (torch.zeros) memsets the whole pool at start-up (2.6 s and 720 MB of
    RSS for SmolLM2's default 16k-token KV pool); an anonymous map starts on the shared zero
    page. Not np.zeros either: numpy madvises large arrays for transparent huge pages, so the
    first write into a layer's slice committed a whole 2 MB page (SmolLM2: 236 MB of RSS for
    11 MB of K/V used); here pages are 4 KB and MADV_NOHUGEPAGE keeps it so where THP is
    "always". Zeros, not garbage: unwritten slots are gathered (then masked), and 0 * NaN would
    still poison an attention output."""
    dtype = np.dtype(dtype)
    mm = mmap.mmap(-1, max(1, math.prod(shape) * dtype.itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        mm.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mm, dtype=np.uint8)[: math.prod(shape) * dtype.itemsize].view(dtype).reshape(shape)


def default_num_blocks(kv_tokens: int, block_size: int) -> int:
    return math.ceil(kv_tokens / block_size)


def dtype_name(dtype) -> str:
    """'float16' / 'float32' / ... for a numpy or torch dtype (or its name), without torch."""
    return str(dtype).removeprefix("torch.")


@dataclass
class HostKV:
    """The fused forward's paged pool: k, v [n_layers, num_blocks, block_size, Hkv, D] as numpy.
    fp16 is held as its bits (uint16: Numba has no float16 arrays), fp32 as float32."""

    k: np.ndarray
    v: np.ndarray
    dtype: str  # "float16" | "float32"

    @classmethod
    def allocate(cls, cfg, num_blocks: int, block_size: int, dtype="float16") -> "HostKV":
        name = dtype_name(dtype)
        store = {"float16": np.uint16, "float32": np.float32}.get(name)
        if store is None:
            raise ValueError(f"the CPU KV pool holds float16 or float32, not {name}")
        shape = (cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        return cls(lazy_zeros(shape, store), lazy_zeros(shape, store), name)

    num_blocks = property(lambda self: self.k.shape[1])
    block_size = property(lambda self: self.k.shape[2])


@dataclass
class RowsPlan:
    """Where a step's N new tokens go: the facts every forward needs (llama.make_plan adds the
    torch attention groups on top of these)."""

    slots: np.ndarray  # [N] int64 cache slot each new token's K/V is written to
    positions: np.ndarray  # [N] int64 absolute position of each new token
    last_rows: np.ndarray  # [B] int64 row of each sequence's last new token (the runner may narrow it)
    tables: np.ndarray  # int64 [*] every sequence's block table, concatenated
    row_tab: np.ndarray  # int64 [N] where row i's table starts in `tables`


def rows_plan(starts: list[int], lens: list[int], block_tables: list, block_size: int) -> RowsPlan:
    """RowsPlan for sequences with new tokens at positions start .. start+len-1."""
    bs = block_size
    slots, positions, last_rows, tabs, row_tab = [], [], [], [], []
    row = toff = 0
    for s, n, bt in zip(starts, lens, block_tables):
        assert n >= 1, "a sequence in a step needs at least one new token"
        assert (s + n - 1) // bs < len(bt), f"block table too short for position {s + n - 1}"
        table = np.asarray(bt, dtype=np.int64)
        tabs.append(table)
        row_tab.append(np.full(n, toff, dtype=np.int64))
        toff += len(table)
        pos = np.arange(s, s + n, dtype=np.int64)
        slots.append(table[pos // bs] * bs + pos % bs)
        positions.append(pos)
        last_rows.append(row + n - 1)
        row += n
    return RowsPlan(np.concatenate(slots), np.concatenate(positions), np.asarray(last_rows, dtype=np.int64),
                    np.concatenate(tabs), np.concatenate(row_tab))


def rope_table_ggml(theta: float, dim: int, max_pos: int, linear_factor: float = 1.0, first: int = 0):
    """cos, sin float32 [max_pos - first, dim/2] for positions first..max_pos-1, the angles as
    llama.cpp's CPU rope computes them, in float32: theta_i = pos * s^i by repeated multiplication
    (s = powf(theta, -2/dim)), times 1/linear_factor, then cosf / sinf. Up to ~1e-6 relative from
    the exact angles at long positions: the GGUF forward takes them so that its greedy text follows
    llama.cpp's on near-ties (issue 15 §5). Each row depends on its position only, so a table
    grown in pieces equals one built whole, bit for bit."""
    f32 = np.float32
    ts = f32(np.power(f32(theta), f32(-2.0) / f32(dim), dtype=np.float32))
    # [dim/2, positions]: each product step runs over one contiguous row (by columns of the
    # [positions, dim/2] table it was 4x slower: a restart's first step at position 19,360 spent
    # 0.7 s of its TTFT here, bench/prompt_cache.py)
    ang = np.empty((dim // 2, max_pos - first), np.float32)
    ang[0] = np.arange(first, max_pos, dtype=np.float32)
    for i in range(1, dim // 2):
        np.multiply(ang[i - 1], ts, out=ang[i])  # float32 products, in ggml's order
    if linear_factor != 1.0:
        ang *= f32(1.0 / linear_factor)
    a64 = ang.T.astype(np.float64)  # cos/sin of the float32 angle, correctly rounded
    return np.cos(a64).astype(np.float32), np.sin(a64).astype(np.float32)


class RopeTables:
    """A RoPE table that grows with the longest position a step has asked for, in whole
    powers of two (at least 1,024 rows), up to the context length. Gemma 3's two tables for its
    32,768-token context were 67 MB built whole, mostly for positions no request reaches."""

    def __init__(self, theta: float, dim: int, context: int, linear_factor: float = 1.0):
        self.theta, self.dim, self.context, self.factor = theta, dim, context, linear_factor
        self.cos = np.empty((0, dim // 2), np.float32)
        self.sin = self.cos

    def upto(self, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) covering positions 0..max_pos (max_pos < context)."""
        have = self.cos.shape[0]
        if max_pos >= have:
            want = min(self.context, max(1024, 1 << int(max_pos).bit_length()))
            c, s = rope_table_ggml(self.theta, self.dim, want, self.factor, first=have)
            self.cos, self.sin = np.concatenate([self.cos, c]), np.concatenate([self.sin, s])
        return self.cos, self.sin
