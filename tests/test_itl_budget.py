"""The ITL target (issue 33's admission that keeps latency, `--itl-target-ms`): a prompt chunk that
shares a step with decode rows is cut to what the measured step costs say fits the target, a step
without decode rows keeps the whole budget, and with the target off the plans are the ones before
(imp/core/itl.py, imp/core/scheduler.py). Driven with the real scheduler and KV cores and a fake
executor whose step times follow a known cost model."""

from __future__ import annotations

from imp.core.itl import ItlBudget
from imp.core.kv import KvConfig, KvCore
from imp.core.scheduler import SchedulerConfig, SchedulerCore
from imp.messages import step_result
from imp.messages import Enqueue, KvRequest, SampledToken, SamplingParams, SeqWork, StepPlan, StepResult, Submit

MS = 1_000_000
DECODE_NS, TOKEN_NS = 20 * MS, MS  # the fake device: a step = 20 ms with decode rows + 1 ms a prompt token


def test_budget_from_measured_costs():
    b = ItlBudget(60 * MS, 16, 512)
    assert b.cap() == 512  # nothing measured yet
    b.observe(20 * MS, 0, 8)  # a decode-only step
    b.observe(20 * MS + 256 * MS, 256, 8)  # a mixed step: 256 prompt tokens at 1 ms beside the decode
    assert (b.decode_ns, b.token_ns) == (20 * MS, MS)
    assert b.cap() == 40  # (60 - 20) ms / 1 ms
    b.observe(10 * MS, 8, 8)  # too few prompt tokens to say what one costs: ignored
    assert b.token_ns == MS
    assert ItlBudget(10 * MS, 16, 512).cap() == 512
    slow = ItlBudget(21 * MS, 16, 512)  # a decode step near the target itself
    slow.observe(20 * MS, 0, 4)
    slow.observe(120 * MS, 100, 0)
    assert slow.cap() == 16  # twice the decode step: 20 ms of prompt at 1.2 ms a token is 16 tokens
    tiny = ItlBudget(30 * MS, 16, 512)
    tiny.observe(5 * MS, 0, 4)
    tiny.observe(500 * MS, 100, 0)
    assert tiny.cap() == 16  # never below one block: a prompt always progresses
    off = ItlBudget(0, 16, 512)
    off.observe(20 * MS, 0, 8)
    assert off.cap() == 512 and off.decode_ns == 0


