"""docs/STEP.md, checked against a real engine's event log.

A real in-process engine (every actor on one bus, the CPU runner on a tiny synthetic GGUF)
serves one request at pipeline depth 1 and at depth 2 with an event log; the log is read back
and the messages of each step are extracted and compared, in order, sender -> receiver, with
the lists below. STEP.md holds the same lists, rendered by `block`, so the page cannot drift
from what the engine does.

A step's messages, taken from the log:
  - its KvRequest, KvReply, StepPlan and StepResult (their `step` field is the step's number);
  - what the scheduler sent while handling that KvReply and that StepResult. The log does not
    say which handling sent what; the scheduler core does: it is fed again the messages the
    log says it received, in order (as `python -m imp replay` does), and each handling's
    outputs are matched with the next envelopes it sent;
  - detok's DeltaBatch that renders the step's TokenBatch (detok is FIFO: the k-th TokenBatch
    it receives becomes the k-th DeltaBatch it sends);
  - for the first step, the request's arrival (what was logged before its KvRequest).
Ticks are left out: the clock sends one every 0.25 s to each scheduler whenever it likes, and
the scheduler answers one with nothing unless a request timed out or a session expired.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import msgspec
import pytest

from imp.log.eventlog import Envelope, read_log
from imp.messages import (PENDING_TOKEN, DeltaBatch, KvReply, KvRequest, SamplingParams, StepPlan, StepResult,
                          StepStats, Tick, TokenBatch)

ROOT = Path(__file__).resolve().parent.parent
PROMPT = tuple(range(40, 60))  # 20 tokens: two KV blocks of 16, prefilled in one step
MAX_TOKENS = 4

Line = tuple[str, str, str]  # sender, receiver, message type

ARRIVAL: list[Line] = [
    ("ingress", "detok", "DetokOpen"),
    ("ingress", "admission", "Submit"),
    ("admission", "scheduler", "Enqueue"),
]
NEXT: Line = ("scheduler", "kv", "KvRequest")  # the next step's, planned in the same handling (depth 1)

# pipeline depth 1 (the CPU default): steps 1 (prefill) .. 4 (the 4th token), 5 (frees only)
DEPTH1: dict[str, tuple[int, list[Line]]] = {
    "prefill": (1, ARRIVAL + [
        ("scheduler", "kv", "KvRequest"),  # alloc: the prompt's blocks (prefix cache hits reused)
        ("kv", "scheduler", "KvReply"),
        ("scheduler", "executor", "StepPlan"),  # the whole prompt, sample=True
        ("executor", "scheduler", "StepResult"),  # the first token
        ("scheduler", "detok", "TokenBatch"),
        ("scheduler", "metrics", "StepStats"),
        ("scheduler", "metrics", "Figures"),
        NEXT,
        ("detok", "ingress", "DeltaBatch"),
    ]),
    "decode": (2, [
        ("scheduler", "kv", "KvRequest"),  # a grow when a block fills (else no op: still one KvRequest a step)
        ("kv", "scheduler", "KvReply"),
        ("scheduler", "executor", "StepPlan"),  # one token a sequence
        ("executor", "scheduler", "StepResult"),
        ("scheduler", "detok", "TokenBatch"),
        ("scheduler", "metrics", "StepStats"),
        ("scheduler", "metrics", "Figures"),
        NEXT,
        ("detok", "ingress", "DeltaBatch"),
    ]),
    "last": (MAX_TOKENS, [
        ("scheduler", "kv", "KvRequest"),
        ("kv", "scheduler", "KvReply"),
        ("scheduler", "executor", "StepPlan"),
        ("executor", "scheduler", "StepResult"),
        ("scheduler", "detok", "TokenBatch"),  # finish=LENGTH, with the usage counts
        ("scheduler", "admission", "Finished"),
        ("scheduler", "metrics", "StepStats"),
        ("scheduler", "metrics", "Figures"),
        NEXT,  # the free (and pins) of the finished sequence
        ("detok", "ingress", "DeltaBatch"),
    ]),
    "frees only": (MAX_TOKENS + 1, [
        ("scheduler", "kv", "KvRequest"),
        ("kv", "scheduler", "KvReply"),
        ("scheduler", "metrics", "Figures"),  # no StepPlan: nothing to run
    ]),
}


def depth2(lines: list[Line]) -> list[Line]:
    """At depth 2 a step's messages are depth 1's without the next step's KvRequest: that one is
    sent by whichever handling first finds fewer than 2 steps in flight (of KvReply(N), right
    after StepPlan(N), or of StepResult(N-1)), which depends on when the executor answers."""
    own = lines.index(("scheduler", "kv", "KvRequest"))  # the step's own; a later one is the next step's
    return [ln for i, ln in enumerate(lines) if i <= own or ln != NEXT]


def block(depth: int, name: str, step: int, lines: list[Line]) -> str:
    """One list as STEP.md writes it."""
    head = f"depth {depth}, {name} (step {step}):"
    return "\n".join([head] + [f"{i:>3}. {s} -> {r}: {t}" for i, (s, r, t) in enumerate(lines, 1)])


def _run_engine(tmp: Path, depth: int):
    """One request through a real in-process engine at `depth`; the event log it wrote (header, envelopes)."""
    from imp.config import ServerConfig
    from imp.engine.local import LocalEngine
    from imp.engine.port import Submission
    from imp.model.runner import ModelRunner
    from imp.text.tokenizer import Tokenizer
    from tests.fixtures.synth import write_synthetic_gguf

    path = write_synthetic_gguf(tmp / "tiny.gguf", n_layers=1)
    log = tmp / f"depth{depth}.log"
    cfg = ServerConfig(model=path, event_log=str(log), kv_cache_tokens=256, pipeline_depth=depth, threads=1,
                       responses_store="off")
    # the torch reference forward where torch is installed: the same messages, and no Numba compile on a cold
    # cache (the fused forward's kernels take minutes to compile once on 2 cores)
    weights = "f32" if importlib.util.find_spec("torch") else "gguf"
    runner = ModelRunner.load(path, block_size=cfg.block_size, kv_tokens=cfg.kv_cache_tokens, weights=weights,
                              num_threads=1)

    async def main():
        eng = LocalEngine(cfg, [runner], Tokenizer.from_gguf_metadata(runner.metadata), "tiny")
        await eng.start()
        try:
            items = [i async for i in eng.submit(Submission("r1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS)))]
        finally:
            await eng.stop()
        assert sum(len(d.token_ids) for d in items) == MAX_TOKENS and items[-1].finish, items

    asyncio.run(main())
    header, envs = read_log(log)
    return header, list(envs)


def handlings(envs: list[Envelope], config: dict) -> dict[int, list[Envelope]]:
    """The seq of every message the scheduler received -> the envelopes its handling sent."""
    from imp.core.scheduler import SchedulerConfig, SchedulerCore

    core = SchedulerCore(msgspec.convert(config, SchedulerConfig))
    sent = iter([e for e in envs if e.sender == "scheduler"])
    out: dict[int, list[Envelope]] = {}
    for e in envs:
        if e.receiver == "scheduler":
            outs = core.handle(e.sender, e.payload)
            mine = out[e.seq] = [next(sent) for _ in outs]
            assert [(s.receiver, s.payload) for s in mine] == outs, f"the scheduler diverges from the log at {e.seq}"
    return out


def step_lines(envs: list[Envelope], by: dict[int, list[Envelope]], step: int, depth: int = 1) -> list[Line]:
    def at(kind) -> Envelope | None:
        return next((e for e in envs if type(e.payload) is kind and e.payload.step == step), None)

    picked = {e.seq: e for e in (at(KvRequest), at(KvReply), at(StepPlan), at(StepResult)) if e is not None}
    for e in (at(KvReply), at(StepResult)):
        if e is not None:
            picked.update((s.seq, s) for s in by[e.seq])
    tbs = [e for e in envs if type(e.payload) is TokenBatch]
    dbs = [e for e in envs if type(e.payload) is DeltaBatch]
    picked.update((dbs[tbs.index(e)].seq, dbs[tbs.index(e)]) for e in list(picked.values()) if e in tbs)
    if step == 1:
        picked.update((e.seq, e) for e in envs if e.seq < at(KvRequest).seq)
    if depth == 2:
        picked = {s: e for s, e in picked.items() if type(e.payload) is not KvRequest or e.payload.step == step}
    return [(e.sender, e.receiver, type(e.payload).__name__) for _, e in sorted(picked.items())]


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> dict[int, tuple[list[Envelope], dict[int, list[Envelope]]]]:
    """depth -> (the log without Ticks, the scheduler's handlings)"""
    out = {}
    for depth in (1, 2):
        header, envs = _run_engine(tmp_path_factory.mktemp(f"d{depth}"), depth)
        out[depth] = [e for e in envs if type(e.payload) is not Tick], handlings(envs, header.configs["scheduler"])
    return out


@pytest.mark.parametrize("depth", [1, 2])
def test_the_steps_of_one_request_are_the_ones_step_md_states(logs, depth):
    envs, by = logs[depth]
    for name, (step, lines) in DEPTH1.items():
        want = lines if depth == 1 else depth2(lines)
        assert step_lines(envs, by, step, depth) == want, f"depth {depth}, {name} step {step}"
    assert max(e.payload.step for e in envs if type(e.payload) is KvRequest) == MAX_TOKENS + 1


def _first(envs, kind, step) -> int:
    return next(e.seq for e in envs if type(e.payload) is kind and e.payload.step == step)


def test_depth_2_plans_a_step_before_the_one_before_it_has_landed(logs):
    """Depth 2: the scheduler sends KvRequest(N+1) before it handles StepResult(N), whose
    StepStats it sends; depth 1: in that handling. A share planned while its last token is in
    flight feeds PENDING_TOKEN (pending=1); the executor fills it in."""
    for depth, (envs, _) in logs.items():
        for n in range(1, MAX_TOKENS):
            before = _first(envs, KvRequest, n + 1) < _first(envs, StepStats, n)
            assert before == (depth == 2), f"depth {depth}: KvRequest({n + 1}) vs StepResult({n})'s handling"
        shares = [w for e in envs if type(e.payload) is StepPlan for w in e.payload.shares()]
        assert all((w.token_ids == (PENDING_TOKEN,)) == (w.pending == 1) for w in shares)
        assert any(w.pending for w in shares) == (depth == 2)


def test_step_md_states_each_list():
    doc = (ROOT / "docs" / "STEP.md").read_text()
    blocks = [block(1, name, step, lines) for name, (step, lines) in DEPTH1.items()]
    blocks.append(block(2, "decode", DEPTH1["decode"][0], depth2(DEPTH1["decode"][1])))
    for b in blocks:
        assert b in doc, f"docs/STEP.md lacks (or changed):\n{b}"
