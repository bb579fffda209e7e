"""The tiles of the int8 tensor-core GEMM (`gemm_int8_act`): each tile's block shape and pipeline
depth, the dynamic shared memory a launch of it takes, and which tile a shape gets.

A tile is (MI, NJ, WGM, WGN, STAGES): a block of WGM x WGN warps, each warp 16 MI x 8 NJ outputs,
so a block tile of BM = 16 MI WGM tokens x BN = 8 NJ WGN weight rows, STAGES chunks of K in flight.
They are template arguments of the kernel, one instance per (format, tile).
"""

from __future__ import annotations

import functools

import torch

# name: (MI, NJ, WGM, WGN, STAGES) -> block tile 16 MI WGM x 8 NJ WGN, 32 WGM WGN threads
TILES = {
    "16x64": (1, 2, 1, 4, 4),
    "32x64": (2, 2, 1, 4, 3),
    "64x32": (2, 2, 2, 2, 3),
    "64x64": (2, 4, 2, 2, 2),
    "64x128": (2, 4, 2, 4, 2),
    "128x128": (4, 4, 2, 4, 2),
}
# what smem_bytes needs of the kernel's layout (its XS, XDS and Fmt<>::WB, SQ, MN): bytes a row of the x tile,
# float2 a row of the x scales; per format the shared bytes of a weight row, scales a row a chunk, has a min
_XS, _XDS = 272, 9
_WB = {"Q4_0": 144, "Q4_1": 144, "Q8_0": 272, "Q4_K": 144, "Q6_K": 208}
_SQ = {"Q4_0": 8, "Q4_1": 8, "Q8_0": 8, "Q4_K": 8, "Q6_K": 16}
_HASMN = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 0, "Q4_K": 1, "Q6_K": 0}


def tile_dims(tile: str) -> tuple[int, int, int]:
    """(BM, BN, threads) of a tile."""
    mi, nj, wgm, wgn, _ = TILES[tile]
    return 16 * mi * wgm, 8 * nj * wgn, 32 * wgm * wgn


def smem_bytes(fmt: str, tile: str) -> int:
    """Dynamic shared memory of a launch: STAGES x (x tile, x scales, raw weights) + the scale table."""
    BM, BN, _ = tile_dims(tile)
    stages = TILES[tile][4]
    stage = BM * _XS + BM * _XDS * 8 + BN * _WB[fmt]
    return stages * stage + (_SQ[fmt] + 8 * _HASMN[fmt]) * BN * 4


def pick_tile(fmt: str, M: int, N: int, K: int, sms: int = 132) -> str:
    """The tile for M tokens x N weight rows x K, fitted to an H200 sweep of every tile (Q4_K qkv / gate_up,
    Q6_K down at M = 16..512): the kernel is latency-bound per chunk when there are few blocks, so small
    tiles (more blocks, deeper pipelines) until the grid fills the SMs several times over."""
    if M <= 16:
        return "16x64"
    if M <= 128:
        return "64x64" if -(-M // 64) * -(-N // 64) >= 3 * sms else "32x64"
    if K >= 8192 or -(-M // 128) * -(-N // 128) >= 4 * sms:
        return "128x128"
    return "64x64"


@functools.lru_cache(maxsize=None)
def sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
