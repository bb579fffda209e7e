"""What the ITL policy expected a step with prompt rows to cost against what the device spent, from an event log.

    .venv/bin/python bench/itl_steps.py EVENTS.log [--ratio 3] [--top 20]

The policy (`imp.core.itl.ItlBudget`) prices a step's prompt rows at the boot's table entry for their bucket
(prompt-row bucket, decode-row bucket: ns over the decode-only step) plus the attention term (ctx_ns x rows x
(start + rows / 2) / 1000 from the position the step's first chunk starts at), over its running average of
decode-only steps. The log's header carries the table and ctx_ns (the scheduler's frozen config), each StepPlan
the rows and each StepResult the device's time, so this replays the pricing step by step and prints:

- by prompt bucket: steps, the mean decode rows, predicted / measured ms (p50, p90), measured / predicted;
- the steps over `ratio` x the decode average (the ones that make the ITL p99): what was predicted for them;
- how many decode rows (the gaps the streams feel) sat in steps over the ratio, and their share of all;
- the gaps' p50 / p99 (a step's StepResult to the next's, once a decode row of the step) over the whole log and
  from step --after on: a closed-loop benchmark's streams start together, and its first prompts arrive as one burst.

A paced null runner's log predicts itself (its device is the policy's model); a GPU's log says where the model
is wrong (the 8B's 1,400 x 16 ITL p99 / p50 ran 0.3x over the paced runner's on the H100).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from imp.core.itl import ItlBudget  # noqa: E402
from imp.log.eventlog import read_log  # noqa: E402
from imp.messages.step import StepPlan, StepResult  # noqa: E402


def _shape(plan: StepPlan) -> tuple[int, int, int]:
    """(decode rows, prompt rows, the first prompt chunk's start) of a plan, as the scheduler counts them."""
    dec = len(plan.rows) if plan.rows is not None else 0
    prompt, start = 0, -1
    for w in plan.seqs:
        if len(w.token_ids) == 1 and w.sample:
            dec += 1
        else:
            prompt += len(w.token_ids)
            if start < 0:
                start = w.start_pos
    return dec, prompt, max(start, 0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--ratio", type=float, default=0.0, help="the ratio to hold (default: the log's, else 3)")
    ap.add_argument("--top", type=int, default=20, help="list this many of the worst steps over the ratio")
    ap.add_argument("--after", type=int, default=60, help="the gaps' p99 / p50 also from this step on")
    a = ap.parse_args()
    header, recs = read_log(a.log)
    cfg = header.configs.get("scheduler", {})
    table = tuple(tuple(x) for x in cfg.get("prompt_step_ns", ()))
    ctx_ns = int(cfg.get("prompt_ctx_ns", 0))
    ctx_by = tuple(tuple(x) for x in cfg.get("prompt_ctx_by", ()))
    ratio = a.ratio or float(cfg.get("itl_ratio", 0.0)) or 3.0
    if not table:
        print("the log's scheduler has no prompt-cost table (a CPU run): nothing to compare")
        return 1
    b = ItlBudget(0, 16, 1 << 20, ratio, table, ctx_ns, ctx_by)  # pricing only: decode_ns kept as the scheduler keeps it
    plans: dict[int, StepPlan] = {}
    landed: dict[int, tuple[int, int]] = {}  # step -> (its StepResult's wall ns, its decode rows)
    rows = []  # (step, decodes, prompt rows, bucket, start, decode avg ns, predicted ns, measured ns)
    for env in recs:
        p = env.payload
        if isinstance(p, StepPlan):
            plans[p.step] = p
        elif isinstance(p, StepResult) and p.step in plans:
            dec, prompt, start = _shape(plans.pop(p.step))
            landed[p.step] = (env.wall_ns, dec)
            cost = p.cost_ns
            if prompt and dec and b.decode_ns:
                pb = next((x for x, _ in b._row(dec) if x >= prompt), prompt)
                ns = dict(b._row(dec)).get(pb, 0)
                rows.append((p.step, dec, prompt, pb, start, b.decode_ns, b.decode_ns + b.bucket_ns(pb, ns, start),
                             cost))
            b.observe(cost, prompt, dec)
    if not rows:
        print("no step with both prompt and decode rows after the first decode-only step")
        return 1
    print(f"{a.log}: ratio {ratio}, ctx_ns {ctx_ns}{f' (by bucket {dict(ctx_by)})' if ctx_by else ''}, {len(rows)} "
          f"steps with prompt and decode rows")
    print("| prompt bucket | steps | decode rows (mean) | predicted ms p50 / p90 | measured ms p50 / p90 "
          "| measured / predicted (p50, max) | over the ratio |")
    print("|---|---|---|---|---|---|---|")
    for pb in sorted({r[3] for r in rows}):
        rs = [r for r in rows if r[3] == pb]
        pr, me = sorted(r[6] for r in rs), sorted(r[7] for r in rs)
        q = sorted(r[7] / r[6] for r in rs)
        over = sum(1 for r in rs if r[7] > ratio * r[5])
        print(f"| {pb} | {len(rs)} | {statistics.mean(r[1] for r in rs):.1f} | {_p(pr, .5)} / {_p(pr, .9)} "
              f"| {_p(me, .5)} / {_p(me, .9)} | {statistics.median(q):.2f}, {q[-1]:.2f} | {over} |")
    worst = sorted((r for r in rows if r[7] > ratio * r[5]), key=lambda r: -r[7] / r[5])[:a.top]
    if worst:
        print(f"\nsteps over {ratio} x the decode-only average")
        print("| step | decode rows | prompt rows (bucket) | chunk start | decode avg ms | predicted ms | measured ms "
              "| measured / decode avg |")
        print("|---|---|---|---|---|---|---|---|")
        for s, dec, prompt, pb, start, dns, pred, cost in worst:
            print(f"| {s} | {dec} | {prompt} ({pb}) | {start} | {dns / 1e6:.2f} | {pred / 1e6:.2f} | {cost / 1e6:.2f} "
                  f"| {cost / dns:.2f} |")
    gaps_over = sum(r[1] for r in rows if r[7] > ratio * r[5])
    print(f"\ndecode rows in steps over the ratio: {gaps_over} (their share of the decode rows in these steps: "
          f"{gaps_over / max(1, sum(r[1] for r in rows)):.1%})")
    for lo in (0, a.after):
        gaps = sorted(g for s, (w, d) in landed.items() if s >= lo and s - 1 in landed
                      for g in [(w - landed[s - 1][0]) / 1e6] * d)
        if gaps:
            p50, p99 = gaps[len(gaps) // 2], gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
            print(f"gaps from step {lo}: {len(gaps)}, p50 {p50:.1f} ms, p99 {p99:.1f} ms ({p99 / p50:.2f}x)")
    return 0


def _p(xs: list[int], q: float) -> str:
    return f"{xs[min(len(xs) - 1, int(q * len(xs)))] / 1e6:.1f}"


if __name__ == "__main__":
    sys.exit(main())
