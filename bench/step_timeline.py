"""Where a step's time goes, read from an event log (every envelope is timestamped when sent).

    .venv/bin/python bench/step_timeline.py EVENTS.log [--skip 20]

For each step in steady decode: the interval between consecutive StepResults (what
a stream feels per token), the executor's own time (StepResult.elapsed_ns: plan
received -> tokens collected), and the host legs: StepResult -> the next KvRequest (scheduler),
KvRequest -> KvReply (allocator), KvReply -> StepPlan (scheduler), and StepResult ->
TokenBatch -> DeltaBatch (detok) -> ingress. Prints medians and p90s in microseconds.
--gaps N: the N longest intervals between consecutive StepResults (the stalls a stream
feels) with what the step held: shares, decode rows, prompt rows, the executor's own time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from imp.log.eventlog import read_log  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--skip", type=int, default=20, help="steps to skip at the start (prefill, warm-up)")
    ap.add_argument("--gaps", type=int, default=0, help="list the N longest result -> result intervals")
    a = ap.parse_args()
    _, recs = read_log(a.log)
    by_step: dict[int, dict[str, int]] = defaultdict(dict)
    batch: dict[int, int] = {}
    shape: dict[int, tuple[int, int, int]] = {}  # step -> (shares, decode rows, prompt rows)
    for env in recs:
        name = type(env.payload).__name__
        st = getattr(env.payload, "step", None)
        key = st if st is not None else env.step
        d = by_step[key]
        d.setdefault(f"{name}:{env.sender}>{env.receiver}", env.wall_ns)
        if name == "StepPlan":
            batch[key] = len(env.payload.shares())
            dec = sum(1 for w in env.payload.shares() if len(w.token_ids) == 1 and w.sample)
            shape[key] = (len(env.payload.shares()), dec, sum(len(w.token_ids) for w in env.payload.shares()) - dec)
        if name == "StepResult":
            d["elapsed"] = env.payload.elapsed_ns
    all_steps = sorted(s for s in by_step if "StepResult:executor>scheduler" in by_step[s] and batch.get(s))
    sizes = defaultdict(list)  # a run at several concurrencies: one table per batch size seen often
    for s in all_steps[a.skip:]:
        sizes[batch[s]].append(s)
    for size, steps in sorted(sizes.items()):
        if len(steps) >= 20:
            _table(by_step, batch, steps)
    if a.gaps:
        _gaps(by_step, shape, all_steps, a.gaps)
    return 0


def _gaps(by_step, shape, steps, n: int) -> None:
    """The longest StepResult -> StepResult intervals: which steps stalled the streams, and with what."""
    res = {s: by_step[s]["StepResult:executor>scheduler"] for s in steps}
    gaps = sorted(((res[s] - res[s - 1], s) for s in steps if s - 1 in res), reverse=True)[:n]
    print(f"\n{n} longest result -> result intervals")
    print("| step | interval ms | shares | decode rows | prompt rows | executor ms | previous step's shares / prompt rows |")
    print("|---|---|---|---|---|---|---|")
    for g, s in gaps:
        sh, pv = shape.get(s, (0, 0, 0)), shape.get(s - 1, (0, 0, 0))
        print(f"| {s} | {g / 1e6:.1f} | {sh[0]} | {sh[1]} | {sh[2]} | {by_step[s].get('elapsed', 0) / 1e6:.1f} "
              f"| {pv[0]} / {pv[2]} |")


def _table(by_step, batch, steps) -> None:
    steps_set = set(steps)
    legs = defaultdict(list)
    prev = None
    for s in steps:
        if prev is not None and s - 1 not in steps_set:
            prev = None
        d = by_step[s]
        res = d["StepResult:executor>scheduler"]
        if prev is not None and by_step[s - 1].get("StepResult:executor>scheduler") == prev:
            legs["result -> next result (per token)"].append(res - prev)
        prev = res
        legs["executor: plan received -> collected"].append(d.get("elapsed", 0))
        plan = d.get("StepPlan:scheduler>executor")
        if plan:
            legs["plan sent -> result sent"].append(res - plan)
        tb = d.get("TokenBatch:scheduler>detok")
        if tb:
            legs["result sent -> TokenBatch sent"].append(tb - res)
        db = d.get("DeltaBatch:detok>ingress")
        if tb and db:
            legs["TokenBatch -> DeltaBatch (detok)"].append(db - tb)
    # the plan for step s+k is made when some earlier result lands: plan(s) - result(s - depth)
    for depth in (1, 2):
        xs = [by_step[s]["StepPlan:scheduler>executor"] - by_step[s - depth]["StepResult:executor>scheduler"]
              for s in steps if "StepPlan:scheduler>executor" in by_step[s]
              and "StepResult:executor>scheduler" in by_step.get(s - depth, {})]
        if xs and statistics.median(xs) > 0:
            legs[f"result(s-{depth}) -> plan(s) sent"] = xs
    kv = [by_step[s]["KvReply:kv>scheduler"] - by_step[s]["KvRequest:scheduler>kv"] for s in steps
          if "KvReply:kv>scheduler" in by_step[s] and "KvRequest:scheduler>kv" in by_step[s]]
    if kv:
        legs["KvRequest -> KvReply (allocator)"] = kv
    print(f"{len(steps)} steps, batch median {statistics.median(batch[s] for s in steps):.0f}")
    print("| leg | median µs | p90 µs |")
    print("|---|---|---|")
    for k, xs in legs.items():
        xs = sorted(xs)
        print(f"| {k} | {statistics.median(xs) / 1e3:,.0f} | {xs[int(0.9 * (len(xs) - 1))] / 1e3:,.0f} |")


if __name__ == "__main__":
    sys.exit(main())
