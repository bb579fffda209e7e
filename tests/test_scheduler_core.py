"""Scheduler (+ kv + admission, wired by the in-process router), driven by a
deterministic fake executor that keeps a simulated KV memory and checks every
position each sequence attends to.

The fake model: the token sampled at generation index g of sequence s is a
pure function of (seed, g, s). So a run's output is known in advance, and a
preempted-and-recomputed sequence must reproduce it exactly.

Pipelined (pipeline_depth 2): up to two plans are in flight and execute in
order; a PENDING_TOKEN is resolved from the previous executed plan's
samples, as the executors do. KV requests can be held back so that a
step's result lands before the next step's KvReply.
"""

from __future__ import annotations

import collections
import os
import hashlib
from pathlib import Path


import pytest
from hypothesis import event, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from imp.core.admission import AdmissionConfig, AdmissionCore
from imp.actors.executor import plan_works, record_samples
from imp.sampling.pending import fill
from imp.core.kv import KvConfig, KvCore
from imp.core.scheduler import SchedulerConfig, SchedulerCore
from imp.core.router import Router, route
from imp.messages import step_result
from imp.messages import (
    PENDING_TOKEN, Cancel, Enqueue, Figures, Finished, FinishReason, KvDrop, KvLoad, KvLoaded, KvReply, KvRequest,
    Constraint, KvSave, KvSwapIn, KvSwapOut, Reject, SampledToken,
    SamplingParams, SessionClose, StepFailed, StepPlan, StepResult, Submit, Tick, TokenBatch, TokenOut,
)

VOCAB, EOS = 40, 0
MS = 1_000_000


def _unbatch(msgs):
    """Flatten TokenBatch into its TokenOuts (the scheduler batches them per decision)."""
    for m in msgs:
        if isinstance(m, TokenBatch):
            yield from m.each()
        else:
            yield m


def fake_token(seed: int, gen_index: int, seq_id: str) -> int:
    h = hashlib.sha256(f"{seed}/{gen_index}/{seq_id}".encode()).digest()
    return int.from_bytes(h[:4], "little") % VOCAB


class Spy:
    """Wraps a core; sees every input with the outputs it caused."""

    def __init__(self, core, observe):
        self.core, self.name, self.config, self.observe = core, core.name, core.config, observe

    def handle(self, sender, msg):
        out = self.core.handle(sender, msg)
        self.observe(msg, out)
        return out


class HoldKv:
    """Wraps the kv core: while `hold` is set, KvRequests wait in `held` until released."""

    def __init__(self, core):
        self.core, self.name, self.config = core, core.name, core.config
        self.hold, self.held = False, collections.deque()

    def handle(self, sender, msg):
        if self.hold and isinstance(msg, KvRequest):
            self.held.append(msg)
            return []
        return self.core.handle(sender, msg)


