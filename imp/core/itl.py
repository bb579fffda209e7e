"""How many prompt tokens a step that carries decode rows may compute under an ITL target.

A new request's prompt is computed in chunks that share steps with the running streams' decode
rows; every row of such a step waits for the whole step. With chunks of max_step_tokens a CPU
step beside 8 streams took 650 ms against 22 ms for their decode alone (bench/engine.py, SmolLM2,
2 cores): each arrival stalled every stream for over half a second. Given a target, the chunk
beside decode rows is cut to what the measured costs say fits:

    prompt tokens = (max(target, 2 x a decode-only step) - a decode-only step) / a prompt token's cost,
                    at least `min_tokens`

Both costs are running averages of the step times the executor reports (StepResult.cost_ns: the
device's own time on a GPU, where the pipelined wall also holds the step before), so they are on the event log and a replay decides the same chunks. A step without decode rows
(nobody waits) keeps the whole budget. Pure: no clock here.
"""

from __future__ import annotations


def _avg(old: int, new: int) -> int:
    return new if old == 0 else old + (new - old) // 4


class ItlBudget:
    __slots__ = ("target_ns", "min_tokens", "max_tokens", "decode_ns", "token_ns")

    def __init__(self, target_ns: int, min_tokens: int, max_tokens: int):
        self.target_ns, self.min_tokens, self.max_tokens = target_ns, min_tokens, max_tokens
        self.decode_ns = 0  # a decode-only step, ns (the batch changes slowly: one average)
        self.token_ns = 0  # a prompt token's share of a step, ns

    def observe(self, elapsed_ns: int, prompt_tokens: int, decode_rows: int) -> None:
        """One landed step: its executor time and what it computed."""
        if not self.target_ns or elapsed_ns <= 0:
            return
        if prompt_tokens == 0:
            if decode_rows:
                self.decode_ns = _avg(self.decode_ns, elapsed_ns)
        elif prompt_tokens >= 2 * self.min_tokens:  # small chunks: the step's fixed cost would dominate
            own = elapsed_ns - (self.decode_ns if decode_rows else 0)
            if own > 0:
                self.token_ns = _avg(self.token_ns, own // prompt_tokens)

    def cap(self) -> int:
        """Prompt tokens for a step beside decode rows (max_tokens while off or not yet measured). The
        step may take twice a decode step where that is longer than the target: a model whose decode
        alone passes it (a large one on a CPU) still computes a prompt at half its decode rate."""
        if not self.target_ns or self.token_ns <= 0:
            return self.max_tokens
        room = max(self.target_ns, 2 * self.decode_ns) - self.decode_ns
        return max(self.min_tokens, min(self.max_tokens, room // self.token_ns))
