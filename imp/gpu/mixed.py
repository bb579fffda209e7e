"""CUDA graphs for steps with prompt rows: one graph per (prompt-row bucket, decode-row bucket).

Why: a step that admits a request ran eagerly, ~25 launches a layer from Python (the split matmuls,
attention for both row kinds, norms): on SmolLM2's 30 layers ~10 ms of host time for ~2 ms of device
work, and at 64-256 streams with 128-token answers almost every other step admits someone (issue 33).
Here such a step replays a graph captured over static buffers, as decode steps do.

Layout (the flat rows of one step, `Meta`): rows [0, Pb) are prompt rows (every share of more than one
token, in step order, packed; the rest padding: token 0, position 0, no KV write, in no attention tile),
rows [Pb, Pb + Db) one-token shares (decodes, and a prompt's last single token), padding rows with
context length 0. Head rows: Cb slots for the prompt shares that sample (the last row of each; padding
slots read row 0), then the Db one-token rows. Attention: one `paged_prefill` launch a layer over Tb
tiles (padding tiles have no rows: an exact no-op) and one `paged_decode` over the Db rows, the same
kernels and per-row arithmetic as the eager step, so a row's bits depend on the buckets' matmul
shapes as the eager step's do on its row counts. Matmuls: `Forward.mixed` per row kind where
prompt and decode rows take different kernels (int8 decode GEMVs), else `Forward.__call__`.

The graphs share one memory pool; each copies its logits into one static buffer, so no graph keeps an
output of its own alive in the pool (60 outputs of [R, vocab] would not fit beside an 8B model).

`layout` is pure numpy (tested on the CPU against the eager step's rows, tests/test_gpu_mixed.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from imp.gpu.inputs import Meta, decode_rows
from imp.kernels.cuda.paged_prefill_attention import TILE_ROWS, splits
from imp.gpu.linear import capture_stream
from imp.messages import SeqWork
from imp.sampling.works import Works

PROMPT_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
MAX_CHUNKS = 64  # prompt shares one mixed graph takes (its head slots); a step with more runs eagerly


def prompt_buckets(max_prompt_rows: int) -> tuple[int, ...]:
    """The prompt-row buckets up to the first that holds max_prompt_rows."""
    out = []
    for b in PROMPT_BUCKETS:
        out.append(b)
        if b >= max_prompt_rows:
            break
    return tuple(out)


def head_slots(pb: int) -> int:
    """Cb: head slots for the prompt shares of a Pb-row bucket (a share has at least 2 rows)."""
    return min(pb // 2, MAX_CHUNKS)


def tile_slots(pb: int) -> int:
    """Tb: attention tiles of a Pb-row bucket: whole tiles plus one partial tile per share."""
    return pb // TILE_ROWS + head_slots(pb)


@dataclass(frozen=True)
class Regions:
    """Offsets (int32 elements) of the inputs in one flat buffer, sized for the largest buckets."""

    N: int  # rows: Pmax + Dmax
    D: int  # decode rows: Dmax
    C: int  # head slots: Cmax
    T: int  # tiles: Tmax
    MB: int  # block-table width

    @property
    def offsets(self) -> dict[str, int]:
        N, D, C, T, MB = self.N, self.D, self.C, self.T, self.MB
        sizes = [("tokens", N), ("positions", N), ("slots", N), ("dec_lens", D), ("ph_rows", D), ("ph_src", D),
                 ("p_head", C), ("tiles", 4 * T), ("pf_bt", C * MB), ("dec_bt", D * MB)]
        out, o = {}, 0
        for name, n in sizes:
            out[name] = o
            o += n
        out["end"] = o
        return out


@dataclass
class Placed:
    """Where one step went in its buckets: head_at[i] is the logits row of share i (if it samples)."""

    pb: int
    db: int
    head_at: dict[int, int]
    used: int  # int32 elements of the buffer to copy


def fits(seqs: list[SeqWork], pbs: tuple[int, ...], dbs: tuple[int, ...], heads: int = 0) -> tuple[int, int] | None:
    """(Pb, Db) for a step with prompt rows that a captured bucket takes, else None (eager): no prompt
    logprobs, no drafts, at least one share of several tokens, rows and shares within the largest buckets,
    and (heads > 0) not a few attention tiles over a long context: eagerly those run their key segments side
    by side (`paged_prefill_attention.splits`, the same bits), a graph's fixed launch walks them in turn."""
    P = C = D = T = 0
    last = -1
    if isinstance(seqs, Works):  # decode rows: one token each, no drafts, no prompt logprobs (read as a count)
        D, seqs = seqs.n_rows, seqs.general
    for s in seqs:
        if s.prompt_logprobs >= 0 or s.draft:
            return None
        n = len(s.token_ids)
        if n > 1:
            P += n
            C += 1
            T += -(-n // TILE_ROWS)
            last = max(last, s.start_pos + n - 1)
        else:
            D += 1
    if not C or heads and splits(T, heads, last) > 1:
        return None
    pb = next((b for b in pbs if b >= P), None)
    db = next((b for b in dbs if b >= D), None)
    if pb is None or db is None or C > head_slots(pb):
        return None
    return pb, db


def layout(seqs: list[SeqWork], src: dict[int, int] | None, pb: int, db: int, bs: int, reg: Regions,
           h: np.ndarray, cols=None) -> Placed:
    """Write one step's inputs into the host buffer h (int32, `reg.offsets`) for buckets (pb, db);
    every element a graph of (pb, db) reads is written (the buffers alternate between steps).
    src: share index -> previous step's slot for PENDING_TOKEN shares. cols: (the shares' `imp.gpu.tables.Rows`,
    the runner's `Tables`) where seqs is a `Works`: its one-token shares laid out from those (`decode_rows`),
    no SeqWork of a decode row made."""
    o = reg.offsets
    src = src or {}
    N, cb, tb, MB = pb + db, head_slots(pb), tile_slots(pb), reg.MB
    tok = h[o["tokens"]:o["tokens"] + N]
    pos = h[o["positions"]:o["positions"] + N]
    slot = h[o["slots"]:o["slots"] + N]
    lens = h[o["dec_lens"]:o["dec_lens"] + db]
    ph_rows = h[o["ph_rows"]:o["ph_rows"] + db]
    ph_src = h[o["ph_src"]:o["ph_src"] + db]
    p_head = h[o["p_head"]:o["p_head"] + cb]
    tiles = h[o["tiles"]:o["tiles"] + 4 * tb].reshape(tb, 4)
    pf_bt = h[o["pf_bt"]:o["pf_bt"] + cb * MB].reshape(cb, MB)
    dec_bt = h[o["dec_bt"]:o["dec_bt"] + db * MB].reshape(db, MB)
    tok[:] = 0
    pos[:] = 0
    slot[:] = -1
    lens[:] = 0
    ph_rows[:] = -1
    ph_src[:] = 0
    p_head[:] = 0
    tiles[:] = 0
    head_at: dict[int, int] = {}
    r = c = t = 0
    ones = []  # the one-token shares: rows pb + j, decode attention over their context (below, as arrays)
    R, shares = 0, seqs
    if isinstance(seqs, Works) and cols is not None:
        R, shares = seqs.n_rows, seqs.general
        ones = list(range(R))  # (the decode rows come first and sample)
    for i, s in enumerate(shares, R):
        n = len(s.token_ids)
        if n == 1:
            ones.append(i)
            continue
        table = np.asarray(s.block_table, dtype=np.int64)
        # a prompt chunk: rows r .. r+n-1, tiles of TILE_ROWS rows
        p = np.arange(s.start_pos, s.start_pos + n, dtype=np.int64)
        tok[r:r + n] = s.token_ids
        pos[r:r + n] = p
        slot[r:r + n] = table[p // bs] * bs + p % bs
        nb = (s.start_pos + n - 1) // bs + 1
        pf_bt[c, :nb] = table[:nb]
        for k in range(0, n, TILE_ROWS):
            tiles[t] = (r + k, min(TILE_ROWS, n - k), c, s.start_pos + k)
            t += 1
        if s.sample:
            p_head[c] = r + n - 1
            head_at[i] = c
        c += 1
        r += n
    if ones:
        D = len(ones)
        osrc = {j: src[i] for j, i in enumerate(ones) if i in src} if src else {}
        if R:
            dt, dp, ds, dsrc = decode_rows(None, osrc, bs, dec_bt, (cols[0].subset(ones), cols[1]))
        else:
            dt, dp, ds, dsrc = decode_rows([seqs[i] for i in ones], osrc, bs, dec_bt)
        tok[pb:pb + D], pos[pb:pb + D], slot[pb:pb + D], lens[:D] = dt, dp, ds, dp + 1
        fed = dsrc >= 0
        ph_rows[:D] = np.where(fed, pb + np.arange(D), -1)
        ph_src[:D] = np.maximum(dsrc, 0)
        for j, i in enumerate(ones):
            if i < R or shares[i - R].sample:
                head_at[i] = cb + j
    return Placed(pb, db, head_at, o["dec_bt"] + db * MB)


def event_ns(run: Callable[[], None], reps: int) -> list[float]:
    """The device time of each of `reps` runs, ns (CUDA events on the current stream, one run at a time)."""
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e6)
    return out


def least_ns(replay: Callable[[], None], reps: int) -> float:
    """The least device time of `reps` replays, ns."""
    return min(event_ns(replay, reps))


class MixedGraphs:
    """The graphs of every (Pb, Db) bucket pair over one static input buffer (see the module docstring)."""

    def __init__(self, pbs: tuple[int, ...], dbs: tuple[int, ...], max_blocks: int, block_size: int, vocab: int,
                 device: torch.device, split: bool, heads: int = 0):
        self.pbs, self.dbs = pbs, tuple(sorted(set((0,) + tuple(dbs))))
        self.heads = heads  # > 0: steps whose prompt attention would split its key segments run eagerly
        self.block_size, self.device, self.split = block_size, device, split
        pmax, dmax = max(pbs), max(self.dbs)
        self.reg = Regions(N=pmax + dmax, D=dmax, C=head_slots(pmax), T=tile_slots(pmax), MB=max_blocks)
        end = self.reg.offsets["end"]
        self.dev = torch.zeros(end, dtype=torch.int32, device=device)
        self.hosts = [torch.zeros(end, dtype=torch.int32).pin_memory() for _ in range(2)]
        self.inert()
        self.events = [None, None]
        self.turn = 0
        self.rows = torch.arange(pmax + dmax, dtype=torch.int64, device=device)  # constant row indices
        self.logits = torch.empty(head_slots(pmax) + dmax, vocab, dtype=torch.float32, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def inert(self) -> None:
        """Inert padding everywhere, host and device (nothing in flight: at construction, or the boot's cost
        replays, which must not read a real step's layout through another bucket's rows)."""
        pmax, dmax = max(self.pbs), max(self.dbs)
        for hb in self.hosts:
            layout([], None, pmax, dmax, self.block_size, self.reg, hb.numpy())
        self.dev.copy_(self.hosts[0])

    def meta(self, pb: int, db: int) -> Meta:
        """The (pb, db) view of the static inputs (built inside the capture: the int64 conversions are nodes)."""
        o, MB = self.reg.offsets, self.reg.MB
        cb, tb, N = head_slots(pb), tile_slots(pb), pb + db
        d = self.dev
        v = lambda name, n: d[o[name]:o[name] + n]  # noqa: E731
        dec = db > 0
        return Meta(
            tokens=v("tokens", N), positions=v("positions", N), slots=v("slots", N),
            dec_rows=self.rows[pb:N] if dec else None,
            dec_bt=v("dec_bt", db * MB).view(db, MB) if dec else None,
            dec_lens=v("dec_lens", db) if dec else None,
            prefill=[(0, pb, None, 0)],  # prompt rows present (the matmuls' prompt numerics); attention: the tiles
            out_rows=torch.cat([v("p_head", cb).long(), self.rows[pb:N]]),
            pf_tiles=v("tiles", 4 * tb).view(tb, 4), pf_bt=v("pf_bt", cb * MB).view(cb, MB),
            pending=(v("ph_rows", db), v("ph_src", db), db) if dec else None,
            split=(pb, cb) if self.split else None, dec_from=pb if dec else None)

    def capture(self, forward: Callable[[Meta], torch.Tensor]) -> None:
        """Warm every bucket pair up on a side stream, then capture each, largest first, into one pool."""
        self.graphs.clear()
        pairs = sorted(((p, d) for p in self.pbs for d in self.dbs), key=lambda x: -(x[0] + x[1]))
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for p, d in pairs:
                self._run(forward, p, d)
        torch.cuda.current_stream(self.device).wait_stream(s)
        torch.cuda.synchronize(self.device)
        pool = None
        for p, d in pairs:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=capture_stream(self.device), capture_error_mode="thread_local"):
                self._run(forward, p, d)
            pool = g.pool()
            self.graphs[(p, d)] = g
        torch.cuda.synchronize(self.device)

    def _run(self, forward, pb: int, db: int) -> None:
        out = forward(self.meta(pb, db))  # [Cb + Db, V]
        self.logits[:out.shape[0]].copy_(out)

    def costs(self, decode: dict[int, Callable[[], None]], reps: int = 2) -> tuple[tuple[int, int, int], ...]:
        """(Pb, Db, ns) a captured pair costs more than the decode-only graph of Db (`decode`: Db -> its replay),
        each the least of `reps` replays on inert inputs (no KV written, no row read past its bucket: a real
        step's layout replayed through a smaller bucket indexes past its rows). The decode graphs' inputs must be
        inert too (the caller's). The scheduler's ITL policy plans whole buckets by these (imp.core.itl)."""
        self.inert()
        base = {db: least_ns(f, reps) for db, f in decode.items()}
        return tuple((pb, db, max(0, round(least_ns(g.replay, reps) - base[db])))
                     for (pb, db), g in sorted(self.graphs.items()) if db in base)

    def ctx_ns(self, num_blocks: int, ctx: int = 1536, reps: int = 3) -> int:
        """ns a prompt row's attention adds per 1,000 positions it reads: the largest prompt bucket up to 512 rows
        as one chunk from position ~ctx (no decode rows) against the same graph on inert inputs, over the rows'
        n x (start + n/2) positions. It reads blocks 0.. of the pool whatever they hold and writes none (slots
        -1): boot only, before any request. 0 where the pool or the block tables are too short to say."""
        pb = max((p for p in self.pbs if p <= 512), default=0)
        if not pb or (pb, 0) not in self.graphs:
            return 0
        bs = self.block_size
        start = min(ctx, num_blocks * bs - pb, self.reg.MB * bs - pb) // bs * bs
        if start < pb:
            return 0
        seq = SeqWork(seq_id="ctx", token_ids=(0,) * pb, start_pos=start,
                      block_table=tuple(range((start + pb - 1) // bs + 1)), sample=False, params=None)
        g = self.graphs[(pb, 0)]
        self.inert()
        inert = least_ns(g.replay, reps)
        h = self.hosts[0].numpy()
        layout([seq], None, pb, 0, bs, self.reg, h)
        o = self.reg.offsets
        h[o["slots"]:o["slots"] + pb] = -1  # no KV written: the rows only read
        self.dev.copy_(self.hosts[0])
        try:
            read = least_ns(g.replay, reps)
        finally:
            self.inert()
        return max(0, round((read - inert) * 1000 / (pb * (start + pb / 2))))

    def fits(self, seqs: list[SeqWork]) -> tuple[int, int] | None:
        if not self.graphs:
            return None
        return fits(seqs, self.pbs, self.dbs, self.heads)

    def replay(self, seqs: list[SeqWork], pair: tuple[int, int], src: dict[int, int] | None = None, mark=None,
               cols=None) -> tuple[torch.Tensor, dict[int, int]]:
        """logits [Cb + Db, V] (the static buffer: read before the next replay) and head_at (share -> row);
        mark(): called right before the step's first device work (the host's layout done)."""
        i_host = self.turn
        self.turn ^= 1
        if self.events[i_host] is not None:
            self.events[i_host].synchronize()  # its last copy has left (two steps back)
        host = self.hosts[i_host]
        placed = layout(seqs, src, pair[0], pair[1], self.block_size, self.reg, host.numpy(), cols)
        if mark is not None:
            mark()
        self.dev[:placed.used].copy_(host[:placed.used], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self.events[i_host] = ev
        self.graphs[pair].replay()
        return self.logits[:head_slots(pair[0]) + pair[1]], placed.head_at