class Sim:
    def __init__(self, num_blocks=16, block_size=4, max_context=64, max_batch_size=8, max_step_tokens=16,
                 request_timeout_ns=0, aging_ns=20 * MS, max_queued_tokens=0, decode_reserve=8, pipeline_depth=1,
                 admit_tokens=0, history_once=False, share_in_flight=False, spec_k_max=0, token=None, tier_blocks=0,
                 disk=None, swap_blocks=0, recompute_ns_per_token=1000, tier_demote=False, decode_lane=True,
                 spec_max_rows=0):
        self.bs, self.num_blocks = block_size, num_blocks
        self.token = token or (lambda seed, g, sid: fake_token(seed, g, sid))  # the fake model: (seed, index, seq)
        self.max_len = min(max_context, num_blocks * block_size)
        self.kv = KvCore(KvConfig(num_blocks, block_size, "fake", share_in_flight=share_in_flight,
                                  tier_blocks=tier_blocks, swap_blocks=swap_blocks, tier_demote=tier_demote))
        self.disk = {} if disk is None else disk  # the disk tier's files: key -> a block's (salt, token) slots
        # the executor's inbox: plans and the allocator's tier and swap messages, done in the order they came
        self.exq: collections.deque = collections.deque()
        self.swap_mem: dict[int, list] = {}  # the swap area: slot -> a block's (salt, token) slots
        self.spoil: set[bytes] = set()  # keys whose file a load finds corrupt
        self.sched = SchedulerCore(SchedulerConfig(num_blocks, block_size, max_context, max_batch_size,
                                                   max_step_tokens, request_timeout_ns, aging_ns,
                                                   pipeline_depth=pipeline_depth, admit_tokens=admit_tokens,
                                                   history_once=history_once, spec_k_max=spec_k_max,
                                                   spec_max_rows=spec_max_rows, swap_blocks=swap_blocks, swap_ns_per_block=1,
                                                   recompute_ns_per_token=recompute_ns_per_token,
                                                   decode_lane=decode_lane))
        self.hold_kv = HoldKv(self.kv)
        self.adm = AdmissionCore(AdmissionConfig(num_blocks, block_size, max_context, max_queued_tokens,
                                                 admission_decode_tokens=decode_reserve))
        self.router = Router({"kv": self.hold_kv, "admission": self.adm,
                              "scheduler": Spy(self.sched, self._observe)})
        self.mem = [[None] * block_size for _ in range(num_blocks)]  # simulated KV: (salt, token)
        self.now = 0
        self.inflight: collections.deque[StepPlan] = collections.deque()
        self.prev_sampled: dict[str, int] = {}  # what the last executed plan sampled, by sequence
        self.kept_params: dict = {}  # SamplingParams by sequence, as the executor keeps them
        self.kept_hists: dict = {}  # penalized sequences' generated tokens, as the executor keeps them
        self.drawn: dict[tuple[str, int], int] = {}  # (sequence, generated index) -> its latest sampled token
        self.submits: dict[str, Submit] = {}
        self.enqueued: dict[str, Enqueue] = {}
        self.finished: dict[str, FinishReason] = {}
        self.rejected: dict[str, Reject] = {}
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.finish: dict[tuple[str, int], TokenOut] = {}
        self.spec: dict[tuple[str, int], list[int]] = {}  # [drafted, accepted, verify steps] summed over TokenOuts
        self.figures: Figures | None = None
        self.plans: list[StepPlan] = []
        # scheduler-side view for the ordering invariant
        self.sched_now = 0
        self.fresh: dict[str, tuple] = {}  # enqueued leads never started: req -> (prio, len, arrival, order)
        self.last_ops = []

    # ------------------------------------------------------------- driving

    def submit(self, req_id, prompt, params, n=1, priority=0, salt="", cache_prompt=False, session_id="",
               cfg_prompt=()):
        m = Submit(req_id, tuple(prompt), params, self.now, n, priority, salt,
                   cache_prompt=cache_prompt, session_id=session_id, cfg_prompt=tuple(cfg_prompt))
        self.submits[req_id] = m
        self._collect(self.router.send([("ingress", "admission", m)]))

    def close_session(self, sid):
        self._collect(self.router.send([("ingress", "admission", SessionClose(sid))]))

    def cancel(self, req_id, index=-1):
        self._collect(self.router.send([("ingress", "admission", Cancel(req_id, index=index))]))

    def tick(self, dt):
        self.now += dt
        self._collect(self.router.send([("clock", "scheduler", Tick(self.now))]))

    @property
    def plan(self) -> StepPlan | None:
        return self.inflight[0] if self.inflight else None

    def release_kv(self) -> bool:
        if not self.hold_kv.held:
            return False
        msg = self.hold_kv.held.popleft()
        outs = self.kv.handle("scheduler", msg)
        self._collect(self.router.send([("kv", r, m) for r, m in outs]))
        return True

    def step(self, fail=False) -> bool:
        """Run the oldest plan in flight (or, with none, let a held KvRequest through)."""
        if not self.exq:
            return self.release_kv()
        m = self.exq.popleft()
        if isinstance(m, KvSave):  # the executor writes the block's KV to the tier
            self.disk[m.key] = list(self.mem[m.block])
        elif isinstance(m, KvDrop):
            self.disk.pop(m.key, None)
        elif isinstance(m, KvLoad):
            ok = m.key in self.disk and m.key not in self.spoil
            if ok:
                self.mem[m.block] = list(self.disk[m.key])
            self._collect(self.router.send([("executor", "kv", KvLoaded(m.key, m.block, ok))]))
        elif isinstance(m, KvSwapOut):
            for b, slot in zip(m.blocks, m.slots, strict=True):
                self.swap_mem[slot] = list(self.mem[b])
        elif isinstance(m, KvSwapIn):
            for slot, b in zip(m.slots, m.blocks, strict=True):
                self.mem[b] = list(self.swap_mem[slot])
        if not isinstance(m, StepPlan):
            return True
        plan = self.inflight.popleft()
        assert plan is m
        self.now += MS
        if fail:  # nothing of it ran: the next plan's pending tokens cannot be resolved
            msg = StepFailed(plan.step, "boom", self.now)
            self.prev_sampled = {}
            plan_works(plan, self.kept_params, self.kept_hists)  # the executor saw the plan before it failed
        else:
            msg = step_result(plan, tuple(self._execute(plan)), self.now, MS)
        self._collect(self.router.send([("executor", "scheduler", msg)]))
        return True

    def drain(self, limit=5000):
        self.hold_kv.hold = False
        for _ in range(limit):
            if not self.step():
                return
        raise AssertionError("scheduler never went idle")

    def output(self, req_id, index=0):
        return self.tokens.get((req_id, index), [])

    def expected(self, req_id, index):
        """The tokens an unhindered run produces (finishing by STOP or LENGTH)."""
        m = self.submits[req_id]
        seed = m.params.seed + index
        out = []
        while True:
            t = self.token(seed, len(out), f"{req_id}#{index}")
            out.append(t)
            if t in m.params.stop_token_ids and not m.params.ignore_eos:
                return out
            if len(out) >= m.params.max_tokens or len(m.prompt) + len(out) >= self.max_len:
                return out

    # ------------------------------------------------------------- fake executor

    def _execute(self, plan: StepPlan) -> list[SampledToken]:
        bs, writers, ends = self.bs, {}, []
        prev, self.prev_sampled = self.prev_sampled, {}
        # KeyError: a share came without params never sent, or with less history kept than it needs
        ends_of = {w.seq_id: w.start_pos + len(w.token_ids) for w in plan.shares()}
        for w in plan_works(plan, self.kept_params, self.kept_hists):
            req, index, prompt, main_id = self._who(w.seq_id)
            m = self.submits[req]
            assert w.params.seed == m.params.seed + int(index) or main_id != w.seq_id
            if w.guide:  # classifier-free guidance: the shadow's share ends at the same generated index
                assert w.sample and ends_of[w.guide] - len(m.cfg_prompt) == ends_of[w.seq_id] - len(m.prompt), w
            assert w.pending <= 1 and (PENDING_TOKEN in w.token_ids) == (w.pending == 1), w
            if w.pending:
                assert w.token_ids == (PENDING_TOKEN,) and w.sample, w
                if w.seq_id not in prev:  # the step that sampled it failed: the sequence has ended
                    assert (req, index) in self.finish, f"{w.seq_id}: nothing to resolve its token from"
                    continue
                w = fill(w, prev[w.seq_id])  # as the executor does

            def expect(p, m=m, prompt=prompt, main_id=main_id, seed=m.params.seed + index):
                if p < len(prompt):
                    return (m.salt, prompt[p])
                g = p - len(prompt)  # a rewound sequence's latest draw there (banned phrases); a shadow's: its choice's
                d = self.drawn.get((main_id, g))
                return (m.salt, d if d is not None else self.token(seed, g, main_id))

            end = w.start_pos + len(w.token_ids)
            assert len(w.token_ids) >= 1 and len(w.block_table) * bs >= end
            assert len(set(w.block_table)) == len(w.block_table)
            for i, t in enumerate(w.token_ids):
                p = w.start_pos + i
                if i < len(w.token_ids) - w.draft:
                    assert (m.salt, t) == expect(p), (w.seq_id, p)
                b = w.block_table[p // bs]
                assert writers.setdefault(b, w.seq_id) == w.seq_id, f"block {b} written by two sequences"
                self.mem[b][p % bs] = (m.salt, t)  # a draft token as fed: a wrong guess is garbage to write over
            ends.append((w, end, expect, m, prompt))
        out = []
        for w, end, expect, m, prompt in ends:  # attention reads, after the whole batch wrote
            req, index, _, _ = self._who(w.seq_id)
            if (req, index) in self.finish:
                continue  # a share planned before its sequence ended (pipelined): what it reads is never used
            draft = w.token_ids[len(w.token_ids) - w.draft:] if w.draft else ()
            kept = 0  # a verify: the draft up to its first token the model does not sample there
            while kept < len(draft) and draft[kept] == self.token(w.params.seed, w.gen_index + kept, w.seq_id):
                kept += 1
            for p in range(end - len(draft) + kept):  # what the rows that count read
                assert self.mem[w.block_table[p // bs]][p % bs] == expect(p), (w.seq_id, p)
            if w.sample:
                assert end - len(draft) == len(prompt) + w.gen_index
                penalty = m.params.needs_history  # penalties count them, a grammar follows them
                gen = [expect(len(m.prompt) + g)[1] for g in range(w.gen_index)]
                assert w.history == (tuple(gen) if penalty else ()), (w.history, gen)
                acc = tuple(SampledToken(w.seq_id, t) for t in draft[:kept])
                g = w.gen_index + kept
                out.append(SampledToken(w.seq_id, self.draw(w.params.seed, g, w.seq_id, w.banned), accepted=acc))
                self.drawn[(w.seq_id, g)] = out[-1].token_id
                self.prev_sampled[w.seq_id] = out[-1].token_id
        record_samples(out, self.kept_hists)  # as the executor does before it sends the result
        return out

    def _who(self, seq_id):
        """(request, choice index, the prompt the sequence decodes after, its choice's id): a shadow
        ("r#0.cfg", classifier-free guidance) decodes its choice's tokens after the request's cfg_prompt."""
        req, index = seq_id.rsplit("#", 1)
        shadow = index.endswith(".cfg")
        index = int(index.removesuffix(".cfg"))
        m = self.submits[req]
        return req, index, m.cfg_prompt if shadow else m.prompt, f"{req}#{index}"

    def draw(self, seed, g, sid, banned=()):
        """The fake model's token, or with banned ones (a rewind's) the first of its retries not banned."""
        t, k = self.token(seed, g, sid), 0
        while t in banned:
            k += 1
            t = self.token(seed, g, f"{sid}/{k}")
        return t

    # ------------------------------------------------------------- observation

    def _collect(self, deliveries):
        for m in _unbatch(d.msg for d in deliveries):
            if isinstance(m, StepPlan):
                assert len(self.inflight) < self.sched.config.pipeline_depth, "too many steps in flight"
                assert len(m.shares()) <= self.sched.config.max_batch_size
                assert sum(len(w.token_ids) for w in m.shares()) <= self.sched.config.max_step_tokens
                self.inflight.append(m)
                self.exq.append(m)
                self.plans.append(m)
            elif isinstance(m, TokenOut):
                key = (m.req_id, m.index)
                assert key not in self.finish, f"output after the end of {key}"
                self.tokens.setdefault(key, []).extend(m.token_ids)
                sp = self.spec.setdefault(key, [0, 0, 0])
                sp[0], sp[1], sp[2] = sp[0] + m.spec_drafted, sp[1] + m.spec_accepted, sp[2] + m.spec_verify_steps
                if m.finish:
                    self.finish[key] = m
            elif isinstance(m, Reject):
                self.rejected[m.req_id] = m
            elif isinstance(m, (KvSave, KvDrop, KvLoad, KvSwapOut, KvSwapIn)):
                self.exq.append(m)
            elif isinstance(m, Figures):
                assert m.kv.reserved <= self.num_blocks
                self.figures = m

    def _observe(self, msg, out):
        """Scheduler in/out: whenever requests that never ran start, none of the
        waiting ones that never ran may rank before them."""
        cfg = self.sched.config
        if isinstance(msg, Enqueue):
            sub = msg.submit
            self.enqueued[sub.req_id] = sub
            self.fresh[sub.req_id] = (sub.priority, len(sub.prompt), sub.arrival_ns, len(self.enqueued))
            self.sched_now = max(self.sched_now, sub.arrival_ns)
        self.sched_now = max(self.sched_now, getattr(msg, "now_ns", 0))
        if isinstance(msg, KvReply):
            with_result = [op for op in self.last_ops if op.kind not in ("free", "pin", "unpin", "swap_out", "unswap")]
            for op, res in zip(with_result, msg.results, strict=True):
                if op.kind in ("alloc", "fork") and res.ok:
                    self.fresh.pop(op.seq_id.rsplit("#", 1)[0], None)

        def key(req):
            prio, length, arrival, order = self.fresh[req]
            return (prio, length - (self.sched_now - arrival) * cfg.max_context // cfg.aging_ns, order)

        for receiver, m in out:
            if isinstance(m, Finished):
                self.finished[m.req_id] = m.reason
                self.fresh.pop(m.req_id, None)
            elif isinstance(m, KvRequest):
                self.last_ops = m.ops
                starts = [r for r in dict.fromkeys(op.seq_id.rsplit("#", 1)[0] for op in m.ops
                                                   if op.kind in ("alloc", "fork")) if r in self.fresh]
                rest = [r for r in self.fresh if r not in starts]
                for s in starts:
                    for r in rest:
                        assert key(s) < key(r), f"{s} started before {r}"
                        if self.fresh[s][0] == self.fresh[r][0]:  # the aging bound, stated plainly
                            assert self.fresh[r][2] + cfg.aging_ns > self.fresh[s][2], "starved"


def params(max_tokens=8, seed=1, **kw):
    return SamplingParams(max_tokens=max_tokens, seed=seed, stop_token_ids=(EOS,), **kw)


def ids(n, base=1):
    return [base + (i % 30) for i in range(n)]


# --------------------------------------------------------------------------- unit tests


def test_single_request_runs_to_length():
    sim = Sim()
    sim.submit("a", ids(6), params(max_tokens=5, ignore_eos=True))
    sim.drain()
    assert sim.output("a") == sim.expected("a", 0) and len(sim.output("a")) == 5
    fin = sim.finish[("a", 0)]
    assert (fin.finish, fin.prompt_tokens, fin.completion_tokens) == (FinishReason.LENGTH, 6, 5)
    assert sim.finished == {"a": FinishReason.LENGTH}
    assert sim.figures.kv.used == 0 and sim.figures.kv.reserved == 0


def test_stop_token_ends_with_stop_unless_ignore_eos():
    seed = next(s for s in range(1000) if fake_token(s, 2, "a#0") == EOS and EOS not in
                [fake_token(s, g, "a#0") for g in range(2)])
    sim = Sim()
    sim.submit("a", ids(3), params(max_tokens=10, seed=seed))
    sim.submit("b", ids(3), params(max_tokens=10, seed=seed, ignore_eos=True))
    sim.drain()
    assert sim.finish[("a", 0)].finish == FinishReason.STOP and sim.output("a")[-1] == EOS
    assert len(sim.output("a")) == 3
    assert sim.finish[("b", 0)].finish == FinishReason.LENGTH and len(sim.output("b")) == 10


def test_chunked_prefill_mixes_decodes_first():
    sim = Sim(num_blocks=32, max_step_tokens=8)
    sim.submit("a", ids(3), params(max_tokens=20, ignore_eos=True))
    sim.step()  # a's prefill
    sim.submit("b", ids(20), params(max_tokens=2, ignore_eos=True))  # queued while a's decode runs
    sim.drain()
    shapes = [[(w.seq_id, len(w.token_ids), w.sample) for w in p.shares()] for p in sim.plans[2:5]]
    assert shapes == [[("a#0", 1, True), ("b#0", 7, False)],
                      [("a#0", 1, True), ("b#0", 7, False)],
                      [("a#0", 1, True), ("b#0", 6, True)]]
    assert sim.output("b") == sim.expected("b", 0)


def test_priority_then_shortest_first_then_aging():
    sim = Sim(num_blocks=64, max_batch_size=1, aging_ns=10 * MS, max_context=64)
    sim.submit("block", ids(2), params(max_tokens=3, ignore_eos=True))  # occupies the only slot
    sim.submit("long", ids(30), params(max_tokens=1))
    sim.submit("short", ids(5), params(max_tokens=1))
    sim.submit("urgent", ids(40), params(max_tokens=1), priority=-1)
    sim.drain()
    order = list(dict.fromkeys(w.seq_id for p in sim.plans for w in p.shares()))
    assert order == ["block#0", "urgent#0", "short#0", "long#0"]
    # aging: "old" waited 10 ms, which outweighs any prompt length
    sim = Sim(num_blocks=64, max_batch_size=1, aging_ns=10 * MS, max_context=64)
    sim.submit("block", ids(2), params(max_tokens=12, ignore_eos=True))
    sim.submit("old", ids(60), params(max_tokens=1))
    sim.tick(10 * MS)
    sim.submit("new", ids(1), params(max_tokens=1))
    sim.drain()
    order = list(dict.fromkeys(w.seq_id for p in sim.plans for w in p.shares()))
    assert order == ["block#0", "old#0", "new#0"]


def test_n_siblings_fork_the_prompt():
    sim = Sim(num_blocks=32)
    sim.submit("a", ids(10), params(max_tokens=4, ignore_eos=True), n=3)
    sim.drain()
    for i in range(3):
        assert sim.output("a", i) == sim.expected("a", i)
    seqs = {w.seq_id: w for p in sim.plans for w in p.shares() if w.gen_index == 0 and w.sample}
    lead, sib = seqs["a#0"], seqs["a#1"]
    assert sib.start_pos == 8 and sib.block_table[:2] == lead.block_table[:2]
    assert sim.finished == {"a": FinishReason.LENGTH} and sim.figures.kv.used == 0


def test_cancel_drops_in_flight_tokens_and_frees():
    sim = Sim()
    sim.submit("a", ids(5), params(max_tokens=50, ignore_eos=True))
    sim.step()
    sim.step()
    sim.cancel("a")  # a step is in flight: its token for "a" is dropped
    sim.cancel("a")  # unknown by now: ignored
    sim.cancel("ghost")
    assert sim.finish[("a", 0)].finish == FinishReason.CANCELLED
    n = len(sim.output("a"))
    sim.drain()
    assert len(sim.output("a")) == n == 2
    assert sim.figures.kv.used == 0 and sim.figures.queue.cancellations == 1


def test_cancel_one_choice_keeps_the_others():
    sim = Sim(num_blocks=32)
    sim.submit("a", ids(6), params(max_tokens=6, ignore_eos=True), n=2)
    sim.cancel("a", index=0)  # before the lead ran: the sibling must not be stranded
    sim.drain()
    assert sim.finish[("a", 0)].finish == FinishReason.CANCELLED
    assert sim.output("a", 1) == sim.expected("a", 1)
    assert sim.finished == {"a": FinishReason.LENGTH}


def test_timeout_and_step_failure():
    sim = Sim(request_timeout_ns=5 * MS)
    sim.submit("a", ids(5), params(max_tokens=50, ignore_eos=True))
    sim.step()
    sim.tick(10 * MS)
    assert sim.finish[("a", 0)].finish == FinishReason.TIMEOUT
    sim.drain()
    assert sim.figures.queue.timeouts == 1 and sim.figures.kv.used == 0
    sim.submit("b", ids(5), params(max_tokens=50, ignore_eos=True))
    sim.step(fail=True)
    fin = sim.finish[("b", 0)]
    assert fin.finish == FinishReason.ERROR and fin.error == "boom"
    sim.drain()
    assert sim.finished["b"] == FinishReason.ERROR and sim.figures.kv.used == 0


def test_context_end_is_length():
    sim = Sim(num_blocks=64, max_context=12)
    sim.submit("a", ids(9), params(max_tokens=100, ignore_eos=True))
    sim.drain()
    assert len(sim.output("a")) == 3 and sim.finish[("a", 0)].finish == FinishReason.LENGTH


@pytest.mark.parametrize("once", [False, True])
def test_penalty_history_and_prefix_cache_usage(once):
    sim = Sim(num_blocks=32, history_once=once)
    sim.submit("a", ids(9), params(max_tokens=3, repetition_penalty=1.2, ignore_eos=True))
    sim.drain()
    sim.submit("b", ids(9), params(max_tokens=3, ignore_eos=True))
    sim.drain()
    assert sim.finish[("b", 0)].cached_tokens == 8  # the fake executor checked the reused KV


def test_prompts_the_cache_holds_are_admitted_together_within_the_step_budget():
    """admit_tokens: new requests may bring more prompt than a step computes; once the KV reply shows the cached
    part, their shares are cut to the step budget, and those past it run from the next step (KV already
    allocated). 4 requests on a 12-token prompt the cache holds 8 tokens of, a 16-token step budget."""
    rounds = {}
    for admit in (0, 16 * 8):
        sim = Sim(num_blocks=64, max_step_tokens=16, admit_tokens=admit)
        sim.submit("warm", ids(12), params(max_tokens=1))
        sim.drain()
        for i in range(4):
            sim.submit(f"r{i}", ids(12), params(max_tokens=2, ignore_eos=True))
        first = len(sim.plans)
        sim.drain()
        rounds[admit] = sum(any(w.start_pos == 8 for w in p.shares()) for p in sim.plans[first:])  # after the hit
        assert all(sum(len(w.token_ids) for w in p.shares()) <= 16 for p in sim.plans)
        for i in range(4):
            assert sim.output(f"r{i}") == sim.expected(f"r{i}", 0)
            assert sim.finish[(f"r{i}", 0)].cached_tokens == 8
    assert rounds == {0: 2, 16 * 8: 1}  # two a round (12 + the first 4 of the next), then all four at once


def test_preemption_reproduces_the_unpreempted_tokens():
    work = [(f"r{i}", ids(6 + i, base=i), params(max_tokens=24, seed=i, ignore_eos=True)) for i in range(6)]
    outs = {}
    for pool in (14, 1000):
        sim = Sim(num_blocks=pool, block_size=4, max_context=40)
        for req, prompt, p in work:
            sim.submit(req, prompt, p)
        sim.drain()
        outs[pool] = {k: v for k, v in sim.tokens.items()}
        if pool == 14:
            assert sim.figures.queue.preemptions > 0
        assert sim.figures.kv.used == 0
    assert outs[14] == outs[1000]


@pytest.mark.parametrize("hold", [False, True])
def test_pipelined_steps_feed_the_pending_token(hold):
    sim = Sim(pipeline_depth=2)
    sim.hold_kv.hold = hold  # True: each result lands before the next step's KvReply
    sim.submit("a", ids(6), params(max_tokens=5, ignore_eos=True, repetition_penalty=1.1))
    for _ in range(3):
        sim.step()
    sim.drain()
    assert sim.output("a") == sim.expected("a", 0) and len(sim.output("a")) == 5
    fed = [w.token_ids for p in sim.plans for w in p.shares()]
    if hold:  # a result landed before the KvReply: the token is known (drain stops holding)
        assert PENDING_TOKEN not in sum(fed[:3], ()) and len(fed[1]) == 1
    else:  # planned while the previous step ran: decodes feed the token in flight
        assert fed[1:] == [(PENDING_TOKEN,)] * 4 and [w.pending for w in sim.plans[1].shares()] == [1]
    assert len(sim.plans) == 5  # max_tokens is known: no step past the last token
    assert sim.figures.kv.used == 0


def test_pipelined_stop_wastes_one_step_and_drops_its_token():
    seed = next(s for s in range(1000) if fake_token(s, 2, "a#0") == EOS and EOS not in
                [fake_token(s, g, "a#0") for g in range(2)])
    sim = Sim(pipeline_depth=2)
    sim.submit("a", ids(3), params(max_tokens=10, seed=seed))
    sim.drain()
    assert sim.output("a") == sim.expected("a", 0) and sim.finish[("a", 0)].finish == FinishReason.STOP
    assert len(sim.plans) == 4  # the step after the stop token ran, its token dropped
    assert sim.figures.kv.used == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_reproduces_the_unpreempted_tokens_at_depth(depth):
    work = [(f"r{i}", ids(6 + i, base=i), params(max_tokens=24, seed=i, ignore_eos=True)) for i in range(6)]
    outs = {}
    for pool in (14, 1000):
        sim = Sim(num_blocks=pool, block_size=4, max_context=40, pipeline_depth=depth)
        for req, prompt, p in work:
            sim.submit(req, prompt, p)
        sim.drain()
        outs[pool] = dict(sim.tokens)
        assert (sim.figures.queue.preemptions > 0) == (pool == 14)
        assert sim.figures.kv.used == 0
    assert outs[14] == outs[1000]


@pytest.mark.parametrize("depth", [1, 2])
def test_swapped_preemptions_give_the_unpreempted_tokens_and_compute_less(depth):
    """Swap instead of recompute: a preempted sequence's KV parked in the swap area comes back (the fake
    executor's memory checks every position each share attends to) and nothing is computed twice for it."""
    work = [(f"r{i}", ids(6 + i, base=i), params(max_tokens=24, seed=i, ignore_eos=True)) for i in range(6)]
    outs, computed, figs = {}, {}, {}
    for mode, pool, swap in (("alone", 1000, 0), ("recompute", 14, 0), ("swap", 14, 64), ("small area", 14, 6)):
        sim = Sim(num_blocks=pool, block_size=4, max_context=40, pipeline_depth=depth, swap_blocks=swap)
        for req, prompt, p in work:
            sim.submit(req, prompt, p)
        sim.drain()
        sim.kv.audit()
        outs[mode] = dict(sim.tokens)
        computed[mode] = sum(len(w.token_ids) for p in sim.plans for w in p.shares())
        figs[mode] = sim.figures
        assert sim.figures.kv.used == 0 and sim.figures.kv.swap_used == 0 and sim.sched.swap_used == 0
        assert not sim.kv.swapped
    assert outs["recompute"] == outs["swap"] == outs["small area"] == outs["alone"]
    assert figs["swap"].queue.preemptions > 0 and figs["swap"].kv.swaps_out == figs["swap"].queue.preemptions
    assert figs["swap"].kv.swaps_in == figs["swap"].kv.swaps_out and figs["recompute"].kv.swaps_out == 0
    assert 0 < figs["small area"].kv.swaps_out < figs["small area"].queue.preemptions  # room for some only
    assert computed["alone"] <= computed["swap"] < computed["recompute"]
    if depth == 1:  # (pipelined, a victim's share in flight when it is preempted is dropped and computed again)
        assert computed["swap"] == computed["alone"]


def test_the_cost_model_recomputes_when_copies_cost_more():
    work = [(f"r{i}", ids(6 + i, base=i), params(max_tokens=24, seed=i, ignore_eos=True)) for i in range(6)]
    for per_token, swaps in ((1000, True), (0, False)):  # a block's copies cost 1 ns: a token must cost more
        sim = Sim(num_blocks=14, block_size=4, max_context=40, swap_blocks=64, recompute_ns_per_token=per_token)
        for req, prompt, p in work:
            sim.submit(req, prompt, p)
        sim.drain()
        assert sim.figures.queue.preemptions > 0 and (sim.figures.kv.swaps_out > 0) == swaps


def test_a_request_cancelled_while_swapped_out_gives_its_slots_back():
    sim = Sim(num_blocks=14, block_size=4, max_context=40, swap_blocks=64)
    for i in range(6):
        sim.submit(f"r{i}", ids(6 + i, base=i), params(max_tokens=24, seed=i, ignore_eos=True))
    for _ in range(400):
        sim.step()
        parked = [s for s in sim.sched.waiting if s.swapped]
        if parked:
            break
    assert parked, "no preemption swapped"
    sim.cancel(parked[0].req.id)
    sim.drain()
    sim.kv.audit()
    assert sim.finish[(parked[0].req.id, 0)].finish == FinishReason.CANCELLED
    assert sim.kv.figures().swap_used == 0 and not sim.kv.swapped and sim.sched.swap_used == 0


def test_replay_gives_the_same_log():
    """Feed the recorded inputs to fresh cores through `route`: every message is the same."""
    sim = Sim(num_blocks=12, request_timeout_ns=30 * MS)
    for i in range(5):
        sim.submit(f"r{i}", ids(4 + 3 * i, base=i % 2), params(max_tokens=10, seed=i), n=1 + i % 2, priority=i % 2)
        sim.step()
    sim.cancel("r1")
    sim.tick(3 * MS)
    sim.drain()
    inputs = [(d.sender, d.receiver, d.msg) for d in sim.router.log if d.sender in ("ingress", "clock", "executor")]
    fresh = Sim(num_blocks=12, request_timeout_ns=30 * MS)
    log = route({"kv": fresh.kv, "admission": fresh.adm, "scheduler": fresh.sched}, [])
    assert log == []
    replayed = Router({"kv": fresh.kv, "admission": fresh.adm, "scheduler": fresh.sched})
    for i in inputs:  # one at a time, as they arrived
        replayed.send([i])
    assert replayed.log == sim.router.log
    assert {d.receiver for d in replayed.log} >= {"executor", "detok", "metrics", "kv", "scheduler"}


# --------------------------------------------------------------------------- properties

def _save_failure(sim) -> None:
    """Keep a failing case's exact message order for `python -m imp replay LOG --step`."""
    import os
    import time as _time

    from imp.core.router import dump

    d = Path(os.environ.get("IMP_REPLAY_FAILURES", Path(__file__).resolve().parent.parent / "replay" / "failures"))
    d.mkdir(parents=True, exist_ok=True)
    dump(sim.router, d / f"scheduler-{_time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log", note="hypothesis failure")


EXAMPLES = int(os.environ.get("IMP_SCHED_EXAMPLES", 200))  # each example: up to 50 rules plus a drain; ~10 s on this 2-core machine


REQUEST = st.fixed_dictionaries(dict(
    length=st.integers(1, 40), family=st.integers(0, 2), n=st.integers(1, 3), priority=st.integers(0, 2),
    max_tokens=st.integers(1, 12), salt=st.sampled_from(["", "lora"]), ignore_eos=st.booleans(),
    penalty=st.booleans(), pin=st.sampled_from(["", "", "cache", "s1", "s2"]), spec=st.booleans()))


def repeating_token(seed: int, gen_index: int, seq_id: str) -> int:
    """A fake model that mostly repeats the prompts' 30-token cycle (`ids`), so that drafts are
    often right, and one token in five is `fake_token`'s (so that some are wrong)."""
    t = fake_token(seed, gen_index, seq_id)
    return t if t % 5 == 0 else 1 + (seed + gen_index) % 30


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 40), block_size=st.sampled_from([2, 4]),
                max_batch_size=st.integers(1, 6), max_step_tokens=st.integers(1, 24),
                timeout=st.sampled_from([0, 0, 40 * MS]), max_queued=st.sampled_from([0, 0, 60]),
                reserve=st.sampled_from([1, 8]), depth=st.sampled_from([1, 2]),
                admit=st.sampled_from([0, 0, 8]), once=st.booleans(), share=st.booleans(),
                spec=st.sampled_from([0, 0, 3, 8]), swap=st.sampled_from([0, 0, 3, 64]),
                tier=st.sampled_from([0, 0, 6, 200]), demote=st.booleans(), lane=st.booleans(),
                first=st.lists(REQUEST, min_size=1, max_size=6))
    def setup(self, num_blocks, block_size, max_batch_size, max_step_tokens, timeout, max_queued, reserve,
              depth, admit, once, share, spec, swap, tier, demote, lane, first):
        self.max_step_tokens = max_step_tokens
        self.sim = Sim(num_blocks, block_size, max_context=48, max_batch_size=max_batch_size,
                       max_step_tokens=max_step_tokens, request_timeout_ns=timeout, aging_ns=5 * MS,
                       max_queued_tokens=max_queued, decode_reserve=reserve,  # 1: preempts often
                       pipeline_depth=depth, admit_tokens=admit * max_step_tokens, history_once=once,
                       share_in_flight=share, spec_k_max=spec, token=repeating_token if spec else None,
                       swap_blocks=swap, tier_blocks=tier, tier_demote=demote, decode_lane=lane)
        event(f"decode lane {lane}")
        event(f"swap area {swap}")
        event(f"tier {tier} demote {demote}" if tier else "no tier")
        event(f"pipeline depth {depth}")
        event(f"speculation up to {spec}")
        event(f"history once {once}")
        event(f"share in flight {share}")
        self.n = 0
        for r in first:  # every example has work, even when swarm testing turns `submit` off
            self.submit(r)

    @rule(r=REQUEST)
    def submit(self, r):
        self.n += 1
        prompt = ids(r["length"], base=r["family"] * 10)  # families share prefixes: cache hits
        p = params(r["max_tokens"], seed=self.n * 7, ignore_eos=r["ignore_eos"],
                   repetition_penalty=1.1 if r["penalty"] else 1.0, speculative=r["spec"])
        self.sim.submit(f"q{self.n}", prompt, p, n=r["n"], priority=r["priority"], salt=r["salt"],
                        cache_prompt=r["pin"] == "cache", session_id=r["pin"] if r["pin"] in ("s1", "s2") else "")

    @rule(hold=st.booleans())
    def hold_kv(self, hold):
        """Hold KvRequests back (a step's result may then land before the next KvReply)."""
        self.sim.hold_kv.hold = hold

    @rule()
    def release_kv(self):
        self.sim.release_kv()

    @rule(sid=st.sampled_from(["s1", "s2", "nobody"]))
    def close_session(self, sid):
        self.sim.close_session(sid)

    @rule(data=st.data())
    def cancel(self, data):
        if self.sim.submits:
            req = data.draw(st.sampled_from(sorted(self.sim.submits)))
            self.sim.cancel(req, index=data.draw(st.sampled_from([-1, -1, 0, 1])))

    @rule(dt=st.integers(0, 4 * MS))
    def tick(self, dt):
        self.sim.tick(dt)

    @rule(k=st.integers(1, 4), fail=st.integers(0, 14))
    def step(self, k, fail):
        for _ in range(k):
            self.sim.step(fail=fail == 0)

    @invariant()
    def consistent(self):
        try:
            self._consistent()
        except BaseException:
            _save_failure(self.sim)
            raise

    def _consistent(self):
        sim = self.sim
        sim.kv.audit()
        core = sim.sched
        assert core._reserved() == sum(r.reserved for r in core.requests.values() if r.n_running), \
            "the incremental reservation figure drifted"
        live = set(sim.enqueued) - set(sim.finished)
        assert not live or sim.exq or sim.hold_kv.held, "work left but nothing in flight (a step, a tier load)"
        assert set(sim.enqueued) | set(sim.rejected) == set(sim.submits)
        if sim.plans:  # whatever new requests brought to planning (admit_tokens), a step computes <= its budget
            assert sum(len(w.token_ids) for w in sim.plans[-1].shares()) <= self.max_step_tokens

    def teardown(self):
        try:
            self._teardown()
        except BaseException:
            _save_failure(self.sim)
            raise

    def _teardown(self):
        sim = self.sim
        sim.drain()
        drafts = [w.draft for p in sim.plans for w in p.shares() if w.draft]
        event(f"verify shares: {'none' if not drafts else 'some' if len(drafts) < 10 else 'ten or more'}")
        sim.kv.audit()
        assert set(sim.finished) == set(sim.enqueued), "an admitted request never finished"
        # only pins may hold blocks once everything ended; closing the sessions frees theirs
        kvf = sim.kv.figures()
        assert kvf.used == kvf.pinned <= kvf.total // 2
        assert kvf.swap_used == 0 == sim.sched.swap_used and not sim.kv.swapped, "a parked sequence's slots leaked"
        for sid in ("s1", "s2"):
            sim.close_session(sid)
        sim.drain()
        sim.kv.audit()
        assert all(k.startswith("prompt:") for k in sim.kv.pins), "a closed session kept its pin"
        kvf = sim.kv.figures()
        assert kvf.used == kvf.pinned
        assert sim.figures is None or (sim.figures.kv.used - sim.figures.kv.pinned, sim.figures.kv.reserved) == (0, 0)
        event(f"requests: {min(len(sim.submits), 10)}")
        if sim.figures:
            q = sim.figures.queue
            for name in ("preemptions", "cancellations", "timeouts"):
                event(f"{name} > 0: {getattr(q, name) > 0}")
            event(f"evictions > 0: {sim.figures.kv.evictions > 0}")
            event(f"swaps > 0: {sim.figures.kv.swaps_out > 0}")
            event(f"tier hits > 0: {sim.figures.kv.tier_hits > 0}")
            event(f"pinned > 0 before close: {kvf.pinned > 0 or bool(sim.kv.pins)}")
            event(f"cache hits: {any(f.cached_tokens for f in sim.finish.values())}")
            event(f"steps >= 20: {q.steps >= 20}")
        for req, m in sim.enqueued.items():
            for i in range(m.n):
                fin = sim.finish[(req, i)]
                want, got = sim.expected(req, i), sim.output(req, i)
                if fin.finish in (FinishReason.STOP, FinishReason.LENGTH):
                    assert got == want, (req, i)
                else:
                    assert got == want[: len(got)], (req, i)


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=EXAMPLES, stateful_step_count=50, deadline=None)


@settings(max_examples=60, deadline=None)
@given(work=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 20), st.integers(1, 2), st.integers(0, 1)),
                     min_size=1, max_size=8),
       pool=st.integers(6, 16), steps_between=st.integers(0, 3))
