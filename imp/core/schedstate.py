"""The scheduler's frozen config and its state: requests (`Req`), their sequences (`Seq`,
one per choice, with a `Status`), and a step's shares (`Work`). Plain data; the decisions
are in `imp.core.scheduler` (the step) and `imp.core.lifecycle` (a request's life)."""

from __future__ import annotations

import enum

import msgspec

from imp.messages import Submit


class SchedulerConfig(msgspec.Struct, frozen=True):
    num_blocks: int
    block_size: int = 16
    max_context: int = 2048
    max_batch_size: int = 64
    max_step_tokens: int = 512  # token budget of one step (chunked prefill)
    request_timeout_ns: int = 0  # 0 = none
    aging_ns: int = 10_000_000_000  # waiting this long outranks any prompt length
    session_ttl_ns: int = 600_000_000_000  # an idle session's pinned prompt is released after this
    pipeline_depth: int = 1  # steps in flight at once: 2 plans step N+1 while the executor runs step N
    # prompt tokens that new requests may bring to one planning round before the KV reply says how many of
    # them the prefix cache already holds; the step itself still computes at most max_step_tokens (the new
    # shares are cut to what is left of it once their cached part is known, `_on_kv`). 0 = max_step_tokens
    # (the policy before this field: logs written then replay identically)
    admit_tokens: int = 0
    # True: a penalized (or constrained) share carries its generated-token history only with the sequence's
    # first share after each admission, as params do; the executor appends what it samples after that
    # (`imp.actors.executor.attach_state`). A full history in every share made each step O(tokens generated)
    # in the plan, its encoding and the event log (1,000-token outputs: the log grew quadratically).
    # False: every share carries it (logs written before this field replay identically)
    history_once: bool = False
    # > 0: a step that carries decode rows computes only as many prompt tokens as should fit in this
    # many ns (at least one block's worth), from the step times the executor reported (`ItlBudget`), so
    # a new prompt's chunk stalls the running streams for about this long, not for a whole
    # max_step_tokens chunk. 0 = off (the policy before this field: logs written then replay identically)
    itl_target_ns: int = 0
    # > 0 (without itl_target_ns): a step that carries decode rows computes as many prompt tokens as keep it
    # within this many decode-only steps, or more where the waiting prompts need it to drain in a few steps
    # (`ItlBudget`): the rare admission at low load does not stall the streams, the steady stream of them at
    # high load is not starved. 0 = off (logs written before this field replay identically)
    itl_ratio: float = 0.0
    # > 0: a speculative sequence's decode share may feed up to this many drafted tokens after its last one
    # (imp.core.spec), verified in the same step. 0: never (the executor cannot verify drafts, or the server
    # runs without speculation; logs written before this field replay identically)
    spec_k_max: int = 0
    # draft tokens a sequence's verifies must keep on average over a window, or it stops drafting a while
    # (imp.core.spec.Drafter.min_kept): 1 where steps are pipelined (depth 2: a verify costs its sequence a
    # step), 0 = only the acceptance share decides (logs written before this field replay identically)
    spec_min_kept: float = 0.0
    # > 0: a step's decode and drafted rows at most this many, shared evenly by the sequences the step may
    # draft for: the executor's largest captured decode graph (a GPU). Past it a verify step ran eager: 16
    # streams of 8-token drafts (128 rows) took ~43 ms a step against a 64-row graph's few. 0 = no cap (a CPU,
    # whose drafts are priced by the row; logs written before this field replay identically)
    spec_max_rows: int = 0
    # swap instead of recompute: the executor's swap area holds swap_blocks blocks (0: none, every preempted
    # sequence computes its context again: the policy before these fields), and a preemption parks the
    # victim's KV there when the cost model says moving its blocks out and back (swap_ns_per_block each) is
    # cheaper than computing its positions again (recompute_ns_per_token each). Both costs are boot
    # measurements the shell passes in: this config is in the event log's header, so replay decides alike.
    swap_blocks: int = 0
    swap_ns_per_block: int = 0
    recompute_ns_per_token: int = 0
    # the ITL policy's prompt costs where the executor runs steps with prompt rows as graphs of fixed row
    # buckets (a GPU): (prompt-row bucket, decode-row bucket, ns the bucket's prompt rows add to that
    # decode-only step), measured once at boot on the captured graphs. A step's cost moves in jumps at the
    # buckets, and the online fit (prompt tokens -> ns) learns only from the chunk sizes it chose: on the 8B
    # shape it settled on whole-budget chunks (~930 prompt rows beside 62 decode rows, 3.36x a decode step at
    # ratio 3). With a table the policy picks whole buckets by their measured cost (`ItlBudget`). () = the
    # online fit alone (a CPU; logs written before this field replay identically)
    prompt_step_ns: tuple[tuple[int, int, int], ...] = ()
    # beside the table: ns a prompt row adds per 1,000 positions of context it reads (attention, which the
    # table's inert rows lack; measured at boot on a long chunk). 512-row chunks at ~1,400-token contexts cost
    # 3.4x a decode step on the 8B shape where the table alone said they fit 3x. 0 = none (older logs)
    prompt_ctx_ns: int = 0
    # the same term by prompt-row bucket where the executor measured each ((bucket, ns), ...): a chunk's attention
    # a row costs more in a small bucket than in the 512 one (the 8B on an H100: ~64 µs at 256 rows, ~41 at 512
    # per 1,000 positions, against 32 measured at 512 from ~1,536 positions); () = prompt_ctx_ns for every bucket
    prompt_ctx_by: tuple[tuple[int, int], ...] = ()
    # True: running sequences in the steady plain decode state are planned and updated as arrays
    # (`imp.core.lane.DecodeLane`): one token fed, one sampled, nothing else asked. The tokens are the same; the
    # rows of a step come in another order (the lane's first), so logs written before this field (False) replay
    # identically only without it
    decode_lane: bool = False

    def __post_init__(self):
        if min(self.num_blocks, self.block_size, self.max_context, self.max_batch_size,
               self.max_step_tokens, self.aging_ns) < 1 or self.request_timeout_ns < 0 \
                or self.pipeline_depth not in (1, 2) or self.itl_target_ns < 0 or self.spec_k_max < 0 \
                or self.spec_min_kept < 0 or self.spec_max_rows < 0 or self.itl_ratio < 0 \
                or min(self.swap_blocks, self.swap_ns_per_block, self.recompute_ns_per_token) < 0 \
                or any(len(e) != 3 or min(e) < 0 or min(e[:2]) < 1 for e in self.prompt_step_ns) \
                or self.prompt_ctx_ns < 0 or any(b <= 0 or ns < 0 for b, ns in self.prompt_ctx_by):
            raise ValueError(f"bad SchedulerConfig {self}")


