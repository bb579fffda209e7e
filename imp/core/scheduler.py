"""Scheduler: continuous batching, one step at a time.

A step is three messages: KvRequest -> kv (frees, then grows of running
sequences, then allocs/forks of waiting ones), KvReply -> StepPlan to the
executor, StepResult -> tokens out, requests finished. The scheduler is idle
only when there is nothing to run; otherwise every reply starts the next step.

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

n > 1: sibling i is f"{req_id}#{i}" with seed + i. The siblings wait (HELD)
until the first has computed the prompt, then fork its full prompt blocks.
Cancels, timeouts and executor faults end a request at once; tokens of a step
in flight for it are dropped, its blocks are freed in the next KvRequest.
"""

from __future__ import annotations

import collections
import enum

import msgspec

from imp.core.core import CoreError, Out
from imp.messages import (
    Cancel, EndThinking, Enqueue, Figures, Finished, FinishReason, KvFigures, KvOp, KvReply, KvRequest, Msg,
    PENDING_TOKEN, QueueFigures, Reject, SessionClose, SampledToken, SeqWork, StepFailed, StepPlan, StepResult, StepStats, Submit, Tick,
    TokenBatch, TokenOut,
)


class SchedulerConfig(msgspec.Struct, frozen=True):
    num_blocks: int
    block_size: int = 16
    max_context: int = 2048
    max_batch_size: int = 64
    max_step_tokens: int = 512  # token budget of one step (chunked prefill)
    request_timeout_ns: int = 0  # 0 = none
    aging_ns: int = 10_000_000_000  # waiting this long outranks any prompt length
    session_ttl_ns: int = 600_000_000_000  # an idle session's pinned prompt is released after this
    pipeline_depth: int = 1  # steps in flight at once: 2 plans step N+1 while the executor runs step N
    # prompt tokens that new requests may bring to one planning round before the KV reply says how many of
    # them the prefix cache already holds; the step itself still computes at most max_step_tokens (the new
    # shares are cut to what is left of it once their cached part is known, `_on_kv`). 0 = max_step_tokens
    # (the policy before this field: logs written then replay identically)
    admit_tokens: int = 0
    # True: a penalized (or constrained) share carries its generated-token history only with the sequence's
    # first share after each admission, as params do; the executor appends what it samples after that
    # (`imp.actors.executor.attach_state`). A full history in every share made each step O(tokens generated)
    # in the plan, its encoding and the event log (1,000-token outputs: the log grew quadratically).
    # False: every share carries it (logs written before this field replay identically)
    history_once: bool = False

    def __post_init__(self):
        if min(self.num_blocks, self.block_size, self.max_context, self.max_batch_size,
               self.max_step_tokens, self.aging_ns) < 1 or self.request_timeout_ns < 0 \
                or self.pipeline_depth not in (1, 2):
            raise ValueError(f"bad SchedulerConfig {self}")


class Status(enum.Enum):
    HELD = 0  # sibling waiting for the first sequence to compute the prompt
    WAITING = 1  # new or preempted: needs an alloc (or fork)
    RUNNING = 2  # holds blocks; gets work every step it fits
    FINISHED = 3


class Phase(enum.Enum):
    IDLE = 0  # free to plan a step (when fewer than pipeline_depth are in flight)
    KV = 1  # KvRequest sent, waiting for the KvReply


class Req:
    __slots__ = ("id", "prompt", "priority", "salt", "arrival_ns", "order", "reserved", "cached_tokens", "n_running",
                 "n_live", "seqs", "pin_key", "session_id")

    def __init__(self, m: Submit, order: int, reserved: int):
        self.id, self.prompt, self.priority, self.salt = m.req_id, m.prompt, m.priority, m.salt
        self.arrival_ns, self.order, self.reserved = m.arrival_ns, order, reserved
        self.cached_tokens = -1  # prompt tokens found in the prefix cache, at first alloc
        self.n_running = 0
        self.n_live = m.n
        self.seqs: list[Seq] = []
        # where the prompt's KV is pinned when the request ends ("" = not pinned)
        self.pin_key = (f"session:{m.session_id}" if m.session_id
                        else f"prompt:{m.req_id}" if m.cache_prompt else "")
        self.session_id = m.session_id