def test_small_pool_tokens_equal_huge_pool(work, pool, steps_between):
    results = []
    for blocks in (pool, 4096):
        sim = Sim(num_blocks=blocks, block_size=4, max_context=22, max_batch_size=4, max_step_tokens=12)
        for i, (length, max_tokens, n, prio) in enumerate(work):
            sim.submit(f"w{i}", ids(length, base=i % 3), params(max_tokens, seed=i), n=n, priority=prio)
            for _ in range(steps_between):
                sim.step()
        sim.drain()
        assert sim.kv.figures().used == 0
        results.append(({k: v for k, v in sim.tokens.items()},
                        {k: f.finish for k, f in sim.finish.items()}))
    assert results[0] == results[1]


@pytest.mark.parametrize("share", [False, True])
def test_a_burst_of_one_prompt_computes_it_once_with_share_in_flight(share):
    """Four requests with one 17-token prompt arriving together (the first's prefill takes three 8-token
    steps): with share_in_flight the first computes the prompt and the others wait for its blocks, then hit
    them (only the last token's block is theirs); without it they compute it side by side. The outputs are
    the same either way."""
    sim = Sim(num_blocks=64, max_step_tokens=8, admit_tokens=64, share_in_flight=share)  # admit_tokens: as served
    for r in "abcd":
        sim.submit(r, ids(17), params(max_tokens=3, ignore_eos=True))
    sim.drain()
    prompt_rows = sum(sum(1 for i in range(len(w.token_ids)) if w.start_pos + i < 17) for p in sim.plans for w in p.shares())
    assert prompt_rows == 17 + 3 * 1 if share else prompt_rows > 17 + 3 * 1 + 8, prompt_rows
    assert all(sim.output(r) == sim.expected(r, 0) for r in "abcd")
    if share:
        assert [sim.finish[(r, 0)].cached_tokens for r in "abcd"] == [0, 16, 16, 16] and sim.kv.waits >= 3
    else:
        assert sim.kv.waits == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_the_decode_lane_gives_the_general_path_s_tokens_and_joins_the_steady_rows(depth, monkeypatch):
    """The decode lane (imp.core.lane) plans and lands the steady plain decode rows as arrays: with it the
    outputs and finishes are the general path's, in a pool small enough to preempt
    (members ejected and recomputed), with stop tokens, penalties (history sent once), a cancel mid-answer and
    a request that asks for what keeps it off the lane (logprobs); grammar rows in it end at a stop token even
    with ignore_eos, as on the general path; both choices of an n = 2 request join it."""
    from imp.core.lane import DecodeLane
    joined = []
    insert = DecodeLane.insert
    monkeypatch.setattr(DecodeLane, "insert", lambda self, s: (joined.append(s.id), insert(self, s)))
    got = []
    # r2 (a grammar, ignore_eos): a seed whose fake model draws EOS in its lane rows, before max_tokens
    eos_seed = next(x for x in range(1, 100_000) if EOS in [fake_token(x, g, "r2#0") for g in range(3, 9)]
                    and EOS not in [fake_token(x, g, "r2#0") for g in range(3)])
    for lane in (False, True):
        sim = Sim(num_blocks=14, max_batch_size=6, max_step_tokens=12, pipeline_depth=depth, decode_lane=lane,
                  history_once=True, max_context=40, decode_reserve=1)
        for i in range(9):
            p = params(6 + 2 * i, seed=eos_seed if i == 2 else i, ignore_eos=i % 2 == 0, repetition_penalty=1.1 if i % 3 == 0 else 1.0,
                       logprobs=2 if i == 4 else -1, constraint=Constraint("regex", ".*") if i in (2, 5) else None)
            sim.submit(f"r{i}", ids(5 + 2 * i, base=i % 4), p, n=2 if i == 7 else 1)
            sim.step()
        for _ in range(6):
            sim.step()
        sim.cancel("r8")
        sim.drain()
        assert sim.kv.figures().used == 0 and not sim.sched.running
        q = sim.figures.queue
        got.append((sim.tokens, {k: f.finish for k, f in sim.finish.items()}))
        assert q.preemptions > 0, "the pool should have preempted someone"  # (which one, and how often, may
        if not lane:  # differ: the lane's grows come first in a step's KV ops, so a dry pool fails another one)
            assert not joined
    assert got[0] == got[1]
    assert len(set(joined)) >= 5 and {"r2#0", "r7#0", "r7#1"} <= set(joined) and "r4#0" not in joined
    assert got[1][1][("r2", 0)] is FinishReason.STOP  # ignore_eos, but a grammar: the stop token ends it
    assert sim.sched.lane is not None and len(sim.sched.lane) == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_a_lane_member_ended_while_its_grow_is_with_the_allocator_is_dropped_from_the_step(depth):
    """A cancel that lands between a step's KvRequest (with a lane member's grow in it) and the KvReply: the member
    left the lane at once, so its answer is moot and its row does not run; the other member's does."""
    sim = Sim(num_blocks=40, block_size=4, pipeline_depth=depth)
    sim.submit("a", ids(5), params(max_tokens=30, ignore_eos=True))
    sim.submit("b", ids(6, base=3), params(max_tokens=30, ignore_eos=True))
    for _ in range(60):
        sim.hold_kv.hold = True
        sim.step()
        held = [op for m in sim.hold_kv.held for op in m.ops]
        if any(op.kind == "grow" and op.seq_id == "a#0" for op in held) and sim.sched.lane.seqs.count(None) < len(
                sim.sched.lane.seqs) - 1:
            break
        sim.hold_kv.hold = False
        while sim.release_kv():
            pass
    else:
        raise AssertionError("a#0 never grew from the lane")
    sim.cancel("a")
    assert sim.finish[("a", 0)].finish is FinishReason.CANCELLED
    sim.drain()
    assert sim.output("b") == sim.expected("b", 0) and len(sim.output("b")) == 30
    assert sim.kv.figures().used == 0 and not sim.sched.running
