"""Scheduler: continuous batching, one step at a time.

A step is three messages: KvRequest -> kv (frees, then grows of running
sequences, then allocs/forks of waiting ones), KvReply -> StepPlan to the
executor, StepResult -> tokens out, requests finished. The scheduler is idle
only when there is nothing to run; otherwise every reply starts the next step
(docs/STEP.md: every message of a step, in order). A request's life (finish
decisions, cancels, preemption, n > 1) is `RequestBook`'s, imp/core/lifecycle.py.

Each step, under max_step_tokens and max_batch_size: running sequences first,
decodes before prefill chunks (chunked prefill), then waiting sequences in
order. Waiting order is `priority` (lower first, strict), then shortest
prompt first with aging:

    score = len(prompt) - age_ns * max_context // aging_ns

Prompts are 1 .. max_context-1 tokens, so the scores of two requests that
arrived aging_ns apart differ by more than any two prompt lengths: **a
request is never passed over by a request of its priority that arrived
aging_ns or more after it.** The queue head that does not fit (reservations,
or the allocator refuses it) blocks those behind it, so that bound holds.

A request starts only while the admission reservations of the running ones
(plus its own) fit the pool. When a decode cannot grow (the pool is dry), the
worst running sequence (highest priority number, then newest) is preempted:
its blocks freed, it waits again and is recomputed later, prompt plus
generated tokens; gen_index carries on, so it samples the same tokens.

Pipelining (pipeline_depth 2): the next step is planned as soon as one is
sent to the executor, so the GPU never waits for the host. A sequence whose
sampled token is still in flight feeds PENDING_TOKEN (the executor fills in
what the previous step sampled) and its stop is seen one step late: that
step's token is dropped. Every in-flight share of a step carries the
sequence's epoch; preemption, leaving RUNNING and end_thinking start a new
epoch, and results of an older one are ignored (their KV positions are
written again). Stale writes are harmless: a step writes only positions past
the sequence's reported ones, in blocks it owns, and the executor runs steps
in order, so a block freed and handed to another sequence is written by its
new owner after the stale write.

Speculation (spec_k_max > 0, a sequence whose params ask for it): a decode row may feed drafted
tokens after its last one (imp.core.spec, from the sequence's own tokens), one share of 1 + k
positions; the executor samples each as decoding would and keeps the draft up to its first miss
(SampledToken.accepted). num_computed then moves by 1 + kept: the positions of rejected drafts are
written again by the next step before anything reads them. Drafts take only what the step's token
budget and the free blocks leave after one row and one block per running sequence, so they never
hold a decode back or cause a preemption. Nothing more is planned for a sequence while its verify
is in flight (how far it got is unknown); pipelined, a sequence that would draft waits a step for
its token in flight instead of feeding PENDING_TOKEN.
"""

from __future__ import annotations

import collections
import heapq
import itertools

import msgspec
import numpy as np

from imp.core.core import CoreError, Out
from imp.core.guide import paired_share, unpaired
from imp.core.itl import ItlBudget
from imp.core.lane import DecodeLane, LaneRows
from imp.core.lifecycle import RequestBook
from imp.core.schedstate import Phase, SchedulerConfig, Seq, Status, Work
from imp.core.spec import Drafter, StepCost
from imp.messages import (
    Cancel, EndThinking, Enqueue, Figures, FinishReason, KvFigures, KvOp, KvReady, KvReply, KvRequest, Msg, PENDING_TOKEN,
    QueueFigures, SessionClose, SeqWork, StepFailed, StepPlan, StepResult, StepStats, Tick, TokenBatch, TokenOut, TokenRows,
    TokenTexts,
)

__all__ = ["SchedulerConfig", "SchedulerCore"]


