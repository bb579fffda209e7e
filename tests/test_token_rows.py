"""The decode lane's tokens to the streams as columns (issue 33, deliverable 3's last stage): one TokenRows a
step from the scheduler through detok and ingress (and across the API servers' process boundary) to each
request's stream, where a TokenOut a row went before. Same tokens, same text, same order within a choice."""

from __future__ import annotations

import asyncio
import collections

import pytest

from imp.actors.channel import Channel
from imp.core.admission import AdmissionConfig, AdmissionCore
from imp.core.kv import KvConfig, KvCore
from imp.core.router import Router
from imp.core.scheduler import SchedulerConfig, SchedulerCore, _batch_tokens
from imp.engine import wire
from imp.engine.host import _batched
from imp.engine.port import Submission
from imp.engine.render import RenderedStream
from imp.messages import (Delta, DeltaBatch, FinishReason, Reject, SampledToken, SamplingParams, StepPlan, Submit,
                          TokenBatch, TokenOut, TokenRows, step_result, token_rows)


def test_a_handling_s_rows_stand_in_one_token_batch_where_the_first_of_them_stood():
    a, d = TokenOut("a", 0, (1,)), TokenOut("d", 0, (4,), FinishReason.STOP)
    out = [("kv", "x"), ("detok", a), ("executor", "y"), ("detok", token_rows([("b", 0, 2), ("c", 1, 3)])),
           ("detok", d), ("detok", token_rows([("e", 0, 5)]))]
    got = _batch_tokens(out)
    assert [r for r, _ in got] == ["kv", "detok", "executor"] and got[2][1] == "y"
    tb = got[1][1]
    assert tb.outs == (a, d) and tb.rows_at == 1 and tb.rows.req_ids == ("b", "c", "e")
    assert [(t.req_id, t.index, t.token_ids) for t in tb.each()] == [
        ("a", 0, (1,)), ("b", 0, (2,)), ("c", 1, (3,)), ("e", 0, (5,)), ("d", 0, (4,))]
    # without rows the batch is the one it always was (old logs replay against it)
    plain = _batch_tokens([("detok", a), ("detok", d)])
    assert plain == [("detok", TokenBatch((a, d)))] and plain[0][1].each() == [a, d]


class Drive:
    """admission + kv + scheduler, and an executor stand-in: every sampled token is 100 + its position."""

    def __init__(self, lane: bool, depth: int = 2):
        self.router = Router({
            "kv": KvCore(KvConfig(256, 4, "fake")),
            "admission": AdmissionCore(AdmissionConfig(256, 4, 256)),
            "scheduler": SchedulerCore(SchedulerConfig(256, 4, 256, 8, 64, pipeline_depth=depth, decode_lane=lane)),
        })
        self.inflight: collections.deque[StepPlan] = collections.deque()
        self.batches: list[TokenBatch] = []
        self.now = 0

    def send(self, sender, receiver, msg):
        for d in self.router.send([(sender, receiver, msg)]):
            if isinstance(d.msg, StepPlan):
                self.inflight.append(d.msg)
            elif isinstance(d.msg, TokenBatch):
                self.batches.append(d.msg)

    def run(self):
        for _ in range(2000):
            if not self.inflight:
                return
            plan = self.inflight.popleft()
            toks = [SampledToken(w.seq_id, 100 + w.start_pos + len(w.token_ids)) for w in plan.shares() if w.sample]
            self.now += 1
            self.send("executor", "scheduler", step_result(plan, tuple(toks), self.now))
        raise AssertionError("never idle")

    def tokens(self) -> dict:
        got = collections.defaultdict(list)
        for b in self.batches:
            for t in b.each():
                got[(t.req_id, t.index)] += t.token_ids
        return dict(got)


def _traffic(d: Drive) -> None:
    for i in range(6):
        d.now += 1
        params = SamplingParams(max_tokens=9 + i, ignore_eos=True, seed=i)
        d.send("ingress", "admission", Submit(f"r{i}", tuple(range(10 + i, 20 + 3 * i)), params, d.now,
                                              n=2 if i == 3 else 1))
    d.run()


def test_the_lane_sends_its_tokens_as_rows_and_they_are_the_tokens_token_outs_carried():
    with_lane, without = Drive(True), Drive(False)
    _traffic(with_lane)
    _traffic(without)
    assert with_lane.tokens() == without.tokens()
    assert len(with_lane.tokens()) == 7 and all(len(v) == 9 + int(k[0][1:]) for k, v in with_lane.tokens().items())
    rows = [b.rows for b in with_lane.batches if b.rows is not None]
    assert rows and max(len(r.req_ids) for r in rows) >= 6  # steady steps: all the streams in one TokenRows
    # a lane step's plain tokens are in its rows only: its TokenOuts are first tokens and ends
    for b in with_lane.batches:
        if b.rows is not None:
            assert not ({(t.req_id, t.index) for t in b.outs if t.finish == FinishReason.NONE}
                        & {(r, i) for r, i, _ in b.rows.rows()})
    assert all(b.rows is None for b in without.batches)