class Seq:
    __slots__ = ("id", "req", "index", "params", "tokens", "status", "num_computed", "num_reported", "table", "in_kv",
                 "admit_no", "plp", "plp_sent", "epoch", "ahead", "pending", "send_params")

    def __init__(self, req: Req, index: int, params):
        self.id, self.req, self.index, self.params = f"{req.id}#{index}", req, index, params
        self.tokens = list(req.prompt)  # prompt + generated
        self.status = Status.HELD
        self.num_computed = 0  # positions whose KV is written
        self.num_reported = 0  # of those, reported to kv (for prefix hashing)
        self.table: tuple[int, ...] = ()  # always a KvReply's tuple: shared with SeqWork, never copied
        self.in_kv = False  # kv holds a table for it
        self.admit_no = 0  # when it last started running (preemption picks the newest)
        self.plp: list = []  # prompt logprobs gathered during prefill (choice 0 only)
        self.plp_sent = False  # delivered with the first token: never scored again
        self.send_params = False  # its next share carries the params (the executor forgets them when freed)
        self.epoch = 0  # results of in-flight work from an older epoch are ignored
        self.ahead = 0  # positions fed by steps in flight (this epoch), beyond num_computed
        self.pending = 0  # tokens those steps will sample (0 or 1), beyond len(tokens)


class Work:
    """One sequence's share of the step being prepared or in flight: positions
    start .. start+n-1, sampling after the last when `sample`."""

    __slots__ = ("seq", "n", "has_result", "new", "start", "sample", "epoch")

    def __init__(self, seq: Seq, n: int, has_result: bool, new: bool = False, start: int = 0, sample: bool = False):
        self.seq, self.n, self.has_result, self.new = seq, n, has_result, new
        self.start, self.sample, self.epoch = start, sample, seq.epoch


