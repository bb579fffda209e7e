"""A runner that computes nothing: the control plane measured through HTTP.

It has the real model's shape, tokenizer metadata, fingerprint and KV pool size
(read from the file's header, no weights loaded), and every step answers at
once: each sequence that samples gets token `token_id`. Everything else (HTTP,
tokenization, admission, scheduling, KV allocation, the event log, the process
boundary, detokenization, SSE) runs for real, so what a benchmark measures with
it is the server's own cost per token. Chosen at boot with IMP_NULL_RUNNER=1
(never by a request); `bench/serving.py --null` uses it.

`PacedNullRunner` (IMP_NULL_STEP_US=T as well) stands in for a GPU: it has the
GpuModelRunner's launch/collect interface (so the executor pipelines, and with
`--pipeline-depth 2` the scheduler plans step N+1 while N "runs"), and a step
lands T µs after the previous one did, or after its launch if the "device" was
idle, as a stream's kernels queue. So the question "does the host keep a T-µs
device busy at one stream?" can be asked on a machine without one.
"""

from __future__ import annotations

import time
from pathlib import Path

import queue

import numpy as np

from imp.messages import SampledToken, SeqWork
from imp.sampling.works import Works
from imp.model.runner import DEFAULT_KV_TOKENS, default_num_blocks