def test_ingress_gives_each_stream_its_rows_in_order_with_the_deltas():
    from imp.actors.base import Bus
    from imp.actors.ingress import IngressActor
    from imp.log.eventlog import EventLog

    async def go():
        ing = IngressActor(Bus(EventLog(None)))
        for rid in ("a", "b"):
            ing.submit(rid, [1, 2, 3], SamplingParams(max_tokens=9))
        first = Delta(TokenOut("a", 0, (5,)), "")
        end = Delta(TokenOut("b", 0, (8,), FinishReason.LENGTH, 3, 0, 2), "", FinishReason.LENGTH)
        await ing.on_message("detok", DeltaBatch((first, end), token_rows([("a", 0, 6), ("b", 0, 7), ("gone", 0, 1)]),
                                                 1))
        await ing.on_message("detok", DeltaBatch((), token_rows([("a", 0, 9)])))
        qa, qb = ing.handles["a"].queue, ing.handles["b"].queue
        assert [qa.get_nowait() for _ in range(3)] == [first, (0, 6), (0, 9)] and qa.empty()
        assert [qb.get_nowait() for _ in range(2)] == [(0, 7), end]
        ha, hb = ing.handles["a"], ing.handles["b"]
        assert (ha.generated, hb.generated, len(ha.itl)) == (3, 2, 2) and ha.first_token_at > 0 and hb.done

    asyncio.run(go())


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from imp.text.tokenizer import Tokenizer, gguf_metadata

    return Tokenizer.from_gguf_metadata(gguf_metadata(smollm2_path))


def _stream_text(tokenizer, items, stop=()) -> tuple[str, list, list]:
    """Render `items` (Deltas and row tuples, as a stream's queue holds them) all at once: the chunks' texts,
    their finishes and the choices asked to stop."""
    q = Channel()
    for it in items:
        q.put_nowait(it)
    stopped = []
    sub = Submission(req_id="r", prompt=(1, 2, 3), params=SamplingParams(max_tokens=50), stop=stop)
    rs = RenderedStream(tokenizer, sub, q, stopped.append, lambda: None)

    async def go():
        out = []
        async for d in rs:
            out.append(d)
        return out

    out = asyncio.run(go())
    return "".join(d.text for d in out), [(d.finish, d.out.completion_tokens) for d in out], stopped


def test_a_stream_renders_rows_as_it_renders_token_outs_stop_strings_too(tokenizer):
    ids = tokenizer.encode("Hello there, friend! The capital of France is Paris, a city of light.")
    n = len(ids)
    last = TokenOut("r", 0, (), FinishReason.LENGTH, 3, 0, n)

    def as_deltas():
        return [Delta(TokenOut("r", 0, (t,)), "") for t in ids] + [Delta(last, "", FinishReason.LENGTH)]

    def as_rows():
        return [Delta(TokenOut("r", 0, (ids[0],)), "")] + [(0, t) for t in ids[1:]] + [Delta(last, "",
                                                                                             FinishReason.LENGTH)]

    text_d, fin_d, _ = _stream_text(tokenizer, as_deltas())
    text_r, fin_r, _ = _stream_text(tokenizer, as_rows())
    assert text_r == text_d == tokenizer.decode(ids) and fin_r == fin_d == [(FinishReason.LENGTH, n)]  # one chunk
    # a stop string inside the rows: the same text, the same count, and the choice asked to stop
    sd = _stream_text(tokenizer, as_deltas(), stop=("Paris",))
    sr = _stream_text(tokenizer, as_rows(), stop=("Paris",))
    assert sr == sd and sr[0].endswith("France is ") and sr[2] == [0] and sr[1][0][0] == FinishReason.STOP


def test_rows_cross_the_process_boundary_as_token_rows_in_order():
    a = Delta(TokenOut("a", 0, (5,)), "")
    rej = Reject("c", 429, "queue_full", "full")
    frames = [a, ("a", 0, 6), ("b", 1, 7), rej, ("a", 0, 8), wire.Bye(), ("b", 1, 9)]
    got = _batched(frames)
    assert [type(f) for f in got] == [wire.Items, wire.Bye, wire.Items]
    items = got[0].items
    assert items[0] == a and items[2] == rej and items[3].rows() == [("a", 0, 8)]
    assert items[1].rows() == [("a", 0, 6), ("b", 1, 7)] and got[2].items[0].rows() == [("b", 1, 9)]
    back = wire.decode(wire.encode(got))
    assert back[0] == got[0] and type(back[0].items[1]) is TokenRows and back[2] == got[2]
