"""The decode lane: running sequences in the steady plain decode state, as arrays (issue 33, deliverable 3).

At 64-256 streams most rows of most steps are the same thing: a sequence feeds its last token (or, pipelined, the
one the step in flight samples) and samples one, nothing else asked. Planned and taken one Python object at a
time (a `Work`, the branches of `_work`, `_on_result`'s and `_sampled`'s) they were ~4 us a row of the scheduler's
host time. Here their counters live in numpy arrays indexed by a slot, and a step's rows are planned, placed
and landed with array operations: the plan carries them as columns (`decode_rows`: a StepPlan's DecodeRows), the
result brings their ids back as one (`land`), and their tokens go to the streams as one `TokenRows`; the per-row
Python left is the token appended to its sequence.

Who is in it: a running sequence in the decode state (one position to feed) whose request asks for nothing a
row must carry or bring back (`plain`): no logprobs, mirostat, lens, drafts, banned phrases, guidance, prompt
logprobs still to score, params still to send. The choices of an n > 1 request are in it (each has had its first
token, so choice 0 has released its siblings already: `_sampled`'s release is a no-op for it; a waiting sibling's
fork reads the lead's num_computed, which in the lane is a lower bound already past the prompt's blocks). A grammar's rows are in it (the executor keeps the
grammar's state; here it changes only which stop tokens end the choice), as are penalized ones where the history
goes once (`history_once`). Every decision is the general path's
(`SchedulerCore._start` / `_on_kv` / `_on_result`, `RequestBook._sampled` / `_ends`), made over the arrays:
the same tokens. The rows come first in the plan, in slot order, and their grows first in the step's KV ops (so
where the pool runs dry another sequence's grow may be the one that fails: who is preempted may differ).

While a sequence is in the lane its `num_computed`, `ahead` and `pending` are the arrays' (the Seq's fields are
stale); `tokens`, `table` and `num_reported` stay on the Seq. Whatever else touches a member goes through
`eject` first (a state change, a finish, a preemption, end_thinking: each changes its epoch, so its rows in
flight are dropped as the general path drops them) or, for a general share of it still in flight from before
it came in, `sync_out` / `sync_in` around that share's landing. A row is valid at landing while its slot still
holds the sequence it was planned for (`gen`, bumped at every insert). Pure: no clock, no I/O.
"""

from __future__ import annotations

import heapq

import numpy as np

from imp.core.core import CoreError
from imp.messages import PENDING_TOKEN, DecodeRows, KvOp, SampledToken, TokenRows

STOPS = 8  # stop tokens a member may have (EOS and a few): more, and it stays on the general path


class LaneRows:
    """A step's lane rows: their slots, each slot's generation when planned, and which of them asked the
    allocator for a grow (their KV results come first in the reply, in this order)."""

    __slots__ = ("slots", "gens", "grow")

    def __init__(self, slots: np.ndarray, gens: np.ndarray, grow: np.ndarray):
        self.slots, self.gens, self.grow = slots, gens, grow

    def __len__(self) -> int:
        return len(self.slots)


