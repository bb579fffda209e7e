"""The device KV pool's blocks to host memory and back.

Two users: the prefix cache's disk tier (imp.actors.kvtier: one block's bytes out when it becomes a cache
entry, in when a later prompt finds it on disk) and the swap area (imp.core.kv "swap_out" / "swap_in": a
preempted sequence's blocks parked in pinned host memory and put back when it runs again).

Every copy is queued on the step stream from the step thread, as the executor's messages arrive: a copy out
sees every earlier step's writes and none of a later one's, a copy in lands before any later step reads the
block. Nothing here waits for the device (a synchronising copy would stall the pipelined steps): index lists
go up from pinned memory, blocks come down into pinned memory, and a tier save hands the file thread a
function that waits for its copy's event there.

    pool:       k, v [L, num_blocks, bs, Hkv, D]  (the runner's)
    swap area:  k, v [slots, L, bs, Hkv, D] pinned: one slot is one contiguous run, its copy one DMA
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import torch

STAGING = 64  # pinned buffers a tier load reads a block into (a ring: each waits for its last DMA before reuse)
CHUNK_BYTES = 32 << 20  # a chunk of tier loads: blocks read side by side into one pinned buffer, one copy up
CHUNK_MAX = 64  # blocks a chunk at most (a small model's blocks)
CHUNKS = 8  # pinned chunk buffers (a ring, as the staging one)


class DeviceBlocks:
    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k, self.v = k, v
        self.area: tuple[torch.Tensor, torch.Tensor] | None = None
        self._ring: queue.Queue = queue.Queue()  # (pinned buffer, the event after its last DMA)
        self._made = 0
        self._ring_lock = threading.Lock()
        self._chunks: queue.Queue = queue.Queue()  # (pinned bytes, pinned pairs, the event after their copy)
        self._chunks_made = 0
        self._dev_chunk: torch.Tensor | None = None  # one on the device: its reuse is in stream order
        self._dev_pairs: torch.Tensor | None = None

    # ------------------------------------------------------------------ the disk tier

    def layout(self) -> str:
        """What a saved block's bytes mean (a file of another layout is never read): dtype, [L, bs, Hkv, D]."""
        k = self.k
        return f"{str(k.dtype).removeprefix('torch.')}:{'x'.join(str(n) for n in (k.shape[0], *k.shape[2:]))}"

    def block_bytes(self) -> int:
        return 2 * self.k[:, 0].numel() * self.k.element_size()

    def block(self, b: int):
        """Block b's K then V, every layer: a function the file thread calls for the bytes (it waits there for
        the copy, queued now behind the steps before it)."""
        kv = torch.stack((self.k[:, b], self.v[:, b])).reshape(-1).view(torch.uint8)  # a gather on the device
        out = torch.empty(kv.numel(), dtype=torch.uint8, pin_memory=True)
        out.copy_(kv, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def bytes_() -> bytes:
            done.synchronize()
            return out.numpy().tobytes()

        return bytes_

    def staging(self) -> torch.Tensor:
        """A pinned buffer of one block's bytes for a tier read thread to read a file into, so the step thread
        only queues the DMA. From a ring of STAGING (a pinned allocation per block, cudaHostAlloc, serialised
        the reads): one whose last DMA is still queued is waited for here, on the read thread."""
        with self._ring_lock:
            fresh = self._made < STAGING and self._ring.empty()
            self._made += fresh
        if fresh:
            return torch.empty(self.block_bytes(), dtype=torch.uint8, pin_memory=True)
        buf, done = self._ring.get()
        if done is not None:
            done.synchronize()
        return buf

    def unstage(self, buf: torch.Tensor, done=None) -> None:
        self._ring.put((buf, done))

    def set_block(self, b: int, data) -> None:
        """data: a staging buffer (back to the ring once its DMA is queued) or the block's bytes. Block b is L
        runs of one layer's rows each in the pool: one 2-D DMA for K and one for V straight from pinned memory
        (was a device copy and two strided copy kernels: 0.53 ms a block of the step thread's time on the 8B
        shape, the restart's bound at 1,249 blocks)."""
        staged = isinstance(data, torch.Tensor)
        if staged:
            host = data
        else:
            host = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
            host.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        if staged and self.k.is_contiguous() and self.v.is_contiguous():  # (a ring buffer outlives its DMA)
            from imp.kernels.cuda import runtime as cu

            rt = cu.cupy().cuda.runtime
            L, NB = self.k.shape[0], self.k.shape[1]
            row = self.k[0, 0].numel() * self.k.element_size()  # one layer's part of a block
            stream = torch.cuda.current_stream(self.k.device).cuda_stream
            src = host.data_ptr()
            for i, pool in enumerate((self.k, self.v)):
                rt.memcpy2DAsync(pool.data_ptr() + b * row, NB * row, src + i * L * row, row, row, L,
                                 rt.memcpyHostToDevice, stream)
        else:
            kv = host.to(self.k.device, non_blocking=True).view(self.k.dtype).view(2, *self.k[:, b].shape)
            self.k[:, b] = kv[0]
            self.v[:, b] = kv[1]
        if staged:
            done = torch.cuda.Event()
            done.record()
            self.unstage(data, done)

    def chunk_blocks(self) -> int:
        """Blocks a chunk of tier loads holds (1: this pool takes them one at a time)."""
        from imp.kernels.cuda import kv_scatter

        if not kv_scatter.supports(self.k, self.v):
            return 1
        return max(1, min(CHUNK_MAX, CHUNK_BYTES // self.block_bytes()))

    def chunk_staging(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pinned bytes of chunk_blocks() blocks, pinned int32 [2 * chunk_blocks()] pairs) from a ring of
        CHUNKS, waiting here (a read thread) for one whose copy up is still queued."""
        with self._ring_lock:
            fresh = self._chunks_made < CHUNKS and self._chunks.empty()
            self._chunks_made += fresh
        if fresh:
            n = self.chunk_blocks()
            return (torch.empty(n * self.block_bytes(), dtype=torch.uint8, pin_memory=True),
                    torch.empty(2 * n, dtype=torch.int32, pin_memory=True))
        buf, pairs, done = self._chunks.get()
        if done is not None:
            done.synchronize()
        return buf, pairs

    def chunk_unstage(self, chunk, done=None) -> None:
        self._chunks.put((*chunk, done))

    def set_blocks(self, chunk, placed: list[tuple[int, int]]) -> None:
        """placed: (slot in the chunk, pool block) for the blocks read whole. The chunk's slots up to the last
        placed one go up in one copy, the pairs in another, then one launch puts each block in place
        (`imp.kernels.cuda.kv_scatter`); the chunk returns to the ring behind an event."""
        from imp.kernels.cuda import kv_scatter

        buf, pairs = chunk
        if placed:
            n, bb = len(placed), self.block_bytes()
            used = (max(i for i, _ in placed) + 1) * bb
            if self._dev_chunk is None:
                self._dev_chunk = torch.empty(buf.numel(), dtype=torch.uint8, device=self.k.device)
                self._dev_pairs = torch.empty(pairs.numel(), dtype=torch.int32, device=self.k.device)
            pairs.numpy()[:2 * n] = np.asarray(placed, dtype=np.int32).reshape(-1)
            self._dev_chunk[:used].copy_(buf[:used], non_blocking=True)
            self._dev_pairs[:2 * n].copy_(pairs[:2 * n], non_blocking=True)
            kv_scatter.scatter(self._dev_chunk, self.k, self.v, self._dev_pairs, n)
        done = torch.cuda.Event()
        done.record()
        self.chunk_unstage(chunk, done)

    # ------------------------------------------------------------------ the swap area

    def make_swap(self, n_slots: int) -> None:
        shape = (n_slots, self.k.shape[0], *self.k.shape[2:])
        self.area = (torch.empty(shape, dtype=self.k.dtype, pin_memory=True),
                     torch.empty(shape, dtype=self.v.dtype, pin_memory=True))

    def swap_out(self, blocks, slots) -> None:
        idx = _indices(blocks, self.k.device)
        for pool, area in zip((self.k, self.v), self.area):
            g = pool.index_select(1, idx).transpose(0, 1).contiguous()  # [n, L, bs, Hkv, D]
            for i, s, n in _runs(slots):
                area[s:s + n].copy_(g[i:i + n], non_blocking=True)

    def swap_in(self, slots, blocks) -> None:
        idx = _indices(blocks, self.k.device)
        for pool, area in zip((self.k, self.v), self.area):
            g = torch.empty((len(blocks), *area.shape[1:]), dtype=area.dtype, device=pool.device)
            for i, s, n in _runs(slots):
                g[i:i + n].copy_(area[s:s + n], non_blocking=True)
            pool.index_copy_(1, idx, g.transpose(0, 1))


def _indices(blocks, device) -> torch.Tensor:
    # from pinned memory, asynchronously: a pageable copy would wait for every step queued before it
    return torch.from_numpy(np.asarray(blocks, dtype=np.int64)).pin_memory().to(device, non_blocking=True)


def _runs(slots):
    """(index into slots, first slot, length) of each run of consecutive slots: one copy each."""
    i = 0
    while i < len(slots):
        n = 1
        while i + n < len(slots) and slots[i + n] == slots[i] + n:
            n += 1
        yield i, slots[i], n
        i += n