class Sim:
    """Scheduler + KV cores, a fake executor: each StepPlan lands with the cost model's time."""

    def __init__(self, itl_target_ns: int, timed: bool = False):
        self.timed = timed  # a GPU's pipelined executor: its wall (3x here) holds the step before; device_ns is its own
        cfg = SchedulerConfig(num_blocks=512, block_size=16, max_context=4096, max_batch_size=16,
                              max_step_tokens=512, history_once=True, itl_target_ns=itl_target_ns)
        self.sch, self.kv = SchedulerCore(cfg), KvCore(KvConfig(num_blocks=512, block_size=16))
        self.now, self.plans, self.queue = 0, [], []

    def submit(self, rid: str, prompt_len: int, max_tokens: int) -> None:
        sub = Submit(rid, tuple(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                     self.now)
        self.queue += self.sch.handle("admission", Enqueue(sub, 4))

    def run(self, steps: int) -> None:
        for _ in range(steps):
            plan = None
            while self.queue:
                to, msg = self.queue.pop(0)
                if to == "kv" and isinstance(msg, KvRequest):
                    self.queue += self.kv.handle("scheduler", msg)
                elif to == "scheduler":
                    self.queue += self.sch.handle("kv", msg)
                elif to == "executor" and isinstance(msg, StepPlan):
                    plan = msg
            if plan is None:
                return
            self.plans.append(plan)
            prompt = sum(len(w.token_ids) for w in plan.shares() if not (len(w.token_ids) == 1 and w.sample))
            decode = len(plan.shares()) - sum(1 for w in plan.shares() if not (len(w.token_ids) == 1 and w.sample))
            elapsed = (DECODE_NS if decode else 0) + TOKEN_NS * prompt
            self.now += elapsed
            toks = tuple(SampledToken(w.seq_id, 7) for w in plan.shares() if w.sample)
            res = step_result(plan, toks, self.now, 3 * elapsed, elapsed) if self.timed else \
                step_result(plan, toks, self.now, elapsed)
            self.queue += self.sch.handle("executor", res)


def _prompt_rows(plan: StepPlan) -> int:
    return sum(len(w.token_ids) for w in plan.shares() if len(w.token_ids) > 1)


def _decode_rows(plan: StepPlan) -> int:
    return sum(1 for w in plan.shares() if len(w.token_ids) == 1 and w.sample)


def _run(itl_target_ns: int, timed: bool = False) -> Sim:
    sim = Sim(itl_target_ns, timed)
    for i in range(4):  # four streams decoding
        sim.submit(f"r{i}", 40, 400)
    sim.run(30)
    sim.submit("big", 1500, 8)  # then a long prompt arrives beside them
    sim.run(40)
    return sim


def test_prompt_chunks_beside_decode_rows_fit_the_target():
    sim = _run(60 * MS)
    mixed = [p for p in sim.plans[30:] if _decode_rows(p) and _prompt_rows(p)]
    assert mixed, "the long prompt shared steps with the streams"
    # the budget's estimate: (60 - 20) ms / 1 ms = 40 prompt tokens beside the decode rows
    assert max(_prompt_rows(p) for p in mixed[1:]) <= 40
    assert all(DECODE_NS + TOKEN_NS * _prompt_rows(p) <= 60 * MS for p in mixed[1:])
    # the long prompt still completes (the streams keep decoding meanwhile)
    assert any(w.seq_id.startswith("big") and w.sample for p in sim.plans for w in p.shares())


def test_a_timed_device_s_own_step_time_is_what_the_budget_learns():
    """On a GPU the executor's wall from plan to tokens also holds the step in flight before it; the runner's
    device time (StepResult.device_ns) is what a step costs, and the budget follows it, not the wall."""
    sim = _run(60 * MS, timed=True)
    assert (sim.sch.itl.decode_ns, sim.sch.itl.token_ns) == (DECODE_NS, TOKEN_NS)
    mixed = [p for p in sim.plans[30:] if _decode_rows(p) and _prompt_rows(p)]
    assert mixed and max(_prompt_rows(p) for p in mixed[1:]) <= 40
    assert StepResult(1, (), 0, 9, 4).cost_ns == 4 and StepResult(1, (), 0, 9).cost_ns == 9


def test_the_flag_reaches_the_scheduler_and_is_off_by_default():
    import argparse

    import pytest

    from imp.config import ServerConfig, add_serve_args, config_from_args
    from imp.engine.cores import build_cores

    p = argparse.ArgumentParser()
    add_serve_args(p)
    cfg = config_from_args(p.parse_args(["--itl-target-ms", "40"]))
    assert build_cores(cfg, 64, 2048, "m")[1].config.itl_target_ns == 40 * MS
    assert build_cores(ServerConfig(), 64, 2048, "m")[1].config.itl_target_ns == 0
    with pytest.raises(ValueError, match="--itl-target-ms must be >= 0"):
        ServerConfig(itl_target_ms=-1)


def test_a_decode_step_past_the_target_still_lets_prompts_in():
    b = ItlBudget(100 * MS, 16, 512)
    b.observe(400 * MS, 0, 8)  # a large model on a CPU: decode alone takes 400 ms
    b.observe(400 * MS + 256 * 5 * MS, 256, 8)  # 5 ms a prompt token
    assert b.cap() == 80  # a mixed step of twice the decode: 400 ms of prompt = 80 tokens


def test_off_keeps_the_plans_of_before():
    a, b = _run(0), _run(0)
    assert [p.shares() for p in a.plans] == [p.shares() for p in b.plans]
    mixed = [p for p in a.plans[30:] if _decode_rows(p) and _prompt_rows(p)]
    assert max(_prompt_rows(p) for p in mixed) > 400  # whole max_step_tokens chunks beside the decodes


def test_a_step_without_decode_rows_keeps_the_whole_budget():
    sim = Sim(60 * MS)
    sim.sch.itl.decode_ns = DECODE_NS  # costs known: the cap is 40
    sim.sch.itl.observe(DECODE_NS + 256 * TOKEN_NS, 256, 4)
    sim.submit("alone", 1000, 4)
    sim.run(3)
    assert [_prompt_rows(p) for p in sim.plans[:2]] == [512, 488]  # nobody waits on it: whole step budgets


def test_the_ratio_policy_caps_a_step_at_ratio_decode_steps_unless_the_backlog_needs_more():
    from imp.core.itl import DRAIN_STEPS

    b = ItlBudget(0, 16, 2048, ratio=2.5)
    assert b.cap(10_000) == 2048  # nothing measured yet
    b.observe(20 * MS, 0, 8)
    b.observe(20 * MS + 256 * MS, 256, 8)
    assert (b.decode_ns, b.token_ns) == (20 * MS, MS)
    assert b.cap(0) == 30  # (2.5 - 1) x 20 ms / 1 ms
    assert b.cap(100) == 30  # a small backlog: the ratio's room
    assert b.cap(100 * DRAIN_STEPS) == 100  # a backlog drains over DRAIN_STEPS steps
    assert b.cap(10**9) == 2048
    both = ItlBudget(60 * MS, 16, 2048, ratio=2.5)  # a target, where given, is the policy
    assert both.ratio == 0.0 and both.on


def _run_ratio(big: int) -> Sim:
    sim = Sim(0)
    sim.sch.itl.ratio = 2.5
    for i in range(4):
        sim.submit(f"r{i}", 40, 400)
    sim.run(30)
    for k in range(big):
        sim.submit(f"big{k}", 1500, 8)
    sim.run(60)
    return sim


def test_a_rare_arrival_stalls_the_streams_at_most_ratio_decode_steps():
    sim = _run_ratio(1)
    mixed = [p for p in sim.plans[30:] if _decode_rows(p) and _prompt_rows(p)]
    assert mixed
    # (2.5 - 1) x 20 ms / 1 ms = 30 prompt tokens, or the backlog over DRAIN_STEPS (1500 / 32 = 47) beside them
    assert all(DECODE_NS + TOKEN_NS * _prompt_rows(p) <= 2.5 * DECODE_NS + 47 * TOKEN_NS for p in mixed[1:])
    assert max(_prompt_rows(p) for p in mixed[1:]) <= 47
    assert any(w.seq_id.startswith("big0") and w.sample for p in sim.plans for w in p.shares())


def test_a_backlog_widens_the_chunks_so_the_queue_drains():
    one, many = _run_ratio(1), _run_ratio(12)
    widest = lambda sim: max(_prompt_rows(p) for p in sim.plans[31:] if _decode_rows(p) and _prompt_rows(p))  # noqa: E731
    assert widest(many) > 2 * widest(one)  # 12 x 1500 waiting tokens: chunks of ~560 instead of ~47


def test_the_auto_step_budget_and_ratio_follow_the_device():
    from imp.config import ServerConfig, step_tokens
    from imp.engine.cores import build_cores

    cpu, gpu = ServerConfig(), ServerConfig(device="cuda:0")
    assert (step_tokens(cpu), step_tokens(gpu)) == (512, 1024)
    assert build_cores(ServerConfig(itl_ratio=2.5), 64, 2048, "m")[1].config.itl_ratio == 2.5
    # auto: 3 on a GPU (the 8B shape's ITL p99 4.2x -> 2.6x p50 at 16 streams on the H100), off on a CPU
    assert build_cores(gpu, 64, 2048, "m")[1].config.itl_ratio == 3.0
    assert build_cores(cpu, 64, 2048, "m")[1].config.itl_ratio == 0.0
    assert build_cores(ServerConfig(device="cuda:0", itl_ratio=0), 64, 2048, "m")[1].config.itl_ratio == 0.0
    assert step_tokens(ServerConfig(device="cuda:0", max_step_tokens=512)) == 512
    import pytest

    with pytest.raises(ValueError, match="--itl-ratio"):
        ServerConfig(itl_ratio=0.5)


def test_a_fixed_cost_of_prompt_rows_is_fitted_apart_from_their_per_token_cost():
    """A GPU's mixed step costs a fixed part beside its decode rows whatever its prompt rows (H100, SmolLM2:
    36 prompt tokens beside 11 decodes 3.45 ms, 453 beside 9 4.14 ms, a decode step 1.32 ms). Read as a cost
    per token that made a small chunk look 59 µs a token and the ratio cut chunks smaller still."""
    us = 1000
    b = ItlBudget(0, 16, 2048, ratio=2.5)
    b.observe(1320 * us, 0, 16)
    for tokens in (36, 453, 96, 234):
        b.observe(1320 * us + 2000 * us + 2 * us * tokens, tokens, 10)
    fixed, per = b.costs()
    assert abs(fixed - 2000 * us) < 1 * us and abs(per - 2 * us) < 0.01 * us
    # 1.5 decode steps (1.98 ms) are less than the fixed part: the ratio cannot be held beside any prompt token,
    # so a chunk takes the whole budget (fewer mixed steps, each paying the fixed part once)
    assert b.cap(0) == 2048
    cheap = ItlBudget(0, 16, 2048, ratio=2.5)  # a fixed part that leaves room: (1.5 x 4 ms - 1 ms) / 10 µs
    cheap.observe(4000 * us, 0, 64)
    for tokens in (64, 512):
        cheap.observe(4000 * us + 1000 * us + 10 * us * tokens, tokens, 64)
    assert cheap.cap(0) == 500
    tight = ItlBudget(0, 16, 2048, ratio=2.5)  # room, but less than the fixed part: 36-token chunks at 2 ms each
    tight.observe(1485 * us, 0, 60)  # would be 0.55 of the bound (the paced null runner): whole-budget chunks
    for tokens in (64, 512):
        tight.observe(1485 * us + 2000 * us + 2200 * tokens, tokens, 60)
    assert tight.cap(0) == 2048
    one = ItlBudget(0, 16, 2048, ratio=2.5)  # one chunk size seen: all of it is per token
    one.observe(1000 * us, 0, 8)
    one.observe(1000 * us + 256 * us, 128, 8)
    assert one.costs() == (0.0, 2 * us)


# the 8B shape's mixed graphs, in the form the GPU runner measures them (ns the prompt-row bucket adds to a
# decode-only step of that decode-row bucket): a fixed part, then ~25 µs a prompt row
BUCKETS_8B = tuple((pb, db, int((2.5 + 0.025 * pb + 0.002 * db) * MS)) for pb in (16, 32, 64, 128, 256, 512, 1024)
                   for db in (1, 2, 4, 8, 16, 32, 64, 128))


def test_a_bucket_table_picks_the_largest_bucket_whose_measured_cost_fits_the_ratio():
    from imp.core.itl import DRAIN_STEPS

    b = ItlBudget(0, 16, 1024, ratio=3.0, table=BUCKETS_8B)
    assert b.cap(0, 62) == 1024  # no decode-only step measured yet
    b.observe(int(11.1 * MS), 0, 62)
    # room 2 x 11.1 = 22.2 ms beside 62 decode rows (bucket 64): 512 rows add 2.5 + 12.8 + 0.128 ms, 1024 add 28.2
    assert b.cap(0, 62) == 512
    # the fit, fed what the old policy planned (whole-budget chunks of ~930 rows), is not what decides
    for tokens in (930, 960, 940):
        b.observe(int(37.3 * MS), tokens, 62)
    assert b.cap(0, 62) == 512
    small = ItlBudget(0, 16, 1024, ratio=3.0, table=BUCKETS_8B)
    small.observe(int(7.6 * MS), 0, 16)
    assert small.cap(0, 16) == 256  # 15.2 ms of room: 256 rows add 8.9 ms, 512 add 15.3
    # the backlog's share is rounded up to its bucket (the step costs that bucket anyway), within the budget
    assert small.cap(300 * DRAIN_STEPS, 16) == 512
    assert small.cap(10**9, 16) == 1024
    tight = ItlBudget(0, 16, 1024, ratio=1.5, table=BUCKETS_8B)
    tight.observe(4 * MS, 0, 1)  # room 2 ms: less than any bucket's fixed part: whole-budget chunks
    assert tight.cap(0, 1) == 1024
    target = ItlBudget(30 * MS, 16, 1024, table=BUCKETS_8B)  # a target: 30 - 11.1 ms of room
    target.observe(int(11.1 * MS), 0, 40)
    assert target.cap(0, 40) == 512
    past = ItlBudget(0, 16, 1024, ratio=3.0, table=BUCKETS_8B)
    past.observe(int(30 * MS), 0, 200)  # more decode rows than the largest bucket: the largest bucket's row
    assert past.cap(0, 200) == 1024
    with __import__("pytest").raises(ValueError):
        SchedulerConfig(num_blocks=8, prompt_step_ns=((16, 0, 5),))


def test_a_chunk_s_attention_by_its_start_takes_a_smaller_bucket_deeper_in_a_prompt():
    """With `ctx_ns` (a prompt row's attention per 1,000 positions it reads) a bucket costs its table entry plus
    ctx_ns x rows x (start + rows/2): the same room takes 512 rows at a prompt's start and fewer deeper in it,
    where the table alone (inert rows, ctx_ns 0) would take 512 at every position."""
    from imp.core.itl import ItlBudget

    plain = ItlBudget(0, 16, 1024, ratio=3.0, table=BUCKETS_8B)
    by_ctx = ItlBudget(0, 16, 1024, ratio=3.0, table=BUCKETS_8B, ctx_ns=24_000)
    for b in (plain, by_ctx):
        b.observe(int(11 * MS), 0, 16)  # decode-only steps of 11 ms: the ratio's room is 22 ms
    # 512 rows: 2.5 + 12.8 + ~0 ms = 15.3 ms in the table; from position 0 their attention adds 512 x 256 x 24 ns
    assert plain.cap(0, 16, 0) == plain.cap(0, 16, 1400) == 512
    assert by_ctx.cap(0, 16, 0) == 512  # 15.3 + 3.1 ms
    assert by_ctx.cap(0, 16, 1024) == 256  # 512 rows: 15.3 + 15.7 ms; 256: 8.9 + 7.1 ms
    assert by_ctx.bucket_ns(256, 1000, 1024) == 1000 + 24_000 * 256 * (1024 + 128) / 1000
    with __import__("pytest").raises(ValueError):
        SchedulerConfig(num_blocks=8, prompt_ctx_ns=-1)


def _next_plan(queue: list, sch, kv, detok=None) -> StepPlan | None:
    """Deliver the cores' messages until the scheduler plans a step (its plan), or they run out (None);
    detok(msg): what the scheduler sends the streams, where the caller wants it."""
    plan = None
    while queue:
        to, msg = queue.pop(0)
        if to == "kv" and isinstance(msg, KvRequest):
            queue += kv.handle("scheduler", msg)
        elif to == "scheduler":
            queue += sch.handle("kv", msg)
        elif to == "executor" and isinstance(msg, StepPlan):
            plan = msg
        elif to == "detok" and detok is not None:
            detok(msg)
    return plan


def test_the_scheduler_reads_a_running_prompt_s_chunk_at_its_start():
    """A long prompt part way through beside decode rows: its next chunk is read at the position it starts
    from, so with the attention term it gets a smaller bucket than the table alone gives it."""

    def chunks(ctx_ns: int) -> list[int]:
        cfg = SchedulerConfig(num_blocks=2048, block_size=16, max_context=4096, max_batch_size=64,
                              max_step_tokens=1024, history_once=True, itl_ratio=3.0, prompt_step_ns=BUCKETS_8B,
                              prompt_ctx_ns=ctx_ns)
        sch, kv = SchedulerCore(cfg), KvCore(KvConfig(num_blocks=2048, block_size=16))
        queue, now, seen = [], 0, []

        def submit(rid, n):
            nonlocal queue
            k = 10_000 * (1 + int(rid[1:]))
            sub = Submit(rid, tuple(range(k, k + n)), SamplingParams(max_tokens=400, ignore_eos=True), now)
            queue += sch.handle("admission", Enqueue(sub, 4))

        for i in range(4):
            submit(f"r{i}", 20)  # four short prompts: the decode rows
        for step in range(40):
            if step == 5:
                submit("r9", 3000)  # a long prompt arrives beside them
            plan = _next_plan(queue, sch, kv)
            if plan is None:
                break
            p, d = _prompt_rows(plan), _decode_rows(plan)
            if p and d and step >= 5:
                seen.append(p)
            now += int(11 * MS)
            toks = tuple(SampledToken(w.seq_id, 7) for w in plan.shares() if w.sample)
            queue += sch.handle("executor", step_result(plan, toks, now, int(11 * MS) if not p else int(20 * MS)))
        return seen

    plain, by_ctx = chunks(0), chunks(24_000)
    assert plain and set(plain[:-1]) == {512}, plain  # the table alone: 512-row chunks all the way
    assert by_ctx[0] == 512 and min(by_ctx[:-1]) < 512, by_ctx  # deeper in: smaller chunks
    assert sum(by_ctx) == sum(plain) == 3000


def test_a_new_prompt_past_a_cached_prefix_is_sized_at_its_start():
    """An agent's next turn: most of its prompt is in the prefix cache, so its first chunk starts thousands of
    positions in. Planning knew only position 0; once the KV reply says where it starts, the attention term
    sizes its chunk there (smaller), where the table alone keeps the whole bucket."""

    def first_chunk(ctx_ns: int) -> int:
        cfg = SchedulerConfig(num_blocks=2048, block_size=16, max_context=8192, max_batch_size=64,
                              max_step_tokens=1024, history_once=True, itl_ratio=3.0, prompt_step_ns=BUCKETS_8B,
                              prompt_ctx_ns=ctx_ns)
        sch, kv = SchedulerCore(cfg), KvCore(KvConfig(num_blocks=2048, block_size=16, share_in_flight=True))
        queue, now = [], 0
        prefix = tuple(range(50_000, 53_000))

        def submit(rid, prompt):
            nonlocal queue
            sub = Submit(rid, prompt, SamplingParams(max_tokens=400, ignore_eos=True), now)
            queue += sch.handle("admission", Enqueue(sub, 4))

        for i in range(4):
            submit(f"r{i}", tuple(range(10_000 * (i + 1), 10_000 * (i + 1) + 20)))  # the decode rows
        submit("r5", prefix)  # the agent's first turn: its prompt's blocks go into the prefix cache
        for step in range(60):
            if step == 30:
                submit("r9", prefix + tuple(range(60_000, 60_600)))  # its next turn: 3,000 cached + 600 new
            plan = _next_plan(queue, sch, kv)
            if plan is None:
                break
            late = [len(w.token_ids) for w in plan.shares() if w.start_pos >= 2992 and len(w.token_ids) > 1]
            if step >= 30 and late:
                assert _decode_rows(plan) >= 4
                return late[0]
            now += int(11 * MS)
            toks = tuple(SampledToken(w.seq_id, 7) for w in plan.shares() if w.sample)
            queue += sch.handle("executor", step_result(plan, toks, now, int(11 * MS) if not _prompt_rows(plan)
                                                       else int(20 * MS)))
        raise AssertionError("the second turn never ran")

    assert first_chunk(0) == 512  # the table alone: the ratio's 22 ms take 512 rows (15.3 ms) at any position
    assert first_chunk(24_000) == 128  # at ~3,000 positions 256 rows cost 8.9 + 19.3 ms, 128 rows 5.7 + 9.4


def test_with_a_bucketed_device_the_table_holds_the_ratio_where_the_fit_did_not():
    """A fake device whose mixed steps cost their prompt-row bucket (a GPU's graphs): the streams' worst step
    stays within the ratio with the boot's table; the fit alone plans between buckets and passes it."""

    def run(table) -> tuple[float, int]:
        cfg = SchedulerConfig(num_blocks=2048, block_size=16, max_context=4096, max_batch_size=64,
                              max_step_tokens=1024, history_once=True, itl_ratio=3.0, prompt_step_ns=table)
        sch, kv = SchedulerCore(cfg), KvCore(KvConfig(num_blocks=2048, block_size=16))
        rows = {db: dict((pb, ns) for pb, d, ns in BUCKETS_8B if d == db) for db in (1, 2, 4, 8, 16, 32, 64, 128)}
        queue, now, worst, prompts, n = [], 0, 0.0, 0, 0

        def submit(rid):
            nonlocal queue
            k = 1000 * (len(rid) + int(rid[1:]))  # distinct prompts: no prefix-cache hits
            sub = Submit(rid, tuple(range(k, k + 250)), SamplingParams(max_tokens=64, ignore_eos=True), now)
            queue += sch.handle("admission", Enqueue(sub, 4))

        for i in range(48):
            submit(f"r{i}")
        def detok(msg):
            nonlocal n
            for t in getattr(msg, "outs", (msg,)):
                if getattr(t, "finish", 0):
                    n += 1
                    submit(f"n{n}")  # a finished stream is replaced: a steady flow of new prompts

        for step in range(600):
            plan = _next_plan(queue, sch, kv, detok)
            if plan is None:
                break
            p, d = _prompt_rows(plan), _decode_rows(plan)
            db = next(x for x in rows if x >= max(d, 1))
            dec = int((6 + 0.08 * d) * MS)
            elapsed = dec + (rows[db][next(pb for pb in rows[db] if pb >= p)] if p else 0)
            if p and d >= 32 and step >= 30:  # (the first steps: every stream's prompt, before a decode step landed)
                worst = max(worst, elapsed / dec)
                prompts += p
            now += elapsed
            toks = tuple(SampledToken(w.seq_id, 7) for w in plan.shares() if w.sample)
            queue += sch.handle("executor", step_result(plan, toks, now, elapsed))
        return worst, prompts

    fit_worst, fit_prompts = run(())
    table_worst, table_prompts = run(BUCKETS_8B)
    assert table_worst <= 3.0 < fit_worst, (table_worst, fit_worst)
    assert table_prompts > 0.8 * fit_prompts  # the streams' prompts still flow


def test_the_runner_s_bucket_costs_reach_the_scheduler_only_with_a_policy_on(tmp_path):
    """The boot's glue (`imp.engine.local._prompt_costs` -> `build_cores`): a runner with mixed-graph buckets
    (here the paced null runner that stands in for a GPU's) hands its table to the scheduler's frozen config
    when an ITL policy is on; with the policy off, or a runner without buckets, the config has none."""
    from imp.config import ServerConfig
    from imp.engine.cores import build_cores
    from imp.engine.local import _prompt_costs
    from imp.model.null_runner import PacedNullRunner
    from tests.fixtures.synth_raw import write_raw_gguf

    from gguf import GGMLQuantizationType as T

    path = write_raw_gguf(tmp_path / "t.gguf", n_layers=1, d_model=256, n_heads=2, n_kv_heads=2, d_ff=256, vocab=512,
                          qtype=T.Q8_0)
    bucketed = PacedNullRunner.load(str(path), step_us=7000, token_us=28, mixed_us=500, buckets=(16, 32, 64))
    plain = PacedNullRunner.load(str(path), step_us=7000, token_us=28, mixed_us=500)
    on, off = ServerConfig(itl_ratio=3.0), ServerConfig(itl_ratio=0)
    table, ctx_ns, ctx_by = _prompt_costs(on, bucketed)
    assert (16, 64, 28 * 16 * 1000 + 500_000) in table and len(table) == 3 * 9 and ctx_ns == 0 and ctx_by == ()
    assert _prompt_costs(off, bucketed) == ((), 0, ()) and _prompt_costs(on, plain) == ((), 0, ())
    assert build_cores(on, 64, 2048, "m", prompt_costs=table)[1].config.prompt_step_ns == table
    assert build_cores(off, 64, 2048, "m", prompt_costs=table)[1].config.prompt_step_ns == ()
    # with attention by context the runner says what a prompt row adds per 1,000 positions, and the config has it
    by_ctx = PacedNullRunner.load(str(path), step_us=7000, token_us=28, mixed_us=500, buckets=(16, 32, 64),
                                  prompt_ctx_us=24)
    table, ctx_ns, _ = _prompt_costs(on, by_ctx)
    assert ctx_ns == 24_000 and len(table) == 3 * 9
    assert build_cores(on, 64, 2048, "m", prompt_costs=table, prompt_ctx_ns=ctx_ns)[1].config.prompt_ctx_ns == 24_000
    assert build_cores(off, 64, 2048, "m", prompt_costs=table, prompt_ctx_ns=ctx_ns)[1].config.prompt_ctx_ns == 0
    # and the paced device charges a step's prompt rows at their bucket, as the table says
    seqs = [SeqWork("a", tuple(range(20)), 0, (0, 1), True, SamplingParams(max_tokens=4)),
            SeqWork("b", (5,), 3, (2,), True, SamplingParams(max_tokens=4))]
    assert bucketed.cost_ns(seqs) - plain.cost_ns(seqs) == 28 * (32 - 20) * 1000
    # and attention's share grows with the context: a decode row per 1,000 positions it reads, a prompt chunk's
    # rows each reading start .. their own position
    ctx = PacedNullRunner.load(str(path), step_us=7000, token_us=28, mixed_us=500, ctx_us=200, prompt_ctx_us=20)
    assert ctx.cost_ns(seqs) - plain.cost_ns(seqs) == int(200_000 * 4 / 1000 + 20_000 * 20 * 10 / 1000)


def test_a_prompt_row_s_attention_by_bucket_prices_small_chunks_at_their_own_cost(tmp_path):
    """Where the runner measures a prompt row's attention by bucket (a small chunk's rows cost more a row than the 512
    bucket's: the 8B's H100 log, bench/itl_steps.py), the scheduler's config carries the table and the policy prices
    each bucket at its own figure; a bucket the table lacks keeps prompt_ctx_ns. The paced device charges a step's
    prompt rows at its bucket's figure, and reports the table only when asked to."""
    from gguf import GGMLQuantizationType as T

    from imp.config import ServerConfig
    from imp.engine.cores import build_cores
    from imp.engine.local import _prompt_costs
    from imp.model.null_runner import PacedNullRunner
    from tests.fixtures.synth_raw import write_raw_gguf

    path = write_raw_gguf(tmp_path / "t.gguf", n_layers=1, d_model=256, n_heads=2, n_kv_heads=2, d_ff=256, vocab=512,
                          qtype=T.Q8_0)
    kw = dict(step_us=7000, token_us=28, mixed_us=500, buckets=(16, 32, 64), prompt_ctx_us=30)
    r = PacedNullRunner.load(str(path), prompt_ctx_by={16: 90.0, 32: 60.0}, **kw)
    on = ServerConfig(itl_ratio=3.0)
    table, ctx_ns, ctx_by = _prompt_costs(on, r)
    assert ctx_ns == 30_000 and ctx_by == ((16, 90_000), (32, 60_000), (64, 30_000))
    assert build_cores(on, 64, 2048, "m", prompt_costs=table, prompt_ctx_ns=ctx_ns,
                       prompt_ctx_by=ctx_by)[1].config.prompt_ctx_by == ctx_by
    assert build_cores(ServerConfig(itl_ratio=0), 64, 2048, "m", prompt_costs=table, prompt_ctx_ns=ctx_ns,
                       prompt_ctx_by=ctx_by)[1].config.prompt_ctx_by == ()
    quiet = PacedNullRunner.load(str(path), prompt_ctx_by={16: 90.0, 32: 60.0}, report_ctx_by=False, **kw)
    assert _prompt_costs(on, quiet)[2] == ()
    # the device: 20 prompt rows from position 100 take the 32 bucket's figure
    seqs = [SeqWork("a", tuple(range(20)), 100, tuple(range(8)), True, SamplingParams(max_tokens=4))]
    flat = PacedNullRunner.load(str(path), **kw)
    assert abs((r.cost_ns(seqs) - flat.cost_ns(seqs)) - (60_000 - 30_000) * 20 * 110 / 1000) <= 1
    # the policy: a 32-row chunk from position 1,000 priced at 60 us a row per 1,000 positions, a 64-row one at 30
    b = ItlBudget(0, 16, 64, 3.0, table, ctx_ns, ctx_by)
    ns32 = dict(b._row(1))[32]
    assert b.bucket_ns(32, ns32, 1000) == ns32 + 60_000 * 32 * (1000 + 16) / 1000
    ns64 = dict(b._row(1))[64]
    assert b.bucket_ns(64, ns64, 1000) == ns64 + 30_000 * 64 * (1000 + 32) / 1000
    assert ItlBudget(0, 16, 64, 3.0, table, ctx_ns).bucket_ns(32, ns32, 1000) == ns32 + 30_000 * 32 * 1016 / 1000