class DecodeLane:
    def __init__(self, size: int, block_size: int, max_len: int):
        self.bs, self.max_len = block_size, max_len
        z = lambda: np.zeros(size, np.int64)  # noqa: E731
        self.computed, self.ahead, self.pending, self.ntok = z(), z(), z(), z()
        self.nprompt, self.maxtok, self.cap, self.rblock, self.gen = z(), z(), z(), z(), z()
        self.stops = np.full((size, STOPS), -2, np.int64)
        self.occupied = np.zeros(size, bool)
        self.seqs: list = [None] * size
        self.rids: list = [None] * size  # each member's request id and choice index (its TokenRows columns)
        self.index = z()
        self._free = list(range(size))  # a heap: the lowest free slot first (deterministic)

    def __len__(self) -> int:
        return len(self.seqs) - len(self._free)

    @staticmethod
    def plain(s, spec_k_max: int, history_once: bool) -> bool:
        """Whether a running sequence's rows ask for nothing beyond a token fed and one sampled (see above)."""
        p = s.params
        return (s.shadow is None and s.guided is None and s.watch is None and not s.bans and not s.spec_inflight
                and not s.send_params and s.opened and not s.swapped and p.logprobs < 0
                and not p.mirostat and p.logit_lens <= 0 and not (p.drafts and spec_k_max)
                and (p.prompt_logprobs < 0 or s.plp_sent) and (history_once or not s.hist)
                and len(p.stop_token_ids) <= STOPS)

    # ------------------------------------------------------------------ membership

    def insert(self, s) -> None:
        i = heapq.heappop(self._free)
        s.lane, self.seqs[i], self.rids[i], self.index[i] = i, s, s.req.id, s.index
        self.occupied[i] = True
        self.gen[i] += 1
        self.sync_in(s)
        p = s.params
        self.nprompt[i], self.maxtok[i] = s.n_prompt, p.max_tokens
        self.stops[i] = -2
        # (`_ends`' rule: ignore_eos without a grammar, no stop token ends it; a grammar ends at EOS all the same)
        stops = () if p.ignore_eos and not p.constrained else p.stop_token_ids
        self.stops[i, :len(stops)] = stops

    def eject(self, s) -> None:
        """s leaves: its counters back on the Seq, its slot free (its rows in flight are dropped at landing)."""
        i = s.lane
        if i < 0:
            return
        self.sync_out(s)
        self.seqs[i], self.rids[i], self.occupied[i], s.lane = None, None, False, -1
        heapq.heappush(self._free, i)

    def sync_out(self, s) -> None:
        i = s.lane
        s.num_computed, s.ahead, s.pending = int(self.computed[i]), int(self.ahead[i]), int(self.pending[i])

    def sync_in(self, s) -> None:
        i = s.lane
        self.computed[i], self.ahead[i], self.pending[i] = s.num_computed, s.ahead, s.pending
        self.ntok[i], self.cap[i], self.rblock[i] = len(s.tokens), len(s.table) * self.bs, s.num_reported // self.bs

    # ------------------------------------------------------------------ a step

    def plan(self, budget: int, ops: list) -> LaneRows:
        """The members that feed a row this step (at most `budget`, lowest slots first), their counters moved on
        as the general path's plain decode row moves them; a grow op for each whose table must grow or whose
        written block filled up (appended to ops, in row order)."""
        vlen = self.ntok + self.pending
        start = self.computed + self.ahead
        m = self.occupied & (vlen - start == 1)
        # pipelined: the token in flight is its last (max_tokens or the context): nothing more to feed
        m &= ~((self.pending > 0) & ((vlen - self.nprompt >= self.maxtok) | (vlen >= self.max_len)))
        slots = np.flatnonzero(m)[:budget]
        bs = self.bs
        grow = (vlen[slots] > self.cap[slots]) | (self.computed[slots] // bs != self.rblock[slots])
        for i, pos in zip(slots[grow].tolist(), vlen[slots[grow]].tolist()):
            s = self.seqs[i]
            c = int(self.computed[i])
            ops.append(KvOp("grow", s.id, pos, tuple(s.tokens[s.num_reported:c])))  # (as `_grow_op`)
            s.num_reported = c
            self.rblock[i] = c // bs
        self.ahead[slots] += 1
        self.pending[slots] += 1
        return LaneRows(slots, self.gen[slots], grow)

    def placed(self, rows: LaneRows, results) -> list:
        """The allocator's answers to the rows' grows (the reply's first results): tables taken, and the
        sequences whose grow failed (they sit this step out: `settle`)."""
        failed, g = [], rows.grow
        for i, gen in zip(rows.slots[g].tolist(), rows.gens[g].tolist()):
            res = next(results)
            if not self.occupied[i] or self.gen[i] != gen:
                continue  # ended (a cancel, a timeout) since planning: it left the lane, its answer is moot
            s = self.seqs[i]
            if res.ok:
                s.table = res.block_table
                self.cap[i] = len(s.table) * self.bs
            else:
                failed.append(s)
        return failed

    def settle(self, rows: LaneRows, failed: list) -> LaneRows:
        """The rows that run, once preemptions are done: a member preempted meanwhile is gone from its slot; one
        whose grow failed (and still runs) gives its row back."""
        keep = self._valid(rows)
        out = [s.lane for s in failed if s.lane >= 0]
        if out:
            self.ahead[out] -= 1
            self.pending[out] -= 1
            keep &= ~np.isin(rows.slots, out)
        return rows if keep.all() else LaneRows(rows.slots[keep], rows.gens[keep], rows.grow[keep])

    def _valid(self, rows: LaneRows) -> np.ndarray:
        """Which rows' slots still hold the sequence each was planned for."""
        return self.occupied[rows.slots] & (self.gen[rows.slots] == rows.gens)

    def members(self, rows: LaneRows) -> list:
        """The sequences whose rows these still are."""
        return [self.seqs[i] for i in rows.slots[self._valid(rows)].tolist()]

    def decode_rows(self, rows: LaneRows) -> DecodeRows:
        """The rows' shares as the plan's columns: one token at start (PENDING_TOKEN when the step in flight samples
        it), sampled at generated index start + 1 - n_prompt, its table as the last KvReply gave it, nothing else."""
        seqs, sl = self.seqs, rows.slots
        start = self.computed[sl] + self.ahead[sl] - 1
        tok = np.full(len(sl), PENDING_TOKEN, np.int64)
        known = np.flatnonzero(start < self.ntok[sl])  # (a result may have landed since planning)
        if len(known):
            tok[known] = [seqs[i].tokens[st] for i, st in zip(sl[known].tolist(), start[known].tolist())]
        ss = [seqs[i] for i in sl.tolist()]
        cols = np.stack([tok, start, start + 1 - self.nprompt[sl]], axis=1).astype("<i8")
        return DecodeRows(tuple([s.id for s in ss]), tuple([s.table for s in ss]), cols.tobytes())

    def land(self, rows: LaneRows, ids: np.ndarray, out: list, ends) -> None:
        """A landed step's rows (ids: each row's sampled token, int64 [len(rows)], -1 for none): the still valid
        ones computed one more position and sampled one token each; a token that ends its choice goes to
        `ends(s, t)` (the general path: eject, `_sampled`), every other one is appended and goes out in one TokenRows.
        A valid row without its token is the executor's bug."""
        if len(ids) != len(rows):
            raise CoreError(f"{len(ids)} row ids for a step of {len(rows)} lane rows")
        valid = self._valid(rows)
        sl, ids = rows.slots[valid], ids[valid]
        if not len(sl):
            return
        seqs = self.seqs
        if (ids < 0).any():
            raise CoreError(f"a step sampled nothing for {seqs[int(sl[np.flatnonzero(ids < 0)[0]])].id}")
        self.computed[sl] += 1
        self.ahead[sl] -= 1
        self.pending[sl] -= 1
        if not (self.computed[sl] == self.ntok[sl]).all():
            raise CoreError("a lane row landed off its sequence's end")
        n = self.ntok[sl] + 1
        fin = ((self.stops[sl] == ids[:, None]).any(1) | (n - self.nprompt[sl] >= self.maxtok[sl])
               | (n >= self.max_len))
        self.ntok[sl] = n
        go = ~fin
        if go.any():  # the rows' tokens as one TokenRows (before the ends' TokenOuts: other choices, any order)
            psl, pids = sl[go], ids[go]
            for i, t in zip(psl.tolist(), pids.tolist()):
                seqs[i].tokens.append(t)
            out.append(("detok", TokenRows(tuple([self.rids[i] for i in psl.tolist()]),
                                           np.stack([self.index[psl], pids], 1).astype("<i8").tobytes())))
        for i, t in zip(sl[fin].tolist(), ids[fin].tolist()):
            s = seqs[i]
            ends(s, SampledToken(seq_id=s.id, token_id=t))

    def land_share(self, s, n: int, sample: bool, t, out: list, ends) -> None:
        """A general share of member s planned before it joined (n positions, the last sampled when `sample`: its
        prompt's or, after a preemption, its recompute's last chunks), landed on the arrays: the positions before
        the sampled one counted here, the sampled one as `land` takes a row."""
        i = s.lane
        self.computed[i] += n - sample
        self.ahead[i] -= n - sample
        if sample:
            sl = np.array([i])
            self.land(LaneRows(sl, self.gen[sl], np.zeros(1, bool)), np.array([t.token_id if t is not None else -1]),
                      out, ends)
