"""Admission: refuse what can never run, throttle what would queue too long.

Every request passes here on its way to the scheduler, and so do cancels
(the inbox is FIFO, so a Cancel can never overtake its Submit).

    400  the prompt plus one generated token does not fit the whole KV pool
         or the model context (it could never run), or the request is malformed
    503  suspended (POST /admin/suspend): nothing new is admitted until Resume;
         requests admitted before the Suspend run to their end
    429  the prompt tokens of the requests in the system (admitted and not
         yet finished) would exceed max_queued_tokens; a request that finds
         the system empty is always admitted, however long
    else Enqueue, with reserved_blocks = the blocks its prompt and expected
         generation take (the scheduler starts a request only while the
         reservations of the running ones fit the pool)

With several replicas (data parallel: one scheduler and KV pool per device,
`imp.core.replicas`) each request goes to the replica with the fewest
reserved blocks, or to the one that holds its session's pinned prompt; its
cancels and end_thinking follow it there. num_blocks is one replica's pool.
"""

from __future__ import annotations

import msgspec

from imp.core.core import CoreError, Out
from imp.core.replicas import pick, replica_name
from imp.messages import Cancel, EndThinking, Enqueue, Finished, Msg, Reject, Resume, SessionClose, Submit, Suspend


MAX_SESSIONS = 65536  # session -> replica affinities kept (a forgotten one just picks again)


class AdmissionConfig(msgspec.Struct, frozen=True):
    num_blocks: int
    block_size: int = 16
    max_context: int = 2048  # the model's context length
    max_queued_tokens: int = 0  # 0 = unlimited
    admission_decode_tokens: int = 256  # generation reserved per sequence (capped by max_tokens)
    retry_after_s: float = 1.0  # told to clients refused with 429
    replicas: int = 1  # schedulers (data parallel), each with a pool of num_blocks

    def __post_init__(self):
        if min(self.num_blocks, self.block_size, self.max_context, self.replicas) < 1 or self.max_queued_tokens < 0:
            raise ValueError(f"bad AdmissionConfig {self}")


class AdmissionCore:
    name = "admission"

    def __init__(self, config: AdmissionConfig):
        self.config = config
        self.inflight: dict[str, int] = {}  # req_id -> prompt tokens, until Finished
        self.queued_tokens = 0
        self.suspended = ""  # why admission is closed ("" = open)
        self.owner: dict[str, tuple[int, int]] = {}  # req_id -> (replica, reserved blocks), until Finished
        self.loads = [0] * config.replicas  # reserved blocks of the unfinished requests on each replica
        self.sessions: dict[str, int] = {}  # session id -> the replica holding its pin

    def _sched(self, replica: int) -> str:
        return replica_name("scheduler", replica, self.config.replicas)

    def handle(self, sender: str, msg: Msg) -> Out:
        if isinstance(msg, Submit):
            return [self._submit(msg)]
        if isinstance(msg, (Cancel, EndThinking)):
            # Unknown: already finished (or refused); the cancel has nothing to end.
            return [(self._sched(self.owner[msg.req_id][0]), msg)] if msg.req_id in self.inflight else []
        if isinstance(msg, SessionClose):  # through here to keep its order after the Submits
            r = self.sessions.pop(msg.session_id, None)
            reps = range(self.config.replicas) if r is None else [r]
            return [(self._sched(i), msg) for i in reps]
        if isinstance(msg, Suspend):
            self.suspended = msg.reason or "operator"
            return []
        if isinstance(msg, Resume):
            self.suspended = ""
            return []
        if isinstance(msg, Finished):
            if msg.req_id not in self.inflight:
                raise CoreError(f"Finished for unknown request {msg.req_id!r}")
            self.queued_tokens -= self.inflight.pop(msg.req_id)
            r, blocks = self.owner.pop(msg.req_id)
            self.loads[r] -= blocks
            return []
        raise CoreError(f"admission cannot handle {type(msg).__name__}")

    def _submit(self, m: Submit) -> tuple[str, Msg]:
        c = self.config
        n_prompt = len(m.prompt)
        capacity = c.num_blocks * c.block_size

        def reject(status: int, code: str, text: str, retry: float = 0.0):
            return ("ingress", Reject(m.req_id, status, code, text, retry))

        if n_prompt == 0:
            return reject(400, "invalid_request_error", "prompt is empty")
        if m.params.max_tokens < 1 or m.n < 1:
            return reject(400, "invalid_request_error", "max_tokens and n must be at least 1")
        if m.req_id in self.inflight:
            return reject(400, "invalid_request_error", f"request id {m.req_id!r} is already in use")
        if n_prompt + 1 > capacity:
            return reject(400, "context_length_exceeded",
                          f"prompt of {n_prompt} tokens exceeds KV capacity of {capacity} tokens")
        blocks = lambda n: -(-n // c.block_size)  # noqa: E731
        if m.cfg_prompt and (len(m.cfg_prompt) + 1 > c.max_context
                             or m.n * (blocks(n_prompt + 1) + blocks(len(m.cfg_prompt) + 1)) > c.num_blocks):
            return reject(400, "context_length_exceeded",
                          f"the prompt and its guidance prompt ({n_prompt} + {len(m.cfg_prompt)} tokens) do not fit "
                          f"the KV pool or context together")
        if n_prompt + 1 > c.max_context:
            return reject(400, "context_length_exceeded",
                          f"prompt of {n_prompt} tokens exceeds the model context of {c.max_context} tokens")
        if self.suspended == "draining":  # SIGTERM: in-flight requests finish, nothing new starts
            return reject(503, "draining", "the server is shutting down; retry on another replica")
        if self.suspended:
            return reject(503, "suspended", "the server is suspended; POST /admin/resume admits requests again")
        if c.max_queued_tokens and self.queued_tokens and self.queued_tokens + n_prompt > c.max_queued_tokens:
            return reject(429, "rate_limit_exceeded",
                          f"{self.queued_tokens} prompt tokens queued; limit {c.max_queued_tokens}",
                          c.retry_after_s)
        self.inflight[m.req_id] = n_prompt
        self.queued_tokens += n_prompt
        reserved = self.reserve(n_prompt, m.params.max_tokens, m.n)
        if m.cfg_prompt:  # classifier-free guidance: each choice's shadow holds a sequence of its own
            reserved = min(c.num_blocks, reserved + m.n * self.reserve(len(m.cfg_prompt), m.params.max_tokens, 1))
        r = pick(self.loads, self.sessions.get(m.session_id) if m.session_id else None)
        if m.session_id:
            self.sessions.pop(m.session_id, None)
            self.sessions[m.session_id] = r  # most recent last; the oldest go first past the cap
            if len(self.sessions) > MAX_SESSIONS:
                del self.sessions[next(iter(self.sessions))]
        self.owner[m.req_id] = (r, reserved)
        self.loads[r] += reserved
        return (self._sched(r), Enqueue(m, reserved_blocks=reserved))

    def reserve(self, n_prompt: int, max_tokens: int, n: int) -> int:
        """Blocks for the prompt and the expected generation of n siblings.

        Siblings share the prompt's full blocks but the one holding its last
        token; each owns the rest. Capped at the pool so it can always start.
        """
        c = self.config
        end = n_prompt + min(max_tokens, c.admission_decode_tokens)
        blocks = -(-end // c.block_size)
        own = blocks - (n_prompt - 1) // c.block_size
        return min(c.num_blocks, blocks + (n - 1) * own)
