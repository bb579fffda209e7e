"""How many prompt tokens a step that carries decode rows may compute under an ITL policy.

A new request's prompt is computed in chunks that share steps with the running streams' decode
rows; every row of such a step waits for the whole step. With chunks of max_step_tokens a CPU
step beside 8 streams took 650 ms against 22 ms for their decode alone (bench/engine.py, SmolLM2,
2 cores): each arrival stalled every stream for over half a second. Two policies cut the chunk
beside decode rows to what the measured costs say fits:

- a target (`target_ns`, --itl-target-ms): the step takes about the target, or twice a decode-only
  step where that is longer:

      prompt tokens = (max(target, 2 x a decode-only step) - a decode-only step) / a prompt token's cost

- a ratio (`ratio`, --itl-ratio; on a GPU by default): the step takes at most `ratio` decode-only
  steps, so at low load a rare arrival costs the streams one step of `ratio` times their ITL (the
  p99 / p50 the streams feel), **unless the waiting prompts need more**: at 256 streams with
  128-token answers two new prompts arrive every step, and a cap below that demand would grow
  the queue until the batch shrinks (throughput lost, TTFT growing). So the cap is at least the
  waiting prompt tokens spread over `DRAIN_STEPS` steps: a backlog drains at a step time that rises
  with the load instead of a queue that does (without it the batch shrinks, so does the decode step
  and with it the ratio's room: a spiral down to 0.75 of the bound at 256 streams).

Either is at least `min_tokens` (a prompt always progresses) and at most `max_tokens`. Both costs
are running averages of the step times the executor reports (StepResult.cost_ns: the device's own
time on a GPU, where the pipelined wall also holds the step before), so they are on the event log
and a replay decides the same chunks. A step without decode rows (nobody waits) keeps the whole
budget. Pure: no clock here.
"""

from __future__ import annotations

# the ratio policy's backlog term: the waiting prompt tokens spread over this many steps. Tried on the paced
# null runner with the H100's SmolLM2 and 8B costs (PERFORMANCE.md): 16 drained the bursts of a closed-loop
# benchmark at 17 ms steps (ITL p99 / p50 4.6 at 256 streams), none starved 256 streams to 0.75 of the bound
# (the batch shrinks, so does the decode step and with it the ratio's room), 32 and 64 held both.
DRAIN_STEPS = 32


def _avg(old: int, new: int) -> int:
    return new if old == 0 else old + (new - old) // 4


class ItlBudget:
    __slots__ = ("target_ns", "min_tokens", "max_tokens", "ratio", "decode_ns", "token_ns")

    def __init__(self, target_ns: int, min_tokens: int, max_tokens: int, ratio: float = 0.0):
        self.target_ns, self.min_tokens, self.max_tokens = target_ns, min_tokens, max_tokens
        self.ratio = 0.0 if target_ns else ratio  # a target, where given, is the policy
        self.decode_ns = 0  # a decode-only step, ns (the batch changes slowly: one average)
        self.token_ns = 0  # a prompt token's share of a step, ns

    @property
    def on(self) -> bool:
        return bool(self.target_ns or self.ratio)

    def observe(self, elapsed_ns: int, prompt_tokens: int, decode_rows: int) -> None:
        """One landed step: its executor time and what it computed."""
        if not self.on or elapsed_ns <= 0:
            return
        if prompt_tokens == 0:
            if decode_rows:
                self.decode_ns = _avg(self.decode_ns, elapsed_ns)
        elif prompt_tokens >= 2 * self.min_tokens:  # small chunks: the step's fixed cost would dominate
            own = elapsed_ns - (self.decode_ns if decode_rows else 0)
            if own > 0:
                self.token_ns = _avg(self.token_ns, own // prompt_tokens)

    def cap(self, waiting_tokens: int = 0) -> int:
        """Prompt tokens for a step beside decode rows (max_tokens while off or not yet measured).
        waiting_tokens: the prompt tokens not yet computed of the requests that wait or are part way
        (the ratio policy's backlog term). The target's step may take twice a decode step where that is
        longer than the target: a model whose decode alone passes it (a large one on a CPU) still
        computes a prompt at half its decode rate."""
        if not self.on or self.token_ns <= 0 or self.decode_ns <= 0 and not self.target_ns:
            return self.max_tokens
        if self.target_ns:
            room = (max(self.target_ns, 2 * self.decode_ns) - self.decode_ns) // self.token_ns
        else:
            room = max(int((self.ratio - 1.0) * self.decode_ns) // self.token_ns, -(-waiting_tokens // DRAIN_STEPS))
        return max(self.min_tokens, min(self.max_tokens, room))
