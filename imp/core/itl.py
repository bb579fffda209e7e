"""How many prompt tokens a step that carries decode rows may compute under an ITL policy.

A new request's prompt is computed in chunks that share steps with the running streams' decode
rows; every row of such a step waits for the whole step. With chunks of max_step_tokens a CPU
step beside 8 streams took 650 ms against 22 ms for their decode alone (bench/engine.py, SmolLM2,
2 cores): each arrival stalled every stream for over half a second. Two policies cut the chunk
beside decode rows to what the measured costs say fits, where prompt tokens add `fixed + tokens x
per token` to a decode-only step (a least-squares fit over the steps that had prompt tokens; the
fixed part is a GPU mixed graph's, which runs each matmul once per row kind):

- a target (`target_ns`, --itl-target-ms): the step takes about the target, or twice a decode-only
  step where that is longer:

      prompt tokens = (max(target, 2 x decode step) - decode step - fixed) / per token

- a ratio (`ratio`, --itl-ratio; auto: 3 on a GPU, off on a CPU): the step takes at most `ratio` decode-only
  steps (or, where that leaves prompt tokens less than the fixed part, whole-budget chunks), so at low load a rare arrival costs the streams one step of `ratio` times their ITL (the
  p99 / p50 the streams feel), **unless the waiting prompts need more**: at 256 streams with
  128-token answers two new prompts arrive every step, and a cap below that demand would grow
  the queue until the batch shrinks (throughput lost, TTFT growing). So the cap is at least the
  waiting prompt tokens spread over `DRAIN_STEPS` steps: a backlog drains at a step time that rises
  with the load instead of a queue that does (without it the batch shrinks, so does the decode step
  and with it the ratio's room: a spiral down to 0.75 of the bound at 256 streams).

Where the executor runs steps with prompt rows as graphs of fixed row buckets (a GPU's mixed graphs), a
step costs what its bucket costs: 600 prompt rows cost what 1,024 do. The fit above sees only the chunk
sizes it chose, so it cannot learn the jumps (on the 8B shape it settled on whole-budget chunks at 3.36x a
decode step under ratio 3). There the boot measures the buckets (`table`: prompt-row bucket, decode-row
bucket, ns the prompt rows add to that decode-only step) and both policies take the largest prompt bucket
whose measured cost fits the room, at the step's decode-row bucket; the fit is not used for the room.
The table's replays run on inert rows, so it lacks what a prompt chunk's attention over its context costs: on
the 8B shape 512-row chunks at ~1,400-token contexts cost 3.4x a decode step where the table said they fit 3x.
So the boot also measures what a prompt row adds per 1,000 positions it reads (`ctx_ns`), and a bucket costs its
table entry plus ctx_ns x rows x (start + rows / 2) from the position its chunk starts at (the scheduler's).
Tried and left out (paced null runner with the 8B's costs, PERFORMANCE.md): a ratio read against the median step
(a mixed step's cost once most steps carry prompt rows; the rooms jumped at the crossing: ITL p99 / p50 5.3x at
1,400 x 16); correcting the table online by
what mixed steps cost against it (the boot's inert rows lack a real context's attention) read the decode
part as the average decode-only step, over-charged the prompt rows at 256 streams and shrank the batch
(TTFT p50 0.55 -> 1.1 s); the backlog's share rounded down to a bucket did the same (1.5 s).

Either is at least `min_tokens` (a prompt always progresses) and at most `max_tokens`. The costs
come from the step times the executor reports (StepResult.cost_ns: the device's own
time on a GPU, where the pipelined wall also holds the step before), so they are on the event log
and a replay decides the same chunks. A step without decode rows (nobody waits) keeps the whole
budget. Pure: no clock here.
"""

from __future__ import annotations