class Status(enum.Enum):
    HELD = 0  # sibling waiting for the first sequence to compute the prompt
    WAITING = 1  # new or preempted: needs an alloc (or fork)
    RUNNING = 2  # holds blocks; gets work every step it fits
    FINISHED = 3


class Phase(enum.Enum):
    IDLE = 0  # free to plan a step (when fewer than pipeline_depth are in flight)
    KV = 1  # KvRequest sent, waiting for the KvReply


class Req:
    __slots__ = ("id", "prompt", "priority", "salt", "arrival_ns", "order", "reserved", "cached_tokens", "n_running",
                 "n_live", "seqs", "pin_key", "session_id", "pin_len")

    def __init__(self, m: Submit, order: int, reserved: int):
        self.id, self.prompt, self.priority, self.salt = m.req_id, m.prompt, m.priority, m.salt
        self.arrival_ns, self.order, self.reserved = m.arrival_ns, order, reserved
        self.cached_tokens = -1  # prompt tokens found in the prefix cache, at first alloc
        self.n_running = 0
        self.n_live = m.n
        self.seqs: list[Seq] = []
        # where the prompt's KV is pinned when the request ends ("" = not pinned)
        self.pin_key = (f"session:{m.session_id}" if m.session_id
                        else f"prompt:{m.req_id}" if m.cache_prompt or m.pin_tokens > 0 else "")
        # how much of the prompt the pin holds: all of it (a session, cache_prompt), else a cache_control prefix
        self.pin_len = len(m.prompt) if m.session_id or m.cache_prompt else min(m.pin_tokens, len(m.prompt))
        self.session_id = m.session_id


