"""Scheduler features behind the HTTP surface: EndThinking (forced tokens) and
prompt logprobs (every prompt row scored once, no prefix-cache reuse).

Driven through the real admission + kv + scheduler cores by a tiny fake
executor: every sampled token is SAMPLED, and prompt rows are "scored" with
their position, so what reaches detok can be checked exactly.
"""

from __future__ import annotations

from imp.core.admission import AdmissionConfig, AdmissionCore
from imp.core.kv import KvConfig, KvCore
from imp.core.scheduler import SchedulerConfig, SchedulerCore
from imp.core.router import Router
import collections

from imp.messages import step_result
from imp.messages import (
    PENDING_TOKEN, EndThinking, FinishReason, KvRequest, PromptLogprob, SampledToken, SamplingParams, StepPlan,
    StepResult, Submit, TokenBatch, TokenOut,
)

SAMPLED, THINK_END = 5, (8, 9)


class Drive:
    def __init__(self, max_step_tokens=16, depth=1):
        self.router = Router({
            "kv": KvCore(KvConfig(64, 4, "fake")),
            "admission": AdmissionCore(AdmissionConfig(64, 4, 128)),
            "scheduler": SchedulerCore(SchedulerConfig(64, 4, 128, 8, max_step_tokens, pipeline_depth=depth)),
        })
        self.inflight: collections.deque[StepPlan] = collections.deque()
        self.plans: list[StepPlan] = []
        self.outs: list[TokenOut] = []
        self.kv_ops = []
        self.now = 0

    def send(self, sender, receiver, msg):
        for d in self.router.send([(sender, receiver, msg)]):
            self._see(d.msg)
        for d in self.router.log:
            if isinstance(d.msg, KvRequest) and d.msg not in self.kv_ops:
                self.kv_ops.append(d.msg)

    def _see(self, m):
        if isinstance(m, StepPlan):
            self.inflight.append(m)
            self.plans.append(m)
        elif isinstance(m, TokenBatch):
            self.outs += m.each()
        elif isinstance(m, TokenOut):
            self.outs.append(m)

    def submit(self, rid, prompt, **kw):
        self.now += 1
        self.send("ingress", "admission", Submit(rid, tuple(prompt), SamplingParams(**kw), self.now))

    @property
    def plan(self) -> StepPlan | None:
        return self.inflight[0] if self.inflight else None

    def step(self) -> bool:
        if not self.inflight:
            return False
        plan = self.inflight.popleft()
        toks = []
        for w in plan.shares():
            entries = ()
            if w.prompt_logprobs >= 0:
                targets = list(w.token_ids[1:]) + ([w.prompt_next] if w.prompt_next >= 0 else [])
                entries = tuple(PromptLogprob(w.start_pos + 1 + j, t, -float(w.start_pos + 1 + j), 1)
                                for j, t in enumerate(targets))
            if w.sample:
                toks.append(SampledToken(w.seq_id, SAMPLED, prompt=entries))
            elif entries:
                toks.append(SampledToken(w.seq_id, -1, prompt=entries))
        self.now += 1
        self.send("executor", "scheduler", step_result(plan, tuple(toks), self.now))
        return True

    def run(self, limit=500):
        for _ in range(limit):
            if not self.step():
                return
        raise AssertionError("never idle")

    def tokens(self, rid, index=0):
        return [t for o in self.outs if o.req_id == rid and o.index == index for t in o.token_ids]


def test_end_thinking_forces_the_tokens_and_the_answer_continues():
    d = Drive()
    d.submit("r", list(range(10, 20)), max_tokens=8, ignore_eos=True)
    d.step()  # prefill + first token
    d.step()
    d.send("ingress", "admission", EndThinking("r", THINK_END))
    d.run()
    out = d.tokens("r")
    assert out[:2] == [SAMPLED, SAMPLED]
    assert tuple(out[2:4]) == THINK_END  # forced, in order, then the model goes on
    assert all(t == SAMPLED for t in out[4:]) and len(out) >= 8
    fin = [o for o in d.outs if o.req_id == "r" and o.finish]
    assert len(fin) == 1 and fin[0].finish == FinishReason.LENGTH
    assert fin[0].completion_tokens == len(out)
    # the forced tokens were fed to the model (KV written), at the right positions
    fed = [(w.start_pos, w.token_ids) for p in d.plans for w in p.shares() if w.seq_id == "r#0"]
    assert (12, [SAMPLED, *THINK_END]) in fed or any(THINK_END[0] in ids for _, ids in fed)


def test_end_thinking_while_the_step_is_in_flight_drops_that_sample():
    d = Drive()
    d.submit("r", list(range(10, 20)), max_tokens=6, ignore_eos=True)
    d.step()
    assert d.plan is not None  # the next decode is in flight
    d.send("ingress", "admission", EndThinking("r", THINK_END))
    d.run()
    out = d.tokens("r")
    assert out[:3] == [SAMPLED, *THINK_END]  # the in-flight token was drawn before them: dropped