class SchedulerCore(RequestBook):
    """The step: plan it (`_start`), place it once the allocator answered (`_on_kv`), take its
    result (`_on_result`); the requests' bookkeeping is `RequestBook`'s."""

    name = "scheduler"

    def __init__(self, config: SchedulerConfig):
        super().__init__(config)
        self.freed: list[str] = []  # for the next StepPlan
        self.batch: list[Work] = []  # the step being prepared (phase KV)
        self.new_budget = 0  # of the step being prepared: tokens its new shares may still compute (_on_kv)
        # sent to the executor: (step, its general shares, its lane rows or None)
        self.inflight: collections.deque[tuple[int, list[Work], LaneRows | None]] = collections.deque()
        self.phase = Phase.IDLE
        self.stalled = False  # a planned step came to nothing while another ran: wait for news
        self.tier_wait = False  # an alloc waits for the disk tier's blocks: a stalled plan waits for KvReady
        self.step = 0
        self.kv = KvFigures(config.num_blocks, config.num_blocks, 0, 0, 0, config.block_size)
        self.itl = ItlBudget(config.itl_target_ns, config.block_size, config.max_step_tokens, config.itl_ratio,
                             config.prompt_step_ns, config.prompt_ctx_ns, config.prompt_ctx_by)
        self.backlog = 0  # of the step being planned: prompt tokens not yet computed (the ratio policy's term)
        self.cost = StepCost()  # what a step's rows cost: how long a draft still pays (imp.core.spec)
        # the steady plain decode rows as arrays (imp.core.lane); the lane rows of the step being prepared
        self.lane = DecodeLane(config.max_batch_size, config.block_size, self.max_len) if config.decode_lane else None
        self.lane_rows: LaneRows | None = None
        self._lane_n = 0

    def handle(self, sender: str, msg: Msg) -> Out:
        out: Out = []
        self.stalled = self.stalled and isinstance(msg, KvReply)
        if isinstance(msg, Enqueue):
            self._advance(msg.submit.arrival_ns, out)
            self._enqueue(msg, out)
        elif isinstance(msg, Cancel):
            r = self.requests.get(msg.req_id)  # unknown: it finished already
            if r is not None:
                self.cancellations += msg.reason is FinishReason.CANCELLED
                self._end(r, msg.reason, out, index=msg.index)
        elif isinstance(msg, EndThinking):
            r = self.requests.get(msg.req_id)  # unknown: it finished already
            if r is not None:
                self._end_thinking(r, msg.token_ids, out)
        elif isinstance(msg, Tick):
            self._advance(msg.now_ns, out)
        elif isinstance(msg, SessionClose):
            self._close_session(msg.session_id)
        elif isinstance(msg, TokenTexts):
            self._texts(msg)
        elif isinstance(msg, KvReady):
            self.tier_wait = False  # tier blocks landed: the allocs that waited for them are tried below
        elif isinstance(msg, KvReply):
            self._on_kv(msg, out)
        elif isinstance(msg, StepResult):
            self._on_result(msg, out)
        elif isinstance(msg, StepFailed):
            self._on_failed(msg, out)
        else:
            raise CoreError(f"scheduler cannot handle {type(msg).__name__}")
        self._start(out)
        return _batch_tokens(out)

    # ------------------------------------------------------------------ step

    def _start(self, out: Out) -> None:
        """Plan the next step's allocator ops, if idle and there is anything to do."""
        c = self.config
        if self.phase is not Phase.IDLE or len(self.inflight) >= c.pipeline_depth or (
                self.stalled and (self.inflight or self.tier_wait)):
            return  # (stalled: nothing could run; wait for news: a step landing, the tier's blocks, a request)
        ops, self.frees, self.batch = self.frees, [], []
        budget = c.max_step_tokens
        n_prompt = lambda s: s.n_prompt  # noqa: E731
        spare = self._spec_spare(budget)  # (draft tokens, KV blocks) drafts may take: never a decode row's
        running, max_batch = self.running, c.max_batch_size
        if self.lane is not None:  # the lane's rows first (decodes all): sequences that came to plain decoding join
            lane = self.lane
            if len(lane) < len(running):  # (all of them in it: the general path plans none)
                for s in running:
                    if s.lane < 0 and len(s.tokens) + s.pending - s.num_computed - s.ahead == 1 and lane.plain(
                            s, c.spec_k_max, c.history_once):
                        lane.insert(s)
                running = [s for s in running if s.lane < 0]
            else:
                running = []
            self.lane_rows = lane.plan(budget, ops)
            budget -= len(self.lane_rows)
        n_lane = self._lane_n = len(self.lane_rows) if self.lane is not None else 0
        decodes = n_lane  # decode rows planned so far: they come first
        if self.itl.ratio:  # the waiting prompts and the running ones' uncomputed parts (a decode row's 1 is none)
            self.backlog = sum(len(s.tokens) - s.num_computed for s in self.waiting) + sum(
                r for s in running if (r := len(s.tokens) + s.pending - s.num_computed - s.ahead) > 1)
        batch, grow_op = self.batch, self._grow_op
        for s in sorted(running, key=lambda s: len(s.tokens) + s.pending - s.num_computed - s.ahead > 1):
            if budget == 0 or len(batch) + n_lane == max_batch:  # decodes first, then prefill chunks
                break
            if s.spec_inflight or s.guided is not None:
                continue  # a verify in flight: how many positions it keeps is unknown; a shadow: with its choice
            start, vlen = s.num_computed + s.ahead, len(s.tokens) + s.pending
            if vlen - start == 1 and not spare[0] and s.shadow is None and not (
                    s.pending and (vlen - s.n_prompt >= s.params.max_tokens or vlen >= self.max_len)):
                # a plain decode row (most rows of most steps): what the general path below gives it
                op = grow_op(s, vlen)
                if op is not None:
                    ops.append(op)
                batch.append(Work(s, 1, op is not None, start=start, sample=True))
                s.ahead += 1
                s.pending += 1
                budget -= 1
                decodes += 1
                continue
            if s.pending and spare[0] and vlen - start == 1 and self._would_draft(s):
                continue  # pipelined: a draft needs the token in flight; this step waits for it
            if s.pending and (vlen - n_prompt(s) >= s.params.max_tokens or vlen >= self.max_len):
                continue  # the token in flight is its last
            if vlen - start > 1 and decodes and budget > (room := self._prompt_room(budget, decodes, start)):
                budget = room  # the first prefill chunk beside decode rows: the ITL target's share
                if budget == 0:
                    break
            decodes += vlen - start == 1
            n = min(vlen - start, budget)
            gn = 0
            if s.shadow is not None:  # classifier-free guidance: it samples only beside its shadow (imp.core.guide)
                n, gn, _ = paired_share(s, start, vlen, n, budget, c.max_batch_size - len(self.batch))
                if n == 0 and gn == 0:
                    continue
            draft = self._draft(s, start, vlen, spare) if spare[0] and vlen - start == 1 and not s.pending else ()
            if draft:
                spare[0] -= len(draft)
                s.spec_inflight = True
            shares = []
            if n:  # (a guided choice may sit out while its shadow catches up: then no op of its own, no share)
                op = self._grow_op(s, start + n + len(draft))
                ops += [op] if op else []
                shares.append(Work(s, n + len(draft), op is not None, start=start, sample=start + n == vlen,
                                   draft=draft))
            if gn:
                shares.append(self._shadow_work(s.shadow, gn, ops))
            for w in shares:
                w.seq.ahead, w.seq.pending = w.seq.ahead + w.n, w.seq.pending + w.sample
                self.batch.append(w)
                budget -= w.n
        if decodes:  # new prompts beside decode rows: what is left of the ITL target's share (new prompts start at
            # 0 before their cached part is known; the cost of the chunks planned so far is read at the first's start)
            first = next((w.start for w in self.batch if w.n - len(w.draft) > 1), 0)
            budget = min(budget, self._prompt_room(budget, decodes, first))
        reserved, counted, slots = self._reserved(), set(), c.max_batch_size - len(self.running)
        self.new_budget = budget  # what the new shares may compute once their cached part is known
        budget += max(0, c.admit_tokens - c.max_step_tokens)  # planning allowance for prompts the cache may hold
        # half of a guided pair whose other half runs goes first: its request is admitted (its blocks reserved),
        # and the half that runs cannot move without it (imp.core.guide); everyone else in the usual order
        for s in self._waiting_order():
            r = s.req
            if budget == 0 or slots == 0:
                break
            if r.n_running == 0 and r.id not in counted:
                if reserved + r.reserved > c.num_blocks:
                    break  # the head waits for room; nothing behind it jumps ahead
                reserved += r.reserved
                counted.add(r.id)
            lead = r.seqs[0]
            if s.swapped:  # preempted with its KV parked: back from the swap area, nothing computed again
                ops.append(KvOp("swap_in", s.id, len(s.tokens), tuple(s.tokens), salt=self._salt(s)))
            elif (s.index > 0 and s.guided is None and len(s.tokens) == len(r.prompt) and lead.status is Status.RUNNING
                    and lead.num_computed >= (len(r.prompt) - 1) // c.block_size * c.block_size):
                ops.append(KvOp("fork", s.id, len(s.tokens), tuple(s.tokens), parent=lead.id, salt=r.salt))
            else:
                ops.append(KvOp("alloc", s.id, len(s.tokens), tuple(s.tokens), salt=self._salt(s)))
            n = min(len(s.tokens) - s.swapped, budget)
            s.send_params = True  # with its first share, whichever step that is (admitted past the budget: later)
            self.batch.append(Work(s, n, True, new=True))
            budget -= n
            slots -= 1
        if ops or self.batch or n_lane:
            self.step += 1
            self.freed += [op.seq_id for op in ops if op.kind == "free"]
            self.phase = Phase.KV
            out.append(("kv", KvRequest(self.step, tuple(ops))))

    def _on_kv(self, msg: KvReply, out: Out) -> None:
        self._check(Phase.KV, msg.step)
        self.kv = msg.figures
        results, failed, shut_out = iter(msg.results), [], []
        rows, n_lane = self.lane_rows, self._lane_n
        lane_failed = self.lane.placed(rows, results) if n_lane else []  # (the lane's grows come first)
        failed += lane_failed
        # a new share that starts past a cached prefix reads that context: with the ITL policy's attention term
        # its chunk beside decode rows is sized at its start (planning knew only position 0)
        decodes = n_lane + sum(1 for w in self.batch if w.n == 1 and w.sample and not w.new) if self.itl.ctx_ns else 0
        planned = sum(w.n for w in self.batch if not w.new) + n_lane - decodes
        for w in self.batch:
            s, res = w.seq, next(results) if w.has_result else None
            if w.new:
                if not res.ok:  # still waiting: no room (the allocator refused all behind it too), or
                    self.tier_wait = self.tier_wait or res.loading  # res.wait: its next prompt block is being
                    if not res.wait and (s.guided or s.shadow):  # computed by another sequence, or (res.loading)
                        shut_out.append(s)  # read from the disk tier. Half a guided pair without room: below
                    continue
                s.in_kv, s.table = True, res.block_table
                if s.swapped:
                    self._swapped_in(s)
                s.num_computed = s.num_reported = res.cached_tokens
                if s.status is Status.FINISHED:  # ended while the op was in flight
                    self._free(s)
                    continue
                if s.index == 0 and s.guided is None and s.req.cached_tokens < 0:
                    s.req.cached_tokens = res.cached_tokens
                self._set(s, Status.RUNNING)
                w.start, w.epoch = s.num_computed, s.epoch
                w.n = min(w.n, len(s.tokens) - w.start, self.new_budget)  # the cached part is free
                if decodes and w.start:
                    w.n = max(0, min(w.n, self.itl.cap(self.backlog, decodes, w.start) - planned))  # cap >= 1 block
                if s.shadow is not None or s.guided is not None:  # a guided pair samples only together
                    w.n = min(w.n, len(s.tokens) - 1 - w.start)
                self.new_budget -= w.n
                planned += w.n
                w.sample = w.start + w.n == len(s.tokens)
                s.ahead, s.pending = w.n, int(w.sample)
            elif res is not None and s.status is Status.RUNNING and w.epoch == s.epoch:
                if res.ok:
                    s.table = res.block_table
                else:
                    failed.append(s)
        self._preempt_for(failed)
        for x in shut_out:  # half a guided pair must not hold blocks while the other half cannot get any
            partner = x.guided or x.shadow  # (imp.core.guide): both wait
            if partner.status is Status.RUNNING:
                self._preempt(partner)
            choice = x.guided or x
            bs, g = self.config.block_size, choice.shadow
            if choice.status is not Status.FINISHED and (-(-(len(choice.tokens) + 1) // bs) - (-(len(g.tokens) + 1) // bs)
                                                         > self.config.num_blocks):
                self._end(choice.req, FinishReason.LENGTH, out)  # the pair no longer fits the whole pool: it ends
        keep = []
        if any(w.seq.shadow is not None or w.seq.guided is not None for w in self.batch):  # guided pairs
            lost = unpaired([w for w in self.batch if w.seq not in failed and w.seq.status is Status.RUNNING
                             and w.epoch == w.seq.epoch and not (w.new and w.n == 0)])
            failed += [x for x in lost if x not in failed]
        for w in self.batch:
            s = w.seq
            if w.draft:  # a verify that does not run (preempted, or its grow failed) holds nothing back
                s.spec_inflight = False
            if s.status is Status.RUNNING and w.epoch == s.epoch:
                if w.new and w.n == 0:  # admitted (KV allocated) past this step's budget: computes from the next
                    continue
                if s not in failed:
                    keep.append(w)
                    s.spec_inflight = bool(w.draft)
                else:  # its grow failed: it sits this step out
                    s.ahead, s.pending = s.ahead - w.n, s.pending - w.sample
        self.batch, self.phase, self.lane_rows = [], Phase.IDLE, None
        if n_lane:
            rows = self.lane.settle(rows, lane_failed)
            n_lane = len(rows)
        if not keep and not n_lane:  # frees only, or nothing could run: try again (after the step in flight lands)
            self.stalled = True
            out.append(("metrics", self._figures()))
            return
        self.inflight.append((self.step, keep, rows if n_lane else None))
        works = tuple([self._work(w) for w in keep])
        out.append(("executor", StepPlan(self.step, works, tuple(self.freed),
                                         self.lane.decode_rows(rows) if n_lane else None)))
        self.freed = []

    @staticmethod
    def _salt(s) -> str:
        """Its prefix cache key's salt: prompt logprobs need every prompt row forwarded, so a salt of its own
        makes the cache miss (its own recompute may still hit)."""
        r = s.req
        return r.salt if s.params.prompt_logprobs < 0 else f"{r.salt}\0plp\0{r.id}"

    def _on_result(self, msg: StepResult, out: Out) -> None:
        batch, rows = self._landed(msg.step)
        sampled = {t.seq_id: t for t in msg.tokens}
        n_tokens = n_decode = fed = drafted = accepted = verifies = misses = 0
        running = Status.RUNNING
        ends = lambda s, t: self._ends_member(s, t, out)  # noqa: E731 (a lane row's token that ends its choice)
        if rows is not None:  # the lane's rows (first in the plan): decode rows all, their ids a column
            self.lane.land(rows, np.frombuffer(msg.row_ids, "<i8"), out, ends)
            n_tokens = n_decode = len(rows)
        for w in batch:
            s, n, draft = w.seq, w.n, w.draft
            n_tokens += n
            if draft:
                n_decode += n - len(draft) == 1 and w.sample
                fed += len(draft)
                s.spec_inflight = False
            else:
                n_decode += n == 1 and w.sample
            if s.status is not running or w.epoch != s.epoch:
                continue  # ended, preempted or redirected while the step ran: its results are dropped
            if s.lane >= 0:  # a share from before it joined the lane: its counters are the lane's
                if draft:  # (a member drafts nothing, and joins with no verify in flight)
                    raise CoreError(f"{s.id} joined the lane with a verify in flight")
                self.lane.land_share(s, n, w.sample, sampled.get(s.id), out, ends)
                continue
            t = sampled.get(s.id)
            kept = len(t.accepted) if draft and t is not None else 0
            s.num_computed += n - len(draft) + kept if draft else n  # rejected drafts' positions are written again
            s.ahead, s.pending = s.ahead - n, s.pending - w.sample
            if t is not None and t.prompt and not s.plp_sent:
                last = s.plp[-1].position if s.plp else 0
                s.plp += [e for e in t.prompt if e.position > last]  # a recompute scores again
            if w.sample and s.guided is not None:
                continue  # a shadow's row served its choice's draw; its tokens are the choice's (lifecycle)
            if w.sample:
                if t is None or s.num_computed != len(s.tokens) + kept or kept > len(w.draft):
                    raise CoreError(f"step {msg.step} sampled nothing for {s.id} at {s.num_computed}")
                if w.draft:
                    s.drafter.observe(len(w.draft), kept)
                    s.spec_drafted, s.spec_accepted, s.spec_verifies = (s.spec_drafted + len(w.draft),
                                                                        s.spec_accepted + kept, s.spec_verifies + 1)
                    drafted, accepted, verifies, misses = (drafted + len(w.draft), accepted + kept, verifies + 1,
                                                           misses + (kept == 0))
                self._sampled(s, t, out)
        self.steps += 1
        cost = msg.cost_ns  # the device's own time where measured: pipelined, the wall also holds the step before
        self.itl.observe(cost, n_tokens - n_decode, n_decode)
        if self.config.spec_k_max and n_tokens == n_decode + fed:  # decode and draft rows only: their cost
            self.cost.observe(n_tokens, cost)
        out.append(("metrics", StepStats(msg.step, len(batch), n_tokens, n_decode, cost, drafted, accepted,
                                         verifies, misses)))
        self._advance(msg.now_ns, out)
        out.append(("metrics", self._figures()))

    def _ends_member(self, s: Seq, t, out: Out) -> None:
        """A lane row's token that ends its choice: the general path ends it."""
        self.lane.eject(s)
        self._sampled(s, t, out)

    def _on_failed(self, msg: StepFailed, out: Out) -> None:
        batch, rows = self._landed(msg.step)
        for s in self.lane.members(rows) if rows is not None else ():
            if s.status is Status.RUNNING:
                self._end(s.req, FinishReason.ERROR, out, error=msg.error)
        for w in batch:  # their KV may be garbage: the free reports nothing of this step
            w.seq.spec_inflight = w.seq.spec_inflight and not w.draft
            if w.seq.status is Status.RUNNING and w.epoch == w.seq.epoch:
                self._end(w.seq.req, FinishReason.ERROR, out, error=msg.error)
        self._advance(msg.now_ns, out)
        out.append(("metrics", self._figures()))

    def _work(self, w: Work) -> SeqWork:
        s, p = w.seq, w.seq.params
        start, end, sample = w.start, w.start + w.n, w.sample
        n_prompt, known = s.n_prompt, len(s.tokens)
        n_gen = max(known, end) - n_prompt
        sent = p if s.send_params else None  # the executor keeps them from the first share of an admission
        s.send_params = False
        # mirostat: its state with the first share of an admission (2 tau before any draw); the runner keeps it
        mu = (2.0 * p.mirostat_tau if s.mu is None else s.mu) if sent is not None and p.mirostat else None
        if w.draft:  # a verify: the last known token and the draft; it samples generated token known - n_prompt
            hist = tuple(s.tokens[n_prompt:known]) if s.hist and (sent is not None or
                                                                 not self.config.history_once) else ()
            return SeqWork(s.id, (s.tokens[start], *w.draft), start, s.table, True, sent, gen_index=known - n_prompt,
                           history=hist, draft=len(w.draft), mu=mu)
        banned = s.bans.get(n_gen, ()) if sample and s.bans else ()  # a rewind's bans at the index it samples
        if p.prompt_logprobs >= 0 and s.index == 0 and not s.plp_sent and end <= n_prompt:
            nxt = s.tokens[end] if end < n_prompt else -1
            return SeqWork(s.id, tuple(s.tokens[start:end]), start, s.table, sample, sent, gen_index=n_gen,
                           prompt_logprobs=p.prompt_logprobs, prompt_next=nxt, mu=mu, banned=banned)
        toks, pending = tuple(s.tokens[start:end]), max(0, end - known)  # a result may have landed since planning
        if pending:  # depth 2: only the token the step in flight samples is unknown
            if pending > 1 or w.n != 1:
                raise CoreError(f"{s.id}: {pending} unknown tokens in a {w.n}-token share")
            toks = (PENDING_TOKEN,)
        # s.table is a KvReply's tuple: shared, not copied
        if not s.hist:
            hist = ()
        elif self.config.history_once:  # with the first share only: every generated token known (the executor
            hist = tuple(s.tokens[n_prompt:known]) if sent is not None else ()  # keeps it, appends its samples)
        else:
            hist = tuple(s.tokens[n_prompt:end]) if sample else ()
        guide = s.shadow.id if sample and s.shadow is not None else ""  # paired: its shadow samples beside it
        return SeqWork(s.id, toks, start, s.table, sample, sent, gen_index=n_gen, history=hist, pending=pending, mu=mu,
                       banned=banned, guide=guide)

    # ------------------------------------------------------------------ helpers

    def _spec_spare(self, budget: int) -> list[int]:
        """[draft tokens, KV blocks, draft tokens a sequence] this step's drafts may take: what is left of the
        token budget once every running sequence has one row, and the free blocks beyond one per running
        sequence (a draft must never make a decode wait, nor the pool so dry that someone is preempted);
        under spec_max_rows, the rows past this step's decode rows, an even share each."""
        c = self.config
        if not c.spec_k_max:
            return [0, 0, 0]
        n = len(self.running)
        tokens, each = budget - n, c.spec_k_max
        if c.spec_max_rows:  # a verify in flight sits this step out (`_start`): it takes no row
            rows = sum(not s.spec_inflight for s in self.running)
            tokens = min(tokens, c.spec_max_rows - rows)
            each = tokens // max(1, rows)
        return [max(0, tokens), max(0, self.kv.free - n), max(0, each)]

    def _drafter(self, s: Seq) -> Drafter:
        if s.drafter is None:  # from its first decode that might draft: its prompt is indexed then
            s.drafter = Drafter(min_kept=self.config.spec_min_kept)
        return s.drafter

    def _would_draft(self, s: Seq) -> bool:
        """A speculative decode row whose known tokens end in something seen before."""
        p = s.params
        if not p.drafts or len(s.tokens) <= s.n_prompt:
            return False
        return self._drafter(s).matches(s.tokens)

    def _draft(self, s: Seq, start: int, vlen: int, spare: list[int]) -> tuple[int, ...]:
        """The drafted tokens to feed after a decode row's last token (imp.core.spec), within `spare`."""
        p = s.params
        if not p.drafts or vlen <= s.n_prompt:
            return ()
        bs = self.config.block_size
        held = len(s.table) * bs  # positions its table holds; a draft may take `spare[1]` more blocks
        cap = min(spare[2], spare[0], p.max_tokens - (vlen - s.n_prompt) - 1,
                  self.max_len - vlen - 1, max(held, -(-(start + 1) // bs) * bs) + spare[1] * bs - start - 1)
        if cap <= 0:
            return ()
        d = self._drafter(s)
        rows = self.config.max_step_tokens - spare[0]  # one a running sequence and the drafts so far
        cap = min(cap, self.cost.worth(len(self.running), rows, d.alpha))
        draft = d.propose(s.tokens, cap) if cap > 0 else ()
        spare[1] -= max(0, -(-(start + 1 + len(draft)) // bs) - max(len(s.table), -(-(start + 1) // bs)))
        return draft

    def _shadow_work(self, g: Seq, n: int, ops: list) -> Work:
        """A shadow's share of n positions from where it stands (it samples when it reaches its end: beside
        its choice, imp.core.guide)."""
        start = g.num_computed + g.ahead
        op = self._grow_op(g, start + n)
        ops += [op] if op else []
        return Work(g, n, op is not None, start=start, sample=start + n == len(g.tokens))

    def _prompt_room(self, budget: int, decodes: int, ctx: int) -> int:
        """Prompt tokens this step may still compute beside its `decodes` decode rows, its first prompt chunk
        from position ctx: the ITL target's share (`ItlBudget.cap`) less the prompt tokens already planned."""
        planned = sum(w.n for w in self.batch) + self._lane_n - decodes
        return max(0, min(budget, self.itl.cap(self.backlog, decodes, ctx) - planned))

    def _grow_op(self, s: Seq, positions: int) -> KvOp | None:
        """A grow when the table must grow or a written block filled up (to cache it)."""
        bs = self.config.block_size
        if positions <= len(s.table) * bs and s.num_computed // bs == s.num_reported // bs:
            return None
        op = KvOp("grow", s.id, positions, tuple(s.tokens[s.num_reported:s.num_computed]))
        s.num_reported = s.num_computed
        return op

    def _key(self, s: Seq) -> tuple[int, int, int, int]:
        """The admission order: priority, then the prompt's length less what its wait has earned, then arrival."""
        r = s.req
        age = self.now - r.arrival_ns
        return (r.priority, len(r.prompt) - age * self.config.max_context // self.config.aging_ns, r.order, s.index)

    def _waiting_order(self):
        """The waiting sequences in admission order, lazily: a guided pair's half whose other half runs first, then
        by `_key` — without sorting the queue every step (at 1,000 queued that was ~2 ms of host time a step).
        `_key`'s aging term moves with the clock, but by one at most between two sequences: with now x M = qA + r and
        arrival x M = uA + v (M = max_context, A = aging_ns, 0 <= r, v < A), len(prompt) - (now - arrival) x M // A
        = len(prompt) + u - q + [v > r]. The waiting list is kept sorted by (priority, len(prompt) + u, order,
        index) (`RequestBook._wkey`), so the order now is the merge of its v <= r part with its v > r part (one
        more): the same order a sort by `_key` gives, and only as much of it read as admission takes."""
        w = self.waiting
        if not w:
            return ()
        r = self.now * self.config.max_context % self.config.aging_ns
        first = [s for s in w if (s.guided or s.shadow) and s.req.n_running]
        skip = {id(s) for s in first}

        def part(later: bool):
            for s in w:
                if (s.wkey[4] > r) is later and id(s) not in skip:
                    yield s

        def key(s):
            k = s.wkey
            return k[0], k[1] + (k[4] > r), k[2], k[3]

        rest = heapq.merge(part(False), part(True), key=key)
        return itertools.chain(sorted(first, key=self._key), rest) if first else rest

    def _figures(self) -> Figures:
        q = QueueFigures(len(self.waiting), len(self.running), sum(len(s.tokens) for s in self.waiting),
                         self.preemptions, self.cancellations, self.timeouts, self.steps)
        return Figures(msgspec.structs.replace(self.kv, reserved=self._reserved()), q)

    def _check(self, phase: Phase, step: int) -> None:
        if self.phase is not phase or step != self.step:
            raise CoreError(f"step {step} arrived in phase {self.phase.name} of step {self.step}")

    def _landed(self, step: int) -> tuple[list[Work], LaneRows | None]:
        """The oldest step in flight, whose result (or failure) this is: its general shares and its lane rows."""
        if not self.inflight or self.inflight[0][0] != step:
            raise CoreError(f"result of step {step} but in flight: {[st for st, *_ in self.inflight]}")
        return self.inflight.popleft()[1:]


def _batch_tokens(out: Out) -> Out:
    """All TokenOuts of one handling travel as one TokenBatch, the decode lane's TokenRows in it as one.

    At batch 256 one message instead of 256 is most of the control plane's
    per-step cost (each message is logged and queued). Order among the
    TokenOuts, and of detok's messages, is kept; the rows stand where the first
    of them stood (a choice has at most one token a handling, so only the order
    among different choices can move).
    """
    touts, rows, first, rows_at, rest = [], [], -1, 0, []
    for rm in out:
        r, m = rm
        t = type(m)
        if r == "detok" and (t is TokenOut or t is TokenRows):
            if first < 0:
                first = len(rest)
                rest.append(None)  # the TokenBatch's place
            if t is TokenOut:
                touts.append(m)
            else:
                if not rows:
                    rows_at = len(touts)
                rows.append(m)
        else:
            rest.append(rm)
    if first < 0:
        return out
    tr = None
    if len(rows) == 1:
        tr = rows[0]
    elif rows:
        tr = TokenRows(tuple(r for m in rows for r in m.req_ids), b"".join(m.cols for m in rows))
    rest[first] = ("detok", TokenBatch(tuple(touts), tr, rows_at) if tr is not None else TokenBatch(tuple(touts)))
    return rest