class Seq:
    __slots__ = ("id", "req", "index", "params", "tokens", "status", "num_computed", "num_reported", "table", "in_kv",
                 "admit_no", "plp", "plp_sent", "epoch", "ahead", "pending", "send_params", "drafter", "spec_inflight",
                 "spec_drafted", "spec_accepted", "spec_verifies", "opened", "mu", "watch", "bans", "emitted", "held_lp",
                 "n_prompt", "shadow", "guided", "swapped", "hist", "lane", "wkey")

    def __init__(self, req: Req, index: int, params, prompt: tuple[int, ...] | None = None,
                 guided: Seq | None = None):
        self.id, self.req, self.index, self.params = f"{req.id}#{index}", req, index, params
        self.hist = params.needs_history  # (params never change: a property read once, not every step)
        # its slot in the scheduler's decode lane (imp.core.lane), -1 when not there; while there, the lane's arrays
        # hold its num_computed / ahead / pending (these fields are stale) and its rows are the lane's
        self.lane = -1
        self.wkey: tuple | None = None  # its place in the waiting list (RequestBook._wkey), once it first waits
        self.tokens = list(req.prompt if prompt is None else prompt)  # prompt + generated
        self.n_prompt = len(self.tokens)
        # classifier-free guidance: a choice's shadow sequence (decoding the same tokens after another prompt),
        # and on the shadow the choice it guides (imp.core.guide)
        self.shadow: Seq | None = None
        self.guided = guided
        if guided is not None:
            self.id = f"{req.id}#{index}.cfg"
        self.status = Status.HELD
        self.num_computed = 0  # positions whose KV is written
        self.num_reported = 0  # of those, reported to kv (for prefix hashing)
        self.table: tuple[int, ...] = ()  # always a KvReply's tuple: shared with SeqWork, never copied
        self.in_kv = False  # kv holds a table for it
        self.swapped = 0  # > 0: preempted with this many positions parked in the swap area (kv's "swap_out")
        self.admit_no = 0  # when it last started running (preemption picks the newest)
        self.plp: list = []  # prompt logprobs gathered during prefill (choice 0 only)
        self.plp_sent = False  # delivered with the first token: never scored again
        self.send_params = False  # its next share carries the params (the executor forgets them when freed)
        self.epoch = 0  # results of in-flight work from an older epoch are ignored
        self.ahead = 0  # positions fed by steps in flight (this epoch), beyond num_computed
        self.pending = 0  # tokens those steps will sample (0 or 1), beyond len(tokens)
        self.drafter = None  # imp.core.spec.Drafter, from its first draft on
        self.spec_inflight = False  # a verify share of it is in flight: nothing more is planned until it lands
        self.spec_drafted = self.spec_accepted = self.spec_verifies = 0  # since its last TokenOut
        self.opened = False  # its first TokenOut has gone (that one carries a speculation decline)
        self.mu: float | None = None  # mirostat's state after its last kept token (SampledToken.mu)
        # banned phrases (imp.core.banned, params.banned): the text watch, the tokens banned at a generated
        # index (by rewinds), how many generated tokens have gone out (the rest are held back: a phrase may
        # still complete), and the held ones' SampledTokens when logprobs are asked
        self.watch = None
        self.bans: dict[int, tuple[int, ...]] = {}
        self.emitted = 0
        self.held_lp: list = []


class Work:
    """One sequence's share of the step being prepared or in flight: positions
    start .. start+n-1, sampling after the last when `sample`."""

    __slots__ = ("seq", "n", "has_result", "new", "start", "sample", "epoch", "draft")

    def __init__(self, seq: Seq, n: int, has_result: bool, new: bool = False, start: int = 0, sample: bool = False,
                 draft: tuple[int, ...] = ()):
        self.seq, self.n, self.has_result, self.new = seq, n, has_result, new
        self.start, self.sample, self.epoch = start, sample, seq.epoch
        self.draft = draft  # the last len(draft) of its n positions feed drafted tokens (a verify share)