# the ratio policy's backlog term: the waiting prompt tokens spread over this many steps. Tried on the paced
# null runner with the H100's SmolLM2 and 8B costs (PERFORMANCE.md): 16 drained the bursts of a closed-loop
# benchmark at 17 ms steps (ITL p99 / p50 4.6 at 256 streams), none starved 256 streams to 0.75 of the bound
# (the batch shrinks, so does the decode step and with it the ratio's room), 32 and 64 held both. With the
# attention term (the 8B's 32 us a prompt row per 1,000 positions) 32 leaves 1,400-token prompts at 16 streams at
# 3.3x on the H100 and the paced runner alike (16 of them arriving together: 22k tokens / 32 steps = a 1,024-row
# bucket). 64 was tried: 3.02x there on the H100 (2.72x on the paced runner), but the 8B at 64 streams with
# 250-token prompts fell to 3,930 tok/s (4,050 with 32; the issue asks >= 4,000) and TTFT p50 at 256 streams and
# 1,400 x 64 ~doubled (PERFORMANCE.md): left at 32
DRAIN_STEPS = 32


def _avg(old: int, new: int) -> int:
    return new if old == 0 else old + (new - old) // 4


DECAY = 0.9  # the prompt-cost fit's memory: recent steps weigh most (a batch's cost drifts as it fills)


def bucket_costs(table: tuple[tuple[int, int, int], ...]) -> dict[int, tuple[tuple[int, int], ...]]:
    """decode-row bucket -> ((prompt-row bucket, ns added), ...) by prompt bucket, from the boot's table."""
    by: dict[int, list[tuple[int, int]]] = {}
    for pb, db, ns in table:
        by.setdefault(db, []).append((pb, ns))
    return {db: tuple(sorted(v)) for db, v in sorted(by.items())}


