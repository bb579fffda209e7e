"""Output equivalence on the real model: a greedy request gives the same tokens
alone, in a batch of 16 mixed lengths, after a preemption, and on a
prefix-cache hit.

The decision cores run in-process through the synchronous router, with the
real CPU ModelRunner as the executor: the same messages the actor system
carries, without sockets.
"""

from __future__ import annotations

import collections

import msgspec
import pytest

from imp.actors.executor import plan_works, record_samples
from imp.sampling.pending import resolve_pending
from imp.core.router import Router
from imp.config import ServerConfig
from imp.engine.cores import build_cores
from imp.messages import step_result
from imp.messages import FinishReason, SamplingParams, StepPlan, StepResult, Submit, TokenBatch, TokenOut

pytestmark = pytest.mark.slow

GEN = 10


@pytest.fixture(scope="module")
def runner(smollm2_path):
    from imp.model.runner import ModelRunner

    return ModelRunner.load(str(smollm2_path), kv_tokens=16 * 400)


@pytest.fixture(scope="module")
def prompts(runner):
    from imp.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_metadata(runner.metadata)
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()
    out = []
    for i in range(16):
        n = 2 + (i * 37) % 60  # 2 .. 61 words: mixed prefill lengths, 1..5 blocks
        text = f"Story {i}: " + " ".join(words[(i + k) % len(words)] for k in range(n))
        out.append(tok.encode(text))
    return out


class Harness:
    """Cores + router + the real model; runs until every request finished."""

    def __init__(self, runner, num_blocks: int, max_batch: int = 64, step_tokens: int = 128,
                 reserve_decode: int | None = None, depth: int = 1):
        cfg = ServerConfig(max_batch_size=max_batch, max_step_tokens=step_tokens, pipeline_depth=depth)
        self.cores = build_cores(cfg, num_blocks, runner.config.context_length, runner.fingerprint)
        if reserve_decode is not None:  # under-reserve so the pool runs dry mid-decode
            adm = self.cores[0]
            self.cores = (type(adm)(msgspec.structs.replace(adm.config, admission_decode_tokens=reserve_decode)),
                          *self.cores[1:])
        self.router = Router({c.name: c for c in self.cores})
        self.runner = runner
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, TokenOut] = {}
        self.now = 0
        self.inflight: collections.deque[StepPlan] = collections.deque()
        self.last: dict[str, int] = {}  # what the previous step sampled (pipelined plans feed it)
        self.pending_fed = 0
        self.kept: dict = {}
        self.hists: dict = {}
        self.penalty = 1.0

    @property
    def scheduler(self):
        return self.cores[1]

    def submit(self, req_id: str, prompt: list[int]) -> None:
        p = SamplingParams(max_tokens=GEN, temperature=0.0, stop_token_ids=(), seed=1,
                           repetition_penalty=self.penalty, frequency_penalty=0.3 if self.penalty != 1.0 else 0.0)
        self.now += 1
        self._drain(self.router.send([("ingress", "admission", Submit(req_id, tuple(prompt), p, self.now))]))

    def run(self) -> None:
        while self.inflight:
            plan = self.inflight.popleft()
            self.pending_fed += sum(w.pending for w in plan.shares())
            if plan.freed:  # as the executor actor does: the runner forgets freed sequences' state
                self.runner.forget(plan.freed)
            seqs = resolve_pending(plan_works(plan, self.kept, self.hists), self.last)  # as the executor actor does
            toks = self.runner.step(seqs) if seqs else []
            record_samples(toks, self.hists)
            self.last = {t.seq_id: t.token_id for t in toks}
            self.now += 1
            self._drain(self.router.send([("executor", "scheduler", step_result(plan, tuple(toks), self.now))]))

    def _drain(self, deliveries) -> None:
        for d in deliveries:
            m = d.msg
            if isinstance(m, StepPlan):
                assert len(self.inflight) < self.scheduler.config.pipeline_depth
                self.inflight.append(m)
            for t in m.each() if isinstance(m, TokenBatch) else [m] if isinstance(m, TokenOut) else []:
                self.tokens.setdefault(t.req_id, []).extend(t.token_ids)
                if t.finish != FinishReason.NONE:
                    self.finish[t.req_id] = t