class NullRunner:
    device = "cpu"

    def __init__(self, config, metadata: dict, fingerprint: str, num_blocks: int, block_size: int,
                 token_id: int, kv_bytes: int = 0):
        self.config, self.metadata, self.fingerprint = config, metadata, fingerprint
        self.num_blocks, self.block_size = num_blocks, block_size
        self.token_id = token_id
        self.steps = 0
        self.kv_bytes = kv_bytes  # > 0: tiers with blocks this size
        self._ring: queue.Queue = queue.Queue()
        self._made = 0
        self._chunks: queue.Queue = queue.Queue()
        self._chunks_made = 0

    @property
    def supports_kv_tier(self) -> bool:
        return self.kv_bytes > 0

    def kv_layout(self) -> str:
        return f"null:{self.kv_bytes}"

    def kv_block_bytes(self) -> int:
        return self.kv_bytes

    def kv_block(self, b: int):
        payload = b.to_bytes(8, "little") * (self.kv_bytes // 8)
        return lambda: payload

    def kv_staging(self):
        """As the GPU's per-block ring (imp.gpu.kvcopy.DeviceBlocks.staging; used where a chunk holds one block)."""
        if self._made < 32 and self._ring.empty():
            self._made += 1
            return _Staged(np.empty(self.kv_bytes, np.uint8))
        return self._ring.get()

    def kv_unstage(self, buf) -> None:
        self._ring.put(buf)

    kv_fill_anywhere = True  # as the GPU runner's: a load's "copy" from its read thread

    def kv_chunk_blocks(self) -> int:
        # imp.gpu.kvcopy's CHUNK_MAX and CHUNK_BYTES (not imported: that module loads torch, this runner does not)
        return max(1, min(64, (32 << 20) // self.kv_bytes)) if self.kv_bytes else 1

    def kv_chunk_staging(self):
        """As the GPU's chunk ring: 8 buffers of kv_chunk_blocks() blocks, reused."""
        if self._chunks_made < 8 and self._chunks.empty():
            self._chunks_made += 1
            return _Staged(np.empty(self.kv_chunk_blocks() * self.kv_bytes, np.uint8)), None
        return self._chunks.get()

    def kv_chunk_unstage(self, chunk) -> None:
        self._chunks.put(chunk)

    def set_kv_blocks(self, chunk, placed) -> None:
        self._chunks.put(chunk)

    def set_kv_block(self, b: int, data) -> None:
        if isinstance(data, _Staged):
            self._ring.put(data)

    @classmethod
    def load(cls, path: str, block_size: int = 16, kv_tokens: int | None = None, kv_bytes: int = 0) -> "NullRunner":
        from imp.formats.gguf_loader import open_gguf
        from imp.formats.hf_dir import open_hf_dir

        g = open_hf_dir(path) if Path(path).is_dir() else open_gguf(path)
        # a token that renders as text and is no EOS: the middle of the vocabulary
        token = int(g.config.vocab_size) // 2
        return cls(g.config, g.metadata, g.fingerprint,
                   default_num_blocks(kv_tokens or DEFAULT_KV_TOKENS, block_size), block_size, token, kv_bytes)

    def step(self, seqs: list[SeqWork], constraints=None, lora=None) -> list[SampledToken]:
        self.steps += 1
        t = self.token_id
        return [SampledToken(s.seq_id, t) for s in seqs if s.sample]

    def forget(self, seq_ids) -> None:
        pass


class _Staged:
    """A staging buffer as the executor's read threads use one (torch's `.numpy()`)."""

    def __init__(self, a: np.ndarray):
        self.a = a

    def numpy(self) -> np.ndarray:
        return self.a


class PacedNullRunner(NullRunner):
    """NullRunner whose steps take a make-believe device's time, queued in launch order: `step_us`, plus
    `row_us` a one-token row, `token_us` a token of a longer share (a prompt chunk) and `mixed_us` a step
    with both where those are set (IMP_NULL_ROW_US, IMP_NULL_TOKEN_US, IMP_NULL_MIXED_US): a GPU's decode step grows with its batch and a prompt chunk costs
    its tokens at the prefill rate, so admission policies can be tried against a device's cost shape."""

    def __init__(self, *a, step_us: int = 0, row_us: float = 0.0, token_us: float = 0.0, mixed_us: float = 0.0,
                 buckets: tuple[int, ...] = (), ctx_us: float = 0.0, prompt_ctx_us: float = 0.0,
                 prompt_ctx_by: dict[int, float] | None = None, report_ctx_by: bool = True, **kw):
        super().__init__(*a, **kw)
        self.step_ns = step_us * 1000
        self.row_ns, self.token_ns = int(row_us * 1000), int(token_us * 1000)
        self.mixed_ns = int(mixed_us * 1000)  # a step with both kinds of rows: a GPU's mixed graph's fixed part
        # (): prompt rows cost their number; else a step's prompt rows cost the bucket that holds them, as a
        # GPU's mixed graphs do (IMP_NULL_BUCKETS=1: imp.gpu.mixed's buckets), and prompt_costs() says so
        self.buckets = buckets
        # attention's share, which grows with the context (IMP_NULL_CTX_US, IMP_NULL_PROMPT_CTX_US): + ctx_us a
        # one-token row per 1,000 positions it reads, + prompt_ctx_us a prompt row per 1,000 positions it reads
        # (a chunk's rows read start .. their own position: n x (start + n / 2)). The 8B shape on an H100:
        # decode steps of 16 rows 7.6 ms at ~300-token contexts, 11.2 ms at ~1,450 (~190 µs a row per 1,000)
        self.ctx_ns, self.pctx_ns = ctx_us * 1000, prompt_ctx_us * 1000
        # a prompt row's attention by the step's prompt bucket where it differs (IMP_NULL_PROMPT_CTX_BY
        # "256:64.5,512:41.3": the 8B's H100 log, where small chunks cost more a row than the 512 one the GPU's
        # boot measures); prompt_ctx_ns() stays the 512 bucket's figure, as the GPU's boot; prompt_ctx_by() reports
        # the table when report_ctx_by (IMP_NULL_REPORT_CTX_BY=0: a boot that measures the one bucket alone)
        self.pctx_by = {b: us * 1000 for b, us in (prompt_ctx_by or {}).items()}
        self.report_ctx_by = report_ctx_by
        self._busy_until = 0  # monotonic ns at which the last launched step lands
        self._start = 0  # the last launched step's start on the make-believe device

    @classmethod
    def load(cls, path: str, block_size: int = 16, kv_tokens: int | None = None, step_us: int = 0,
             row_us: float = 0.0, token_us: float = 0.0, mixed_us: float = 0.0,
             kv_bytes: int = 0, buckets: tuple[int, ...] = (), ctx_us: float = 0.0,
             prompt_ctx_us: float = 0.0, prompt_ctx_by: dict[int, float] | None = None,
             report_ctx_by: bool = True) -> "PacedNullRunner":
        r = NullRunner.load(path, block_size, kv_tokens, kv_bytes)
        return cls(r.config, r.metadata, r.fingerprint, r.num_blocks, r.block_size, r.token_id, kv_bytes, step_us=step_us,
                   row_us=row_us, token_us=token_us, mixed_us=mixed_us, buckets=buckets, ctx_us=ctx_us,
                   prompt_ctx_us=prompt_ctx_us, prompt_ctx_by=prompt_ctx_by, report_ctx_by=report_ctx_by)

    def _prompt(self, prompt: int) -> int:
        return next((b for b in self.buckets if b >= prompt), prompt) if prompt and self.buckets else prompt

    def cost_ns(self, seqs: list[SeqWork]) -> int:
        general, lane = (seqs.general, seqs.rows) if isinstance(seqs, Works) else (seqs, None)
        rows = sum(1 for s in general if len(s.token_ids) == 1) + (len(lane) if lane is not None else 0)
        prompt = self._prompt(sum(len(s.token_ids) for s in general if len(s.token_ids) > 1))
        ns = self.step_ns + self.row_ns * rows + self.token_ns * prompt + (self.mixed_ns if rows and prompt else 0)
        if self.ctx_ns or self.pctx_ns:
            pctx = self.pctx_by.get(prompt, self.pctx_ns)
            for s in general:
                n = len(s.token_ids)
                ns += (self.ctx_ns * (s.start_pos + 1) if n == 1 else pctx * n * (s.start_pos + n / 2)) / 1000
            if lane is not None:
                ns += self.ctx_ns * float((lane.pos + 1).sum()) / 1000
        return int(ns)

    def prompt_costs(self) -> tuple[tuple[int, int, int], ...]:
        """The GPU runner's table of what a prompt-row bucket adds to a decode-only step (its cost model's)."""
        if not self.buckets:
            return ()
        return tuple((pb, db, self.token_ns * pb + self.mixed_ns) for pb in self.buckets
                     for db in (1, 2, 4, 8, 16, 32, 64, 128, 256))

    def prompt_ctx_ns(self) -> int:
        """The GPU runner's measure of a prompt row's attention, ns per 1,000 positions it reads (its cost model's)."""
        return round(self.pctx_ns) if self.buckets else 0

    def prompt_ctx_by(self) -> tuple[tuple[int, int], ...]:
        """The same by prompt bucket, where this make-believe device's boot would measure each."""
        if not (self.buckets and self.pctx_by and self.report_ctx_by):
            return ()
        return tuple((b, round(self.pctx_by.get(b, self.pctx_ns))) for b in self.buckets)

    # a plan's decode rows as columns (imp.sampling.works.Works), landed as ids: the GPU runner's way
    takes_rows = True

    def launch(self, seqs: list[SeqWork], constraints=None, lora=None) -> tuple[int, int, list[str]]:
        start = max(time.monotonic_ns(), self._busy_until)
        self._busy_until = start + self.cost_ns(seqs)
        self.steps += 1
        general = seqs.general if isinstance(seqs, Works) else seqs
        sids = (list(seqs.rows.seq_ids) if isinstance(seqs, Works) else []) + [s.seq_id for s in general if s.sample]
        return start, self._busy_until, sids

    def _wait(self, handle) -> list[str]:
        _, at, sids = handle
        while (left := at - time.monotonic_ns()) > 0:
            time.sleep(left / 1e9)
        return sids

    def collect(self, handle: tuple[int, int, list[str]]) -> list[SampledToken]:
        t = self.token_id
        return [SampledToken(s, t) for s in self._wait(handle)]

    def collect_ids(self, handle: tuple[int, int, list[str]]):
        sids = self._wait(handle)
        return sids, np.full(len(sids), self.token_id, np.int64), None

    @staticmethod
    def device_ns(handle: tuple[int, int, list[SampledToken]]) -> int:
        """Its make-believe device's time for the step, as the GPU runner's CUDA events give it."""
        return handle[1] - handle[0]