class ItlBudget:
    __slots__ = ("target_ns", "min_tokens", "max_tokens", "ratio", "decode_ns", "_s", "_table", "ctx_ns", "_ctx_by")

    def __init__(self, target_ns: int, min_tokens: int, max_tokens: int, ratio: float = 0.0,
                 table: tuple[tuple[int, int, int], ...] = (), ctx_ns: int = 0,
                 ctx_by: tuple[tuple[int, int], ...] = ()):
        self.target_ns, self.min_tokens, self.max_tokens = target_ns, min_tokens, max_tokens
        self.ratio = 0.0 if target_ns else ratio  # a target, where given, is the policy
        self._table = bucket_costs(table)  # {} : the fit alone
        # with a table: ns a prompt row adds per 1,000 positions it reads (its attention over the context, which
        # the table's inert rows do not have): a chunk of n rows from position p adds ctx_ns x n x (p + n/2) / 1000
        self.ctx_ns = ctx_ns
        self._ctx_by = dict(ctx_by)  # the same by prompt bucket where measured so (a small chunk's rows cost more)
        self.decode_ns = 0  # a decode-only step, ns (the batch changes slowly: one average)
        # what prompt tokens add to a step: fixed + tokens x per token, a weighted least-squares fit of
        # (tokens, step - decode step) over the steps with prompt tokens. The fixed part is the GPU's:
        # a mixed graph runs each matmul once per row kind, ~2 ms more than a decode step on SmolLM2 (H100)
        # whatever its prompt rows; fitted as per-token cost alone it made 36 tokens look 59 µs each and
        # the ratio cut chunks smaller and smaller (each paying the fixed part again)
        self._s = [0.0, 0.0, 0.0, 0.0, 0.0]  # sums of w, w x, w x^2, w y, w x y

    @property
    def on(self) -> bool:
        return bool(self.target_ns or self.ratio)

    def observe(self, elapsed_ns: int, prompt_tokens: int, decode_rows: int) -> None:
        """One landed step: its cost (the device's time where measured) and what it computed."""
        if not self.on or elapsed_ns <= 0:
            return
        if prompt_tokens == 0:
            if decode_rows:
                self.decode_ns = _avg(self.decode_ns, elapsed_ns)
        elif prompt_tokens >= 2 * self.min_tokens:  # small chunks: too little to say what a token costs
            own = elapsed_ns - (self.decode_ns if decode_rows else 0)
            if own > 0:
                x, y, s = float(prompt_tokens), float(own), self._s
                for k, v in enumerate((1.0, x, x * x, y, x * y)):
                    s[k] = s[k] * DECAY + v

    def costs(self) -> tuple[float, float]:
        """(fixed ns, ns a token) of prompt tokens in a step, from the fit; (0, 0) before any. With one
        chunk size seen so far the fixed part cannot be told apart: all of it is per token then."""
        w, sx, sxx, sy, sxy = self._s
        if w <= 0 or sx <= 0:
            return 0.0, 0.0
        det = w * sxx - sx * sx
        if det > 1e-6 * w * sxx:
            slope = (w * sxy - sx * sy) / det
            fixed = (sy - slope * sx) / w
            if slope > 0 and fixed >= 0:
                return fixed, slope
            if slope > 0:  # (a negative intercept: noise around a proportional cost)
                return 0.0, sy / sx
        return 0.0, sy / sx

    @property
    def token_ns(self) -> int:
        return round(self.costs()[1])

    def bucket_ns(self, pb: int, ns: int, ctx: int) -> float:
        """A prompt bucket's cost: the table's (inert rows) plus its rows' attention from position ctx."""
        return ns + self._ctx_by.get(pb, self.ctx_ns) * pb * (ctx + pb / 2) / 1000

    def bucket_room(self, left_ns: float, decodes: int, ctx: int = 0) -> int:
        """The largest prompt-row bucket whose cost beside `decodes` decode rows, its chunk starting at position
        ctx, is at most left_ns (the decode-row bucket that holds them; past the largest, the largest);
        max_tokens where none is: even the smallest bucket's fixed part passes the room, so chunks take the
        whole budget (fewer mixed steps, each paying that part once)."""
        fits = [pb for pb, ns in self._row(decodes) if self.bucket_ns(pb, ns, ctx) <= left_ns]
        return fits[-1] if fits else self.max_tokens

    def _row(self, decodes: int) -> tuple[tuple[int, int], ...]:
        dbs = tuple(self._table)
        return self._table[next((d for d in dbs if d >= decodes), dbs[-1])]

    def cap(self, waiting_tokens: int = 0, decodes: int = 1, ctx: int = 0) -> int:
        """Prompt tokens for a step beside decode rows (max_tokens while off or not yet measured).
        waiting_tokens: the prompt tokens not yet computed of the requests that wait or are part way
        (the ratio policy's backlog term); ctx: the position the step's first prompt chunk starts at (its rows'
        attention, `ctx_ns`). The target's step may take twice a decode step where that is longer than the
        target: a model whose decode alone passes it (a large one on a CPU) still computes a prompt at half its
        decode rate. Where the ratio leaves the prompt tokens less time than
        the fixed part (or none), chunks take the whole budget: each one pays the fixed part, so fewer
        and larger ones stall the streams least and keep the prefill rate."""
        if self._table and self.on:
            if self.decode_ns <= 0:
                return self.max_tokens  # no decode-only step landed yet: nothing to hold a ratio to
            if self.target_ns:
                room = self.bucket_room(max(self.target_ns, 2 * self.decode_ns) - self.decode_ns, decodes, ctx)
            else:  # the backlog's share rounded up to its bucket: the step costs that bucket anyway
                need = -(-waiting_tokens // DRAIN_STEPS)
                room = max(self.bucket_room((self.ratio - 1.0) * self.decode_ns, decodes, ctx),
                           next((pb for pb, _ in self._row(decodes) if pb >= need), need) if need else 0)
            return max(self.min_tokens, min(self.max_tokens, room))
        fixed, per = self.costs()
        if not self.on or per <= 0 or self.decode_ns <= 0 and not self.target_ns:
            return self.max_tokens
        if self.target_ns:
            room = int((max(self.target_ns, 2 * self.decode_ns) - self.decode_ns - fixed) / per + 1e-6)
        else:
            left = (self.ratio - 1.0) * self.decode_ns - fixed
            if left < fixed:  # the ratio leaves prompt tokens less than the fixed part: chunks that small would
                return self.max_tokens  # spend most of each mixed step on it (a spiral down to 0.55 of the bound)
            room = max(int(left / per + 1e-6), -(-waiting_tokens // DRAIN_STEPS))  # (+1e-6: the fit's rounding)
        return max(self.min_tokens, min(self.max_tokens, room))
