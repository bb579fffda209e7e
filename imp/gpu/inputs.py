"""One step's device-side inputs: the eager layout, the graphs' static buffers (the plan's check: imp.gpu.tables).

A step is a list of `SeqWork` shares; the forward sees them as N new-token
rows (`Meta`): token ids, positions, KV slots (block * block_size + offset,
-1 = no write), the decode rows' block tables and lengths, the prefill
chunks, and which rows get the head. PENDING_TOKEN rows carry a (row, slot)
pair: the token is read on the device from the previous step's samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from imp.kernels.cuda import paged_prefill_attention
from imp.kernels.cuda.runtime import to_device
from imp.messages import SampledToken, SeqWork
from imp.sampling.verify import kept


@dataclass
class Meta:
    """One forward's device-side inputs (see `imp.gpu.forward`)."""

    tokens: torch.Tensor  # [N] int32
    positions: torch.Tensor  # [N] int32
    slots: torch.Tensor  # [N] int32, -1 = skip
    dec_rows: torch.Tensor | None  # [Bd] int64 rows of decode queries; None = rows 0..Bd-1
    dec_bt: torch.Tensor | None  # [Bd, max_blocks] int32
    dec_lens: torch.Tensor | None  # [Bd] int32
    prefill: list  # (row0, row1, ctx_blocks int64 | None, start)
    out_rows: torch.Tensor | None  # [R] int64 rows to compute logits for; None = all rows
    all_decode: bool = False
    pf_tiles: torch.Tensor | None = None  # [T, 4] int32: every prefill chunk's rows for one paged_prefill launch
    pf_bt: torch.Tensor | None = None  # [C, max_blocks] int32: those chunks' block tables
    pf_last: int | None = None  # the last key position of any tile (eager: lets few tiles split their segments)
    pending: tuple | None = None  # (rows [k] int32, src [k] int32, k): tokens[rows] = previous step's sampled[src]
    # (P, Rp): rows [0, P) are prompt rows, [P, N) one-token decode rows, and the first Rp of out_rows are the
    # prompt rows': the matmuls run per kind (`Forward.mixed`)
    split: tuple[int, int] | None = None
    # the decode rows are exactly [dec_from, N) (a mixed step's layout): attention reads their queries and writes
    # their output in place instead of gathering and scattering dec_rows (two launches a layer fewer)
    dec_from: int | None = None


class Landing:
    """A launched step: its sampled ids land in a pinned buffer when `event` completes."""

    def __init__(self, seq_ids: list[str], ring: torch.Tensor | None, event, tokens: list[SampledToken] | None):
        self.seq_ids, self.ring, self.event, self.tokens = seq_ids, ring, event, tokens
        self.start = None  # a timing event recorded before the step's first launch (GpuModelRunner.device_ns)
        self._ids: list[int] | None = None

    def ids(self) -> list[int]:
        """The sampled ids (waits for the step); safe from any thread, idempotent."""
        if self._ids is None:
            if self.tokens is not None:
                self._ids = [t.token_id for t in self.tokens]
            else:
                if self.event is not None:  # (None: CPU tensors, nothing in flight)
                    self.event.synchronize()
                self._ids = self.ring[:len(self.seq_ids)].tolist()
        return self._ids

    def ids_array(self) -> np.ndarray:
        """The sampled ids as int64 [R] (waits for the step)."""
        if self.tokens is None and self._ids is None:
            if self.event is not None:
                self.event.synchronize()
            return self.ring[:len(self.seq_ids)].numpy().astype(np.int64)
        return np.asarray(self.ids(), np.int64)


class VerifyLanding(Landing):
    """A launched step with verify shares (speculation): the plain rows' ids in `ring[:B]` as a `Landing`'s, every
    drafted position's id after them (`ring[B:B + D]`), all there when `event` completes. `tokens` waits for it once
    and gives the step's SampledTokens in the order of its sampled shares, each verify share's draft kept up to the
    first position whose id differs (`accepted`). So the host does not wait for a step with drafts at its launch:
    it is pipelined like any other (the scheduler plans nothing more for a verifying sequence until it lands)."""

    def __init__(self, plain: list[str], ring: torch.Tensor, event, order: list, plain_drawn: list[SampledToken] | None,
                 drawn: list[SampledToken] | None):
        # order: per sampled share in the step's order, None for a plain row (the next of ring[:B]) or (seq id,
        # its draft): len(draft) + 1 ids from the drafted part. plain_drawn, drawn: the plain rows' and the drafted
        # positions' tokens where the host drew them at launch (logprobs, DRY, ...: final then; their ids are in
        # the ring too)
        self.seq_ids, self.ring, self.event = plain, ring, event
        self.start, self._ids = None, None
        self._order, self._plain, self._drawn, self._tokens = order, plain_drawn, drawn, None

    @property
    def tokens(self) -> list[SampledToken]:
        if self._tokens is None:
            if self.event is not None:
                self.event.synchronize()
            B = len(self.seq_ids)
            n = B + sum(len(o[1]) + 1 for o in self._order if o is not None)
            ids = self.ring[:n].tolist()
            out, p, d = [], 0, B
            for o in self._order:
                if o is None:
                    out.append(self._plain[p] if self._plain is not None else
                               SampledToken(seq_id=self.seq_ids[p], token_id=ids[p]))
                    p += 1
                    continue
                sid, draft = o
                got = (self._drawn[d - B:d - B + len(draft) + 1] if self._drawn is not None else
                       [SampledToken(seq_id=sid, token_id=t) for t in ids[d:d + len(draft) + 1]])
                out.append(kept(got, draft))
                d += len(draft) + 1
            self._tokens = out
        return self._tokens