def test_alone_batch_preempted_and_cached_are_identical(runner, prompts):
    # alone: each request on an empty engine
    alone = {}
    for i, p in enumerate(prompts):
        h = Harness(runner, num_blocks=400)
        h.submit(f"r{i}", p)
        h.run()
        alone[f"r{i}"] = h.tokens[f"r{i}"]
        assert len(alone[f"r{i}"]) == GEN

    # a batch of 16 mixed lengths, chunked prefill mixing with decodes
    h = Harness(runner, num_blocks=400)
    for i, p in enumerate(prompts):
        h.submit(f"r{i}", p)
    h.run()
    assert h.tokens == alone

    # a pool too small for all of them at once: preemption and recompute
    need = max(len(p) for p in prompts) + GEN
    small = Harness(runner, num_blocks=need // 16 + 4, reserve_decode=1)
    for i, p in enumerate(prompts):
        small.submit(f"r{i}", p)
    small.run()
    assert small.scheduler.preemptions > 0
    assert small.tokens == alone

    # a prefix-cache hit: the same prompt again on a warm engine
    again = Harness(runner, num_blocks=400)
    again.submit("a", prompts[15])
    again.run()
    again.submit("b", prompts[15])
    again.run()
    assert again.finish["b"].cached_tokens > 0
    assert again.tokens["b"] == again.tokens["a"] == alone["r15"]

    # pipelined (step N+1 planned while N runs, feeding the token in flight): the
    # batch and the preempting pool give the same tokens again
    piped = Harness(runner, num_blocks=400, depth=2)
    for i, p in enumerate(prompts):
        piped.submit(f"r{i}", p)
    piped.run()
    assert piped.pending_fed > 0 and piped.tokens == alone
    small = Harness(runner, num_blocks=need // 16 + 4, reserve_decode=1, depth=2)
    for i, p in enumerate(prompts):
        small.submit(f"r{i}", p)
    small.run()
    assert small.scheduler.preemptions > 0
    assert small.tokens == alone


def test_penalized_requests_alone_batched_preempted_and_pipelined_are_identical(runner, prompts):
    """Penalties read the generated tokens: the executor keeps them from a sequence's first share and appends
    what it samples (the scheduler sends the history once per admission, `history_once`); preemption
    (recompute re-sends it) and pipelining (a token in flight is not counted twice) keep the tokens."""
    ps = prompts[:6]

    def run(num_blocks, depth=1, reserve=None, only=None):
        h = Harness(runner, num_blocks=num_blocks, depth=depth, reserve_decode=reserve)
        h.penalty = 1.3
        assert h.scheduler.config.history_once
        for i, p in enumerate(ps):
            if only is None or i == only:
                h.submit(f"r{i}", p)
        h.run()
        return h

    alone = {f"r{i}": run(400, only=i).tokens[f"r{i}"] for i in range(len(ps))}
    plain = Harness(runner, num_blocks=400)
    plain.submit("x", ps[0])
    plain.run()
    assert plain.tokens["x"] != alone["r0"]  # the penalty changes the greedy tokens: the history is used
    assert run(400).tokens == alone
    need = max(len(p) for p in ps) + GEN
    for depth in (1, 2):
        small = run(need // 16 + 3, depth=depth, reserve=1)
        assert small.scheduler.preemptions > 0
        assert small.tokens == alone
    piped = run(400, depth=2)
    assert piped.pending_fed > 0 and piped.tokens == alone


def test_mirostat_alone_batched_preempted_and_pipelined_are_identical(runner, prompts):
    """Mirostat's state (mu) lives with the runner from step to step and with the scheduler through each
    SampledToken, so a seeded mirostat request draws the same tokens alone, batched, after a preemption (the
    re-admission brings the mu of its last kept token) and pipelined."""
    ps = prompts[:5]

    def run(num_blocks, version, depth=1, reserve=None, only=None):
        h = Harness(runner, num_blocks=num_blocks, depth=depth, reserve_decode=reserve)
        for i, p in enumerate(ps):
            if only is None or i == only:
                sp = SamplingParams(max_tokens=GEN, temperature=1.0, stop_token_ids=(), seed=7 + i,
                                    mirostat=version, mirostat_tau=3.0, mirostat_eta=0.2)
                h.now += 1
                h._drain(h.router.send([("ingress", "admission", Submit(f"r{i}", tuple(p), sp, h.now))]))
        h.run()
        return h

    need = max(len(p) for p in ps) + GEN
    for version in (1, 2):
        alone = {f"r{i}": run(400, version, only=i).tokens[f"r{i}"] for i in range(len(ps))}
        assert run(400, version).tokens == alone
        for depth in (1, 2):
            small = run(need // 16 + 3, version, depth=depth, reserve=1)
            assert small.scheduler.preemptions > 0
            assert small.tokens == alone, (version, depth)
        assert run(400, version, depth=2).tokens == alone