def test_end_thinking_with_two_steps_in_flight():
    """Pipelined: the decode in flight and the one planned behind it (feeding
    its pending token) both belong to the old context; the forced tokens are
    fed right after the last token delivered, and the answer goes on."""
    d = Drive(depth=2)
    d.submit("r", list(range(10, 20)), max_tokens=6, ignore_eos=True)
    d.step()  # prefill + first token; two decodes are now in flight
    assert len(d.inflight) == 2 and d.inflight[-1].shares()[0].token_ids == (PENDING_TOKEN,)
    d.send("ingress", "admission", EndThinking("r", THINK_END))
    d.run()
    out = d.tokens("r")
    assert out[:3] == [SAMPLED, *THINK_END] and out[3:] == [SAMPLED] * (len(out) - 3) and len(out) >= 6
    after = [(w.start_pos, w.token_ids) for p in d.plans[3:] for w in p.shares()]
    assert after[0] == (10, (SAMPLED, *THINK_END))  # position 10 = the first generated token


def test_end_thinking_for_a_finished_request_is_ignored():
    d = Drive()
    d.submit("r", [1, 2, 3], max_tokens=2, ignore_eos=True)
    d.run()
    n = len(d.outs)
    d.send("ingress", "admission", EndThinking("r", THINK_END))
    d.send("ingress", "admission", EndThinking("never", THINK_END))
    assert len(d.outs) == n and d.plan is None


def test_prompt_logprobs_score_every_prompt_token_once_across_chunks():
    d = Drive(max_step_tokens=16)
    prompt = list(range(100, 140))  # 40 tokens: three prefill chunks
    d.submit("p", prompt, max_tokens=3, prompt_logprobs=2)
    d.run()
    firsts = [o for o in d.outs if o.req_id == "p" and o.token_ids]
    assert [e.position for e in firsts[0].prompt_logprobs] == list(range(1, 40))
    assert [e.token_id for e in firsts[0].prompt_logprobs] == prompt[1:]
    assert all(not o.prompt_logprobs for o in firsts[1:])
    works = [w for p in d.plans for w in p.shares() if w.prompt_logprobs >= 0]
    assert len(works) == 3 and [w.prompt_next for w in works] == [prompt[16], prompt[32], -1]


def test_prompt_logprobs_never_reuse_the_prefix_cache():
    d = Drive()
    prompt = list(range(200, 230))
    d.submit("a", prompt, max_tokens=2)
    d.run()
    d.submit("b", prompt, max_tokens=2)  # reuses a's cached blocks
    d.run()
    d.submit("c", prompt, max_tokens=2, prompt_logprobs=0)  # must not
    d.run()
    cached = {o.req_id: o.cached_tokens for o in d.outs if o.finish}
    assert cached["b"] > 0 and cached["c"] == 0


def test_two_grows_that_fail_together_preempt_one_sequence_not_both():
    """A pool that two running sequences fill, both needing a block in the same step: the worse one (here the
    lane's row, first in the failures) is its own victim, and its blocks are the other's next grow. It used to
    preempt the other too (one victim per failure): both recomputed, and where they fit the pool again together
    they failed together again, for ever (the scheduler machine's hypothesis run found that loop)."""
    cores = {
        "kv": KvCore(KvConfig(6, 4, "fake")),
        "admission": AdmissionCore(AdmissionConfig(6, 4, 64, admission_decode_tokens=0)),  # reserve the prompts
        "scheduler": SchedulerCore(SchedulerConfig(6, 4, 64, 8, 64, decode_lane=True)),
    }
    d = Drive()
    d.router = Router(cores)
    sched = cores["scheduler"]
    d.now += 1  # 3 blocks each; "better" is admitted a step later with one token more: both need a 4th at step 3
    d.send("ingress", "admission", Submit("worse", tuple(range(10, 21)), SamplingParams(max_tokens=8, ignore_eos=True),
                                          d.now, priority=1))
    d.submit("better", list(range(30, 42)), max_tokens=8, ignore_eos=True, logprobs=1)  # off the lane
    seen = []
    for _ in range(200):
        if not d.step():
            break
        seen.append(sched.preemptions)
    assert seen and seen[-1] >= 1
    assert min(p for p in seen if p) == 1  # the first failure preempted one sequence
    assert len(d.tokens("worse")) == 8 and len(d.tokens("better")) == 8


def test_the_waiting_order_without_a_sort_is_the_sorted_order_at_every_clock():
    """`SchedulerCore._waiting_order` merges the waiting list's two parts instead of sorting it by `_key` every
    step: the same order whatever the clock reads (aging ties and remainders at their edges included)."""
    import random

    rng = random.Random(3)
    cfg = SchedulerConfig(4, 4, 128, 8, 16, aging_ns=7_000)
    d = Drive()
    d.router = Router({"kv": KvCore(KvConfig(4, 4, "fake")), "admission": AdmissionCore(AdmissionConfig(4, 4, 128)),
                       "scheduler": SchedulerCore(cfg)})
    core = d.router.cores["scheduler"]
    for i in range(40):
        d.now = rng.choice([d.now, d.now + rng.randrange(1, 120)])  # (keys that differ by the aging term's one)
        d.send("ingress", "admission", Submit(f"q{i}", tuple(range(1, rng.randint(2, 15))),
                                              SamplingParams(max_tokens=2), d.now, priority=rng.choice([0, 0, 1]),
                                              n=rng.choice([1, 1, 2])))
    assert len(core.waiting) > 30
    for now in [d.now + k for k in range(0, 30_000, 37)] + [d.now + 7_000 * k for k in range(5)]:
        core.now = now
        want = sorted(core.waiting, key=lambda s: (not ((s.guided or s.shadow) and s.req.n_running), core._key(s)))
        assert [s.id for s in core._waiting_order()] == [s.id for s in want], now