class SchedulerCore:
    name = "scheduler"

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.max_len = min(config.max_context, config.num_blocks * config.block_size)
        self.requests: dict[str, Req] = {}
        self.waiting: list[Seq] = []
        self.running: list[Seq] = []
        self.frees: list[KvOp] = []  # for the next KvRequest (frees, pins, unpins)
        self.sessions: dict[str, int] = {}  # session id -> last use (ns), oldest first
        self.freed: list[str] = []  # for the next StepPlan
        self.batch: list[Work] = []  # the step being prepared (phase KV)
        self.new_budget = 0  # of the step being prepared: tokens its new shares may still compute (_on_kv)
        self.inflight: collections.deque[tuple[int, list[Work]]] = collections.deque()  # sent to the executor
        self.phase = Phase.IDLE
        self.stalled = False  # a planned step came to nothing while another ran: wait for news
        self.step = 0
        self.now = 0
        self.kv = KvFigures(config.num_blocks, config.num_blocks, 0, 0, 0, config.block_size)
        self.preemptions = self.cancellations = self.timeouts = self.steps = 0
        self._orders = self._admits = 0
        self._reserved_running = 0  # sum of reserved over requests with a running sequence (kept by _set)

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
        if self.phase is not Phase.IDLE or len(self.inflight) >= c.pipeline_depth or (self.stalled and self.inflight):
            return
        ops, self.frees, self.batch = self.frees, [], []
        budget = c.max_step_tokens
        n_prompt = lambda s: len(s.req.prompt)  # noqa: E731
        for s in sorted(self.running, key=lambda s: len(s.tokens) + s.pending - s.num_computed - s.ahead > 1):
            if budget == 0 or len(self.batch) == c.max_batch_size:  # decodes first, then prefill chunks
                break
            start, vlen = s.num_computed + s.ahead, len(s.tokens) + s.pending
            if s.pending and (vlen - n_prompt(s) >= s.params.max_tokens or vlen >= self.max_len):
                continue  # the token in flight is its last
            n = min(vlen - start, budget)
            op = self._grow_op(s, start + n)
            ops += [op] if op else []
            w = Work(s, n, op is not None, start=start, sample=start + n == vlen)
            s.ahead, s.pending = s.ahead + n, s.pending + w.sample
            self.batch.append(w)
            budget -= n
        reserved, counted, slots = self._reserved(), set(), c.max_batch_size - len(self.running)
        self.new_budget = budget  # what the new shares may compute once their cached part is known
        budget += max(0, c.admit_tokens - c.max_step_tokens)  # planning allowance for prompts the cache may hold
        for s in sorted(self.waiting, key=self._key):
            r = s.req
            if budget == 0 or slots == 0:
                break
            if r.n_running == 0 and r.id not in counted:
                if reserved + r.reserved > c.num_blocks:
                    break  # the head waits for room; nothing behind it jumps ahead
                reserved += r.reserved
                counted.add(r.id)
            lead = r.seqs[0]
            if (s.index > 0 and len(s.tokens) == len(r.prompt) and lead.status is Status.RUNNING
                    and lead.num_computed >= (len(r.prompt) - 1) // c.block_size * c.block_size):
                ops.append(KvOp("fork", s.id, len(s.tokens), tuple(s.tokens), parent=lead.id, salt=r.salt))
            else:
                # prompt logprobs need every prompt row forwarded: a salt of its own
                # makes the prefix cache miss (its own recompute may still hit)
                salt = r.salt if s.params.prompt_logprobs < 0 else f"{r.salt}\0plp\0{r.id}"
                ops.append(KvOp("alloc", s.id, len(s.tokens), tuple(s.tokens), salt=salt))
            n = min(len(s.tokens), budget)
            s.send_params = True  # with its first share, whichever step that is (admitted past the budget: later)
            self.batch.append(Work(s, n, True, new=True))
            budget -= n
            slots -= 1
        if ops or self.batch:
            self.step += 1
            self.freed += [op.seq_id for op in ops if op.kind == "free"]
            self.phase = Phase.KV
            out.append(("kv", KvRequest(self.step, tuple(ops))))

    def _on_kv(self, msg: KvReply, out: Out) -> None:
        self._check(Phase.KV, msg.step)
        self.kv = msg.figures
        results, failed = iter(msg.results), []
        for w in self.batch:
            s, res = w.seq, next(results) if w.has_result else None
            if w.new:
                if not res.ok:  # still waiting: no room (the allocator refused all behind it too), or
                    continue  # res.wait: its next prompt block is being computed by another sequence
                s.in_kv, s.table = True, res.block_table
                s.num_computed = s.num_reported = res.cached_tokens
                if s.status is Status.FINISHED:  # ended while the op was in flight
                    self._free(s)
                    continue
                if s.index == 0 and s.req.cached_tokens < 0:
                    s.req.cached_tokens = res.cached_tokens
                self._set(s, Status.RUNNING)
                w.start, w.epoch = s.num_computed, s.epoch
                w.n = min(w.n, len(s.tokens) - w.start, self.new_budget)  # the cached part is free
                self.new_budget -= w.n
                w.sample = w.start + w.n == len(s.tokens)
                s.ahead, s.pending = w.n, int(w.sample)
            elif res is not None and s.status is Status.RUNNING and w.epoch == s.epoch:
                if res.ok:
                    s.table = res.block_table
                else:
                    failed.append(s)
        for s in failed:
            # Each preemption frees at least the victim's last block, which is
            # never shared: enough for one decode to grow next step.
            if s.status is Status.RUNNING:
                victim = max(self.running, key=lambda v: (v.req.priority, v.admit_no))
                self._free(victim)
                victim.num_computed = victim.num_reported = 0
                self._set(victim, Status.WAITING)
                self.preemptions += 1
        keep = []
        for w in self.batch:
            s = w.seq
            if s.status is Status.RUNNING and w.epoch == s.epoch:
                if w.new and w.n == 0:  # admitted (KV allocated) past this step's budget: computes from the next
                    continue
                if s not in failed:
                    keep.append(w)
                else:  # its grow failed: it sits this step out
                    s.ahead, s.pending = s.ahead - w.n, s.pending - w.sample
        self.batch, self.phase = [], Phase.IDLE
        if not keep:  # frees only, or nothing could run: try again (after the step in flight lands)
            self.stalled = True
            out.append(("metrics", self._figures()))
            return
        self.inflight.append((self.step, keep))
        out.append(("executor", StepPlan(self.step, tuple(self._work(w) for w in keep), tuple(self.freed))))
        self.freed = []

    def _on_result(self, msg: StepResult, out: Out) -> None:
        batch = self._landed(msg.step)
        sampled = {t.seq_id: t for t in msg.tokens}
        n_tokens = n_decode = 0
        for w in batch:
            s = w.seq
            n_tokens += w.n
            n_decode += w.n == 1 and w.sample
            if s.status is not Status.RUNNING or w.epoch != s.epoch:
                continue  # ended, preempted or redirected while the step ran: its results are dropped
            s.num_computed += w.n
            s.ahead, s.pending = s.ahead - w.n, s.pending - w.sample
            t = sampled.get(s.id)
            if t is not None and t.prompt and not s.plp_sent:
                last = s.plp[-1].position if s.plp else 0
                s.plp += [e for e in t.prompt if e.position > last]  # a recompute scores again
            if w.sample:
                if t is None or s.num_computed != len(s.tokens):
                    raise CoreError(f"step {msg.step} sampled nothing for {s.id} at {s.num_computed}")
                self._sampled(s, t, out)
        self.steps += 1
        out.append(("metrics", StepStats(msg.step, len(batch), n_tokens, n_decode, msg.elapsed_ns)))
        self._advance(msg.now_ns, out)
        out.append(("metrics", self._figures()))

    def _on_failed(self, msg: StepFailed, out: Out) -> None:
        for w in self._landed(msg.step):  # their KV may be garbage: the free reports nothing of this step
            if w.seq.status is Status.RUNNING and w.epoch == w.seq.epoch:
                self._end(w.seq.req, FinishReason.ERROR, out, error=msg.error)
        self._advance(msg.now_ns, out)
        out.append(("metrics", self._figures()))

    def _sampled(self, s: Seq, t: SampledToken, out: Out) -> None:
        s.tokens.append(t.token_id)
        p, r = s.params, s.req
        if t.token_id in p.stop_token_ids and (not p.ignore_eos or p.constrained):  # a grammar ends at EOS
            reason = FinishReason.STOP
        elif len(s.tokens) - len(r.prompt) >= p.max_tokens or len(s.tokens) >= self.max_len:
            reason = FinishReason.LENGTH
        else:
            reason = FinishReason.NONE
        tout = self._token_out(s, [t.token_id], reason, [t] if p.logprobs >= 0 else [])
        if p.prompt_logprobs >= 0 and s.index == 0 and not s.plp_sent:
            tout = msgspec.structs.replace(tout, prompt_logprobs=tuple(s.plp))
            s.plp, s.plp_sent = [], True
        out.append(("detok", tout))
        if s.index == 0 and len(r.seqs) > 1:  # the prompt is computed: the siblings may fork it
            self._release_siblings(r)
        if reason:
            self._finish(s, reason, out)

    def _work(self, w: Work) -> SeqWork:
        s, p = w.seq, w.seq.params
        start, end, sample = w.start, w.start + w.n, w.sample
        n_prompt, known = len(s.req.prompt), len(s.tokens)
        n_gen = max(known, end) - n_prompt
        sent = p if s.send_params else None  # the executor keeps them from the first share of an admission
        s.send_params = False
        if p.prompt_logprobs >= 0 and s.index == 0 and not s.plp_sent and end <= n_prompt:
            nxt = s.tokens[end] if end < n_prompt else -1
            return SeqWork(s.id, tuple(s.tokens[start:end]), start, s.table, sample, sent, gen_index=n_gen,
                           prompt_logprobs=p.prompt_logprobs, prompt_next=nxt)
        toks, pending = tuple(s.tokens[start:end]), max(0, end - known)  # a result may have landed since planning
        if pending:  # depth 2: only the token the step in flight samples is unknown
            if pending > 1 or w.n != 1:
                raise CoreError(f"{s.id}: {pending} unknown tokens in a {w.n}-token share")
            toks = (PENDING_TOKEN,)
        # s.table is a KvReply's tuple: shared, not copied
        if not p.needs_history:
            hist = ()
        elif self.config.history_once:  # with the first share only: every generated token known (the executor
            hist = tuple(s.tokens[n_prompt:known]) if sent is not None else ()  # keeps it, appends its samples)
        else:
            hist = tuple(s.tokens[n_prompt:end]) if sample else ()
        return SeqWork(s.id, toks, start, s.table, sample, sent, gen_index=n_gen, history=hist, pending=pending)

    # ------------------------------------------------------------------ requests

    def _enqueue(self, e: Enqueue, out: Out) -> None:
        m = e.submit
        if m.req_id in self.requests:
            raise CoreError(f"duplicate request {m.req_id}")
        if not 0 < len(m.prompt) < self.max_len:  # admission checks this; never trust a neighbour
            out.append(("ingress", Reject(m.req_id, 400, "context_length_exceeded",
                                          f"prompt of {len(m.prompt)} tokens does not fit")))
            out.append(("admission", Finished(m.req_id, FinishReason.REJECTED)))
            return
        self._orders += 1
        r = self.requests[m.req_id] = Req(m, self._orders, min(e.reserved_blocks, self.config.num_blocks))
        for i in range(m.n):
            p = m.params if i == 0 else msgspec.structs.replace(m.params, seed=(m.params.seed + i) % (1 << 63))
            r.seqs.append(Seq(r, i, p))
        self._set(r.seqs[0], Status.WAITING)

    def _end(self, r: Req, reason: FinishReason, out: Out, error: str = "", index: int = -1) -> None:
        """End the request's unfinished choices (index: just that one)."""
        for s in r.seqs:
            if s.status is not Status.FINISHED and index in (-1, s.index):
                out.append(("detok", self._token_out(s, [], reason, [], error)))
                self._finish(s, reason, out)

    def _end_thinking(self, r: Req, ids: list[int], out: Out) -> None:
        """Force `ids` (the model's </think>) into every unfinished choice.

        They join the generated tokens: the next step feeds them (a short
        prefill), and a token sampled by a step in flight now is dropped,
        because it was drawn before them. A choice without room for them
        and one more token keeps thinking to its end.
        """
        for s in r.seqs:
            if s.status is Status.FINISHED or not ids or len(s.tokens) + len(ids) >= self.max_len:
                continue
            s.epoch, s.ahead, s.pending = s.epoch + 1, 0, 0  # work in flight fed the old context
            s.tokens.extend(ids)
            s.send_params = True  # the executor's kept history has a dropped token and lacks ids: send it anew
            out.append(("detok", self._token_out(s, tuple(ids), FinishReason.NONE, ())))

    def _finish(self, s: Seq, reason: FinishReason, out: Out) -> None:
        if s.in_kv:
            self._free(s)
        self._set(s, Status.FINISHED)
        if s.index == 0:  # ended before its first token (a cancel of choice 0): don't strand them
            self._release_siblings(s.req)
        if s.req.n_live == 0:
            r = s.req
            del self.requests[r.id]
            if r.pin_key and reason is not FinishReason.ERROR:  # after the frees: blocks are hashed
                self.frees.append(KvOp("pin", r.pin_key, token_ids=tuple(r.prompt), salt=r.salt))
                if r.session_id:
                    self.sessions.pop(r.session_id, None)
                    self.sessions[r.session_id] = self.now
            out.append(("admission", Finished(r.id, reason)))

    def _close_session(self, sid: str) -> None:
        self.sessions.pop(sid, None)
        self.frees.append(KvOp("unpin", f"session:{sid}"))

    def _release_siblings(self, r: Req) -> None:
        for sib in r.seqs[1:]:
            if sib.status is Status.HELD:
                self._set(sib, Status.WAITING)

    def _advance(self, now_ns: int, out: Out) -> None:
        self.now = max(self.now, now_ns)
        ttl = self.config.session_ttl_ns
        while self.sessions:  # oldest use first: stop at the first one still alive
            sid, last = next(iter(self.sessions.items()))
            if self.now - last < ttl:
                break
            self._close_session(sid)
        t = self.config.request_timeout_ns
        if t:
            for r in [r for r in self.requests.values() if self.now - r.arrival_ns >= t]:
                self.timeouts += 1
                self._end(r, FinishReason.TIMEOUT, out)

    def _set(self, s: Seq, new: Status) -> None:
        """The one place a sequence changes state (and the lists follow)."""
        if s.status is Status.WAITING:
            self.waiting.remove(s)
        elif s.status is Status.RUNNING:
            s.epoch, s.ahead, s.pending = s.epoch + 1, 0, 0  # its steps in flight no longer count
            self.running.remove(s)
            s.req.n_running -= 1
            if s.req.n_running == 0:
                self._reserved_running -= s.req.reserved
        s.status = new
        if new is Status.WAITING:
            self.waiting.append(s)
        elif new is Status.RUNNING:
            self.running.append(s)
            s.req.n_running += 1
            if s.req.n_running == 1:
                self._reserved_running += s.req.reserved
            self._admits += 1
            s.admit_no = self._admits
        elif new is Status.FINISHED:
            s.req.n_live -= 1
        assert len(self.running) <= self.config.max_batch_size

    # ------------------------------------------------------------------ helpers

    def _grow_op(self, s: Seq, positions: int) -> KvOp | None:
        """A grow when the table must grow or a written block filled up (to cache it)."""
        bs = self.config.block_size
        if positions <= len(s.table) * bs and s.num_computed // bs == s.num_reported // bs:
            return None
        op = KvOp("grow", s.id, positions, tuple(s.tokens[s.num_reported:s.num_computed]))
        s.num_reported = s.num_computed
        return op

    def _free(self, s: Seq) -> None:
        self.frees.append(KvOp("free", s.id, token_ids=tuple(s.tokens[s.num_reported:s.num_computed])))
        s.in_kv, s.table = False, ()

    def _key(self, s: Seq) -> tuple[int, int, int, int]:
        r = s.req
        age = self.now - r.arrival_ns
        return (r.priority, len(r.prompt) - age * self.config.max_context // self.config.aging_ns, r.order, s.index)

    def _reserved(self) -> int:
        # kept incrementally: summing over every request was a tenth of a step at batch 256
        return self._reserved_running

    def _token_out(self, s: Seq, ids, reason: FinishReason, lp, error: str = "") -> TokenOut:
        ids, lp = tuple(ids), tuple(lp)
        if not reason:
            return TokenOut(s.req.id, s.index, ids, logprobs=lp)
        return TokenOut(s.req.id, s.index, ids, reason, len(s.req.prompt), max(0, s.req.cached_tokens),
                        len(s.tokens) - len(s.req.prompt), lp, error)

    def _figures(self) -> Figures:
        q = QueueFigures(len(self.waiting), len(self.running), sum(len(s.tokens) for s in self.waiting),
                         self.preemptions, self.cancellations, self.timeouts, self.steps)
        return Figures(msgspec.structs.replace(self.kv, reserved=self._reserved()), q)

    def _check(self, phase: Phase, step: int) -> None:
        if self.phase is not phase or step != self.step:
            raise CoreError(f"step {step} arrived in phase {self.phase.name} of step {self.step}")

    def _landed(self, step: int) -> list[Work]:
        """The oldest step in flight, whose result (or failure) this is."""
        if not self.inflight or self.inflight[0][0] != step:
            raise CoreError(f"result of step {step} but in flight: {[st for st, _ in self.inflight]}")
        return self.inflight.popleft()[1]


def _batch_tokens(out: Out) -> Out:
    """All TokenOuts of one handling travel as one TokenBatch.

    At batch 256 one message instead of 256 is most of the control plane's
    per-step cost (each message is logged and queued). Order among the
    TokenOuts, and of detok's messages, is kept.
    """
    touts = [m for r, m in out if r == "detok" and type(m) is TokenOut]
    if not touts:
        return out
    first = next(i for i, (r, m) in enumerate(out) if r == "detok" and type(m) is TokenOut)
    rest = [(r, m) for r, m in out if not (r == "detok" and type(m) is TokenOut)]
    rest.insert(first, ("detok", TokenBatch(tuple(touts))))
    return rest