def eager_meta(seqs: list[SeqWork], rows: list[int], block_size: int, device: torch.device,
               src: dict[int, int] | None = None) -> Meta:
    """The eager layout: any mix of prefill chunks and decodes; `rows` get the head;
    src: share index -> previous-step slot for PENDING_TOKEN shares."""
    bs = block_size
    toks, pos, slots = [], [], []
    dec, pre = [], []
    ph_rows, ph_src = [], []
    r = 0
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        table = np.asarray(s.block_table, dtype=np.int64)
        p = np.arange(s.start_pos, s.start_pos + n, dtype=np.int64)
        if src and i in src:  # PENDING_TOKEN: filled in on the device (a one-token share)
            ph_rows.append(r)
            ph_src.append(src[i])
            toks.append(np.zeros(n, dtype=np.int64))
        else:
            toks.append(np.asarray(s.token_ids, dtype=np.int64))
        pos.append(p)
        slots.append(table[p // bs] * bs + p % bs)
        (dec if n == 1 else pre).append((r, s, n, table))
        r += n
    # every host array goes up through pinned memory, non-blocking (`to_device`): a pageable copy waits for
    # the stream, i.e. for the steps already queued, and an eager step (a prefill) would stall the pipeline
    i32 = lambda a: to_device(torch.from_numpy(np.concatenate(a).astype(np.int32)), torch.int32, device)  # noqa: E731
    m = Meta(tokens=i32(toks), positions=i32(pos), slots=i32(slots), dec_rows=None, dec_bt=None,
             dec_lens=None, prefill=[], out_rows=to_device(rows, torch.int64, device))
    if ph_rows:
        m.pending = (i32([np.asarray(ph_rows)]), i32([np.asarray(ph_src)]), len(ph_rows))
    if dec:
        nbmax = max((s.start_pos // bs) + 1 for _, s, _, _ in dec)
        bt = np.zeros((len(dec), nbmax), np.int32)
        lens = np.zeros(len(dec), np.int32)
        for j, (_, s, _, table) in enumerate(dec):
            nb = s.start_pos // bs + 1
            bt[j, :nb] = table[:nb]
            lens[j] = s.start_pos + 1
        m.dec_bt = to_device(torch.from_numpy(bt), torch.int32, device)
        m.dec_lens = to_device(torch.from_numpy(lens), torch.int32, device)
        m.dec_rows = to_device([rr for rr, _, _, _ in dec], torch.int64, device)
    chunks = []
    for rr, s, n, table in pre:
        ctx = None
        nb = (s.start_pos + n - 1) // bs + 1
        if s.start_pos > 0:
            ctx = to_device(torch.from_numpy(np.ascontiguousarray(table[:nb])), torch.int64, device)
        m.prefill.append((rr, rr + n, ctx, s.start_pos))
        chunks.append((rr, n, table[:nb], s.start_pos))
    if chunks:  # one attention launch a layer for all of them (imp.kernels.cuda.paged_prefill_attention)
        tiles, pbt = paged_prefill_attention.plan(chunks)
        m.pf_tiles = to_device(torch.from_numpy(tiles), torch.int32, device)
        m.pf_bt = to_device(torch.from_numpy(pbt), torch.int32, device)
        m.pf_last = int((tiles[:, 3] + tiles[:, 1]).max()) - 1
    return m


def decode_rows(seqs: list[SeqWork], src: dict[int, int], bs: int, bt: np.ndarray, cols=None
                ) -> tuple[np.ndarray, ...]:
    """One-token shares as arrays, in order: (token (0 where the previous step's sample feeds it), position,
    KV slot, previous-step slot or -1); each one's block table up to its position written into row k of
    bt. One pass over the shares for their scalars and one flat gather for the tables, not a numpy write
    per field and share (a quarter of the GPU executor's host time at 256 streams). cols: (the shares'
    `imp.gpu.tables.Rows`, the runner's `Tables` that checked them): the scalars and tables gathered from those
    instead (entries of a row's table past its position may then be written too)."""
    B = len(cols[0].pos) if cols is not None else len(seqs)
    srcv = np.full(B, -1, np.int64)
    if src:
        srcv[np.fromiter(src.keys(), np.int64, len(src))] = np.fromiter(src.values(), np.int64, len(src))
    if cols is not None:
        tr, tables = cols
        pos = tr.pos
        nbs = pos // bs + 1
        width = int(nbs.max())
        bt[:B, :width] = tables.rows(tr.slots, width)
        tok = tr.tok0.copy()
        tok[srcv >= 0] = 0
        return tok, pos, bt[np.arange(B), nbs - 1].astype(np.int64) * bs + pos % bs, srcv
    pos = np.fromiter([s.start_pos for s in seqs], np.int64, B)
    nbs = pos // bs + 1
    flat = np.fromiter([b for s, n in zip(seqs, nbs.tolist()) for b in s.block_table[:n]], np.int64)
    ends = np.cumsum(nbs)
    starts = ends - nbs
    rows = np.repeat(np.arange(B), nbs)
    bt[rows, np.arange(flat.size) - np.repeat(starts, nbs)] = flat
    tok = np.fromiter([s.token_ids[0] for s in seqs], np.int64, B)
    tok[srcv >= 0] = 0
    return tok, pos, flat[ends - 1] * bs + pos % bs, srcv


class StaticInputs:
    """The decode graphs' input buffers: one device buffer laid out as
    [tokens | positions | slots | lens | pending rows | pending src | block tables]
    for the largest bucket M, and two pinned host copies used in turn, so that
    writing step N+1's inputs never races step N's copy still queued on the stream."""

    def __init__(self, max_batch: int, max_blocks: int, block_size: int, device: torch.device):
        M, MB = self.M, self.MB = max_batch, max_blocks
        self.block_size = block_size
        self.dev = torch.zeros(6 * M + M * MB, dtype=torch.int32, device=device)
        self.cuda = torch.device(device).type == "cuda"  # (CPU tensors: the host path alone, bench/executor_host.py)
        self.hosts = [torch.zeros_like(self.dev, device="cpu") for _ in range(2)]
        if self.cuda:
            self.hosts = [h.pin_memory() for h in self.hosts]
        self.events = [None, None]
        self.turn = 0
        self.inert()
        gi = self.dev
        self.views = dict(tokens=gi[0:M], positions=gi[M:2 * M], slots=gi[2 * M:3 * M], lens=gi[3 * M:4 * M],
                          ph_rows=gi[4 * M:5 * M], ph_src=gi[5 * M:6 * M], bt=gi[6 * M:].view(M, MB))

    def inert(self) -> None:
        """Every row padding, host and device (nothing in flight: at construction, or the boot's cost replays)."""
        M = self.M
        for h in self.hosts:
            h.zero_()
            h.numpy()[2 * M:3 * M] = -1  # no KV writes from padding rows
            h.numpy()[4 * M:5 * M] = -1  # no pending tokens
        self.dev.copy_(self.hosts[0])

    def meta(self, b: int) -> Meta:
        """The bucket-b view the graph of b captures (and replays)."""
        st = self.views
        return Meta(tokens=st["tokens"][:b], positions=st["positions"][:b], slots=st["slots"][:b], dec_rows=None,
                    dec_bt=st["bt"][:b], dec_lens=st["lens"][:b], prefill=[], out_rows=None, all_decode=True,
                    pending=(st["ph_rows"][:b], st["ph_src"][:b], b))

    def write(self, seqs: list[SeqWork], b: int, src: dict[int, int] | None = None, mark=None, cols=None) -> None:
        """Decode shares (one token each) into bucket b's inputs, padding rows inert;
        one non-blocking host->device copy on the current stream. cols: see `decode_rows`."""
        B, M, MB, bs = len(seqs), self.M, self.MB, self.block_size
        i_host = self.turn
        self.turn ^= 1
        if self.events[i_host] is not None:
            self.events[i_host].synchronize()  # its last copy has left (long ago: two steps back)
        host = self.hosts[i_host]
        h = host.numpy()
        bt = h[6 * M:6 * M + b * MB].reshape(b, MB)
        tok, pos, slot, srcv = decode_rows(seqs, src or {}, bs, bt, cols)
        h[:B] = tok
        h[M:M + B] = pos
        h[2 * M:2 * M + B] = slot
        h[3 * M:3 * M + B] = pos + 1
        h[4 * M:4 * M + B] = np.where(srcv >= 0, np.arange(B), -1)
        h[5 * M:5 * M + B] = np.maximum(srcv, 0)
        h[B:b] = 0
        h[M + B:M + b] = 0
        h[2 * M + B:2 * M + b] = -1
        h[3 * M + B:3 * M + b] = 0
        h[4 * M + B:4 * M + b] = -1
        if mark is not None:
            mark()
        self.dev[: 6 * M + b * MB].copy_(host[: 6 * M + b * MB], non_blocking=True)
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self.events[i_host] = ev
