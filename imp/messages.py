"""The message catalogue: every message that crosses an actor boundary.

All messages are frozen, tagged msgspec Structs (array_like, gc=False) so that
they encode fast and small into the event log and decode back to the same
objects for replay. Changing a field is a schema change: bump SCHEMA_VERSION
and teach `imp.log.eventlog` to upcast the old form.

Actor names (receivers/senders in the log):
    ingress    HTTP front door; owns request handles and their output queues
    admission  capacity checks, reservations, queued-token limits
    scheduler  continuous batching; decides every step
    kv         KV block allocator (paged blocks, refcounts, prefix cache)
    executor   runs model steps (one per device)
    detok      incremental detokenizer, stop strings, stream fan-out
    metrics    figures for /metrics and /health
    clock      ticks (time enters the cores only through messages)

Flow of one request:
    ingress -Submit-> admission -Enqueue-> scheduler          (or admission -Reject-> ingress)
    scheduler -KvRequest-> kv -KvReply-> scheduler            (once per step)
    scheduler -StepPlan-> executor -StepResult-> scheduler    (once per step)
    scheduler -TokenOut-> detok -Delta-> ingress              (per produced token batch)
    ingress -Cancel-> admission -Cancel-> scheduler           (disconnect / stop string)
    scheduler -Finished-> admission                           (releases queued-token accounting)
    ingress -Suspend/Resume-> admission                       (POST /admin/suspend, /admin/resume)
"""

from __future__ import annotations

import enum
from typing import Union

import msgspec

# 2: SeqWork.pending, params sent once per admission, replica names
# 3: tuples for every sequence, Enqueue wraps its Submit, Delta wraps its TokenOut
SCHEMA_VERSION = 3


class FinishReason(enum.IntEnum):
    """Why a sequence ended. NONE while it runs."""

    NONE = 0
    STOP = 1  # EOS / stop token / stop string
    LENGTH = 2  # max_tokens or context end
    CANCELLED = 3  # client went away
    TIMEOUT = 4  # --request-timeout; reported to the client as "length"
    ERROR = 5  # executor fault
    REJECTED = 6  # refused after enqueue (cannot ever fit)


class Struct(
    msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False
):
    """Plain value carried inside messages (not itself a message)."""


class Msg(
    msgspec.Struct,
    frozen=True,
    array_like=True,
    omit_defaults=True,
    gc=False,
    tag=True,
):
    """Base of every message; the tag is the class name."""


# --------------------------------------------------------------------------
# values


class Constraint(Struct):
    """What a sequence's output must match (compiled by `imp.constrain`; plain data here, so
    it rides in the log and replay rebuilds the same grammar). kind: json_schema (source =
    the schema as JSON text), json_object, regex (whole output), lark (llguidance's Lark,
    also the forced tool-call grammars), gbnf (llama.cpp's). strict: OpenAI's strict
    json_schema semantics."""

    kind: str
    source: str = ""
    strict: bool = False


class SamplingParams(Struct):
    """Resolved sampling settings (defaults already applied by ingress)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filtering (ingress maps the API's 0 -> 50)
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0  # always set: ingress draws one when the client gave none
    stop_token_ids: tuple[int, ...] = ()  # EOS etc.; ends with STOP
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int = -1  # -1 = none; k >= 0 = sampled token's logprob + top k
    # -1 = none; k >= 0 = each prompt token's raw logprob + top k (vLLM prompt_logprobs).
    # Such a request never reuses cached prefix blocks: every prompt row is forwarded.
    prompt_logprobs: int = -1
    # the output's grammar (structured output, a forced tool call); its mask is applied to the
    # logits before anything else, so logprobs read a masked token as probability 0
    constraint: Constraint | None = None
    # the LoRA adapter the sequence runs with (its id from POST /admin/lora/load; 0 = the base
    # model). Carried with the params: the executor keeps them per sequence already.
    lora: int = 0
    # /v1/score: the logprobs of these ids at each sampled position, in this order, in place of
    # the top-k (SampledToken.top); asked with logprobs >= 0, so the host sampler answers
    score_ids: tuple[int, ...] = ()

    # The sampling policy, decided here once: every runner, sampler and the
    # scheduler ask these instead of re-testing the fields.
    @property
    def greedy(self) -> bool:
        """The draw is an argmax (of the biased, penalized logits)."""
        return self.temperature <= 0.0

    @property
    def penalized(self) -> bool:
        """A repetition/presence/frequency penalty applies: the sampler needs the history."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def constrained(self) -> bool:
        """A grammar masks the logits before sampling."""
        return self.constraint is not None

    @property
    def needs_history(self) -> bool:
        """The sampler needs the generated tokens (penalties count them; a grammar's state
        is a function of them): the scheduler sends them with a sequence's first share after
        each admission, and the executor keeps them (SchedulerConfig.history_once; before it,
        with every share that samples)."""
        return self.penalized or self.constraint is not None

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits, nothing else asked: a batch of these is one argmax."""
        return (self.greedy and self.logprobs < 0 and not self.logit_bias and not self.penalized
                and self.constraint is None)

    @property
    def host_sampled(self) -> bool:
        """Needs the CPU sampler even on a GPU (logprobs, typical_p, score_ids)."""
        return self.logprobs >= 0 or (self.typical_p < 1.0 and not self.greedy) or bool(self.score_ids)


class PromptLogprob(Struct):
    """One prompt token scored by the raw model distribution (log-softmax of
    the logits at the position before it); position >= 1."""

    position: int
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...] = ()


class SampledToken(Struct):
    seq_id: str
    token_id: int
    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob) when asked
    # prompt tokens scored this step (SeqWork.prompt_logprobs >= 0); token_id is -1
    # when the step sampled nothing for the sequence (a prefill chunk)
    prompt: tuple[PromptLogprob, ...] = ()


class SeqWork(Struct):
    """One sequence's share of a step.

    token_ids are the tokens fed this step, at positions start_pos ...
    start_pos+len-1; block_table covers every position up to the last one.
    sample says whether the last position's logits are sampled (False for a
    prefill chunk that does not reach the end of the prompt).
    gen_index is the index of the token to be sampled among the generated
    ones; together with params.seed it fixes the random draw, so a
    recomputed (preempted) sequence draws the same tokens again.
    """

    seq_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sample: bool
    # sent with a sequence's first share after each (re)admission (alloc or fork), None
    # after that: the executor keeps them until the sequence is freed (half of a
    # batch-256 plan's bytes were repeated SamplingParams)
    params: SamplingParams | None
    gen_index: int = 0
    # generated tokens so far (params.needs_history: penalties, a grammar). With history_once the scheduler
    # sends every known one with the first share after each admission and () after that: the executor
    # (`attach_state`) fills a sampled share's history in from what it kept and sampled since
    history: tuple[int, ...] = ()
    # >= 0: score the prompt tokens at start_pos+1 .. (top k each), i.e. return
    # the raw logprob rows of this chunk's positions; prompt_next is the prompt
    # token after the chunk (-1 when the chunk ends the prompt)
    prompt_logprobs: int = -1
    prompt_next: int = -1
    # Pipelined steps (scheduler pipeline_depth > 1): the last `pending` tokens
    # of this sequence were sampled by earlier steps still in flight when the
    # scheduler planned this one, so it does not know them. A fed token of
    # PENDING_TOKEN stands for the one the previous step sampled for this
    # sequence, and `history` lacks those `pending` tokens: the executor
    # supplies both (on the device, or from the results it already has).
    pending: int = 0


PENDING_TOKEN = -1


class KvOp(Struct):
    """One allocator operation, as asked by the scheduler.

    kind = "alloc": a new sequence; token_ids is its full known token list
           (prompt, or prompt + generated when recomputing a preempted one);
           the allocator may reuse cached prefix blocks (never the block of
           the last token) and allocates blocks to hold num_tokens positions.
           KvResult.cached_tokens = the positions whose KV is already there.
    kind = "grow":  make the sequence's table hold num_tokens positions;
           token_ids are the tokens whose KV was written since the last op
           (for hashing newly full blocks into the prefix cache). They are
           recorded even when the grow itself fails.
    kind = "free":  release the sequence's blocks (full blocks stay cached);
           token_ids as for grow (hashed before the release).
    kind = "fork":  new sequence parent->seq_id (n > 1 siblings) holding
           num_tokens positions; token_ids its known tokens (the prompt). It
           shares the parent's full blocks of those positions, except the one
           of the last token (refcounts bumped), and gets its own tail blocks.
           cached_tokens = the shared positions.
    Once an op fails for want of blocks, every later op of the same
    KvRequest that needs a new block fails too (no queue jumping).
    """

    kind: str
    seq_id: str
    num_tokens: int = 0
    token_ids: tuple[int, ...] = ()
    parent: str = ""
    salt: str = ""  # LoRA adapter name (prefix cache key)


class KvResult(Struct):
    seq_id: str
    ok: bool
    block_table: tuple[int, ...] = ()
    cached_tokens: int = 0  # alloc: prompt tokens found in the prefix cache
    wait: bool = False  # alloc refused (ok False) because another sequence is computing its next prompt block


class KvFigures(Struct):
    total: int
    free: int
    used: int
    reserved: int
    cached: int
    block_size: int
    evictions: int = 0
    pinned: int = 0  # blocks held by cache_prompt / session pins
    inflight_waits: int = 0  # allocs that waited for prompt blocks another sequence was computing (running total)


class QueueFigures(Struct):
    waiting: int
    running: int
    queued_prompt_tokens: int
    preemptions: int = 0
    cancellations: int = 0
    timeouts: int = 0
    steps: int = 0


# --------------------------------------------------------------------------
# messages


class Submit(Msg):
    """ingress -> admission: a new request, already tokenized."""

    req_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival_ns: int
    n: int = 1
    priority: int = 0
    salt: str = ""
    cache_prompt: bool = False  # pin the prompt's full KV blocks against eviction
    session_id: str = ""  # pin the prompt for the session's next turn (until closed/expired)


class Reject(Msg):
    """admission/scheduler -> ingress: the request will not run."""

    req_id: str
    status: int
    code: str
    message: str
    retry_after_s: float = 0.0


class Enqueue(Msg):
    """admission -> scheduler: an admitted request: its Submit, and the blocks reserved for it."""

    submit: Submit
    reserved_blocks: int = 0


class Cancel(Msg):
    """ingress -> admission -> scheduler: end a request early."""

    req_id: str
    reason: FinishReason = FinishReason.CANCELLED
    index: int = -1  # the choice to end (a stop string in one of n); -1 = all


class SessionClose(Msg):
    """ingress -> admission -> scheduler: unpin a session's prompt now."""

    session_id: str


class EndThinking(Msg):
    """ingress -> admission -> scheduler: append `token_ids` (the model's
    `</think>` spelling) to every running choice of the request as forced
    output tokens, so the model continues with the answer on the same KV."""

    req_id: str
    token_ids: tuple[int, ...]


class Suspend(Msg):
    """ingress -> admission: stop admitting (POST /admin/suspend). New requests
    are refused with 503 `suspended`; admitted ones run to their end."""

    reason: str = "operator"


class Resume(Msg):
    """ingress -> admission: admit again (POST /admin/resume)."""


class Finished(Msg):
    """scheduler -> admission: a request left the scheduler (any reason)."""

    req_id: str
    reason: FinishReason


class Tick(Msg):
    """clock -> scheduler: the time, for timeouts and aging."""

    now_ns: int


class KvRequest(Msg):
    """scheduler -> kv: the allocator operations for one step, in order."""

    step: int
    ops: tuple[KvOp, ...]


class KvReply(Msg):
    """kv -> scheduler: one result per alloc/grow/fork op, in order."""

    step: int
    results: tuple[KvResult, ...]
    figures: KvFigures


class StepPlan(Msg):
    """scheduler -> executor: run these sequences for one step."""

    step: int
    seqs: tuple[SeqWork, ...]
    freed: tuple[str, ...] = ()  # sequences the executor can forget


class StepResult(Msg):
    """executor -> scheduler: what the step produced."""

    step: int
    tokens: tuple[SampledToken, ...]
    now_ns: int
    elapsed_ns: int = 0


class StepFailed(Msg):
    """executor -> scheduler: the step raised; its sequences end with ERROR."""

    step: int
    error: str
    now_ns: int


class TokenOut(Msg):
    """scheduler -> detok: new tokens of one choice of a request."""

    req_id: str
    index: int
    token_ids: tuple[int, ...]
    finish: FinishReason = FinishReason.NONE
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: tuple[SampledToken, ...] = ()
    error: str = ""
    prompt_logprobs: tuple[PromptLogprob, ...] = ()  # with the first token of choice 0


class TokenBatch(Msg):
    """scheduler -> detok: every TokenOut of one scheduler decision, in order."""

    outs: tuple[TokenOut, ...]


class DeltaBatch(Msg):
    """detok -> ingress: the Deltas of one TokenBatch, in order."""

    deltas: tuple["Delta", ...]


class DetokOpen(Msg):
    """ingress -> detok: how to render a request's output."""

    req_id: str
    n: int = 1
    stop: tuple[str, ...] = ()
    skip_special: bool = True
    prompt_tail: tuple[int, ...] = ()  # last prompt tokens, for correct leading spaces


class DetokClose(Msg):
    """ingress -> detok: forget a request that never ran (rejected)."""

    req_id: str


class Delta(Msg):
    """detok -> ingress: one TokenOut rendered as text. `finish` is the TokenOut's, or
    STOP when a stop string ended the choice (`stop_str`, Anthropic's stop_sequence)."""

    out: TokenOut
    text: str
    finish: FinishReason = FinishReason.NONE
    stop_str: str = ""

    # the TokenOut's fields, read through (dialects read a Delta like the TokenOut it renders)
    @property
    def req_id(self) -> str:
        return self.out.req_id

    @property
    def index(self) -> int:
        return self.out.index

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.out.token_ids

    @property
    def prompt_tokens(self) -> int:
        return self.out.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.out.cached_tokens

    @property
    def completion_tokens(self) -> int:
        return self.out.completion_tokens

    @property
    def logprobs(self) -> tuple[SampledToken, ...]:
        return self.out.logprobs

    @property
    def error(self) -> str:
        return self.out.error

    @property
    def prompt_logprobs(self) -> tuple[PromptLogprob, ...]:
        return self.out.prompt_logprobs


class Figures(Msg):
    """scheduler -> metrics: queue and KV figures after a step."""

    kv: KvFigures
    queue: QueueFigures


class StepStats(Msg):
    """scheduler -> metrics: one step's shape and duration."""

    step: int
    num_seqs: int
    num_tokens: int
    num_decode: int
    elapsed_ns: int


class RequestStats(Msg):
    """ingress -> metrics: one finished HTTP generation request."""

    endpoint: str
    status: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_s: float = 0.0
    ttft_s: float = 0.0
    duration_s: float = 0.0
    finish: str = ""
    itl_s: tuple[float, ...] = ()  # inter-token gaps, for the histogram
    # Tracing and the request log (imp/actors/otlp.py). Trailing with defaults, so an older
    # RequestStats still decodes; "" / 0 / () = not known. Times are the wall clock (Unix ns)
    # read by the driver as they happened: the exporter never reads the clock at export time.
    request_id: str = ""  # the server's id for the request (its completion / message id)
    client_request_id: str = ""  # the caller's X-Request-Id, sanitized ("" = none sent)
    model: str = ""  # the model name the request was served by
    stream: bool = False  # the response was streamed (SSE)
    traceparent: str = ""  # the W3C traceparent request header, verbatim ("" = none)
    arrival_unix_ns: int = 0  # the driver submitted it
    queue_end_unix_ns: int = 0  # the scheduler put it into its first batch (0 = unknown)
    first_token_unix_ns: int = 0  # the driver saw its first generated token (0 = none)
    end_unix_ns: int = 0  # the driver was done with it (last token / refusal / cancel)
    finish_reasons: tuple[str, ...] = ()  # one per choice, OpenAI spelling ("stop", "length", ...)
    reject_code: str = ""  # the Reject's code when refused ("context_length_exceeded", ...)


class Fault(Msg):
    """any -> ingress/metrics: an actor failed; waiting callers get an error."""

    actor: str
    error: str


# --------------------------------------------------------------------------
# memory: suspend frees the weights and the KV pool (POST /admin/suspend, --idle-unload-seconds)


class Unload(Msg):
    """ingress -> executor: release the weights and the KV pool (nothing is running: the
    caller drained first). The next StepPlan, or a Reload, loads them again."""

    reason: str = "operator"  # "operator" (POST /admin/suspend) or "idle"


class Reload(Msg):
    """ingress -> executor: load the weights and the KV pool again now (POST /admin/resume)."""


class MemoryState(Msg):
    """executor -> ingress: after an Unload or a (re)load. Resident bytes of the process and,
    on a GPU, the card's free bytes, read before and after (0 when not measured)."""

    actor: str
    loaded: bool
    reason: str
    seconds: float
    rss_before: int = 0
    rss_after: int = 0
    device_free_before: int = 0
    device_free_after: int = 0
    error: str = ""


class LoraLoad(Msg):
    """ingress -> executor: read the adapter at `path` (already confined to --lora-dir) and
    hold it under `lora_id`; sequences whose params.lora is that id run with it."""

    lora_id: int
    name: str
    path: str


class LoraUnload(Msg):
    """ingress -> executor: drop the adapter (no sequence uses it: ingress waited)."""

    lora_id: int


class LoraState(Msg):
    """executor -> ingress: after a LoraLoad / LoraUnload; error says why a load failed."""

    actor: str
    lora_id: int
    loaded: bool
    error: str = ""
    nbytes: int = 0


class KvForget(Msg):
    """ingress -> kv: the pool's contents are gone (unloaded): drop the prefix cache and the
    pins. Sent only while no sequence is live."""


# --------------------------------------------------------------------------
# the Responses store (imp/store): ingress asks, the store actor answers. Every request
# names `reply_to` and a `req_id` the requester picked; the store answers exactly one
# StoreReply with that req_id (reply_to "" = no reply). Time arrives as now_s (the
# requester's wall clock); JSON travels as bytes the HTTP side encoded (the store never
# parses it).


class StoreStatus(enum.IntEnum):
    """The outcome of a store request. Values are the HTTP status the API maps
    them to, so the HTTP side needs no table (it still picks its own envelope)."""

    OK = 200
    INVALID = 400  # bad paging arguments, empty or duplicate ids in a put
    NOT_FOUND = 404  # never stored, deleted, evicted, or older than max_age_s
    CONFLICT = 409  # a put for a response id that is already stored
    TOO_LARGE = 413  # one response (with its input items) exceeds max_bytes
    FAILED = 500  # SQLite refused the write/read (disk full, I/O error, ...); counted
    UNAVAILABLE = 503  # the store did not answer in time, or its actor died


# --------------------------------------------------------------------------
# values


class StoreItem(Struct):
    """One input item: its id (client's or one ingress assigned) and its JSON."""

    id: str
    json: bytes


class ChainLink(Struct):
    """One response of a `previous_response_id` chain: what it was given and
    what it answered (the `output` inside response_json)."""

    response_id: str
    previous_response_id: str
    response_json: bytes
    input_items: tuple[StoreItem, ...] = ()


# --------------------------------------------------------------------------
# requests (ingress -> store)


class StorePut(Msg):
    """Persist one produced response with its input items (`store: true`).

    `input_items` are the items of this request only (with a previous_response_id
    the earlier turns are already stored under their own responses)."""

    req_id: str
    reply_to: str
    response_id: str
    created_at: float  # the response's created_at (seconds); the age limit counts from it
    response_json: bytes
    input_items: tuple[StoreItem, ...] = ()
    previous_response_id: str = ""
    model: str = ""
    now_s: float = 0.0  # wall clock of the write, for evicting by age; 0 = created_at


class StoreGet(Msg):
    """The stored response object (`GET /v1/responses/{id}`)."""

    req_id: str
    reply_to: str
    response_id: str
    now_s: float = 0.0


class StoreGetChain(Msg):
    """The conversation behind `previous_response_id`: the chain ending at
    response_id, oldest first. NOT_FOUND when response_id itself is not stored;
    an ancestor that is gone ends the chain early and is named in `missing`."""

    req_id: str
    reply_to: str
    response_id: str
    now_s: float = 0.0


class StoreDelete(Msg):
    """Forget a response and its input items (`DELETE /v1/responses/{id}`).
    Responses continuing from it keep their own rows; their chains then report
    this id as `missing`."""

    req_id: str
    reply_to: str
    response_id: str


class StoreListInputItems(Msg):
    """A page of a response's input items (`GET /v1/responses/{id}/input_items`),
    OpenAI's cursor paging: after an item id, 1..100 items, "asc" or "desc"."""

    req_id: str
    reply_to: str
    response_id: str
    after: str = ""
    limit: int = 20
    order: str = "desc"
    now_s: float = 0.0


class StoreSweep(Msg):
    """Evict what is older than max_age_s at now_s (a timer may send it; puts
    sweep on their own). Replies only when reply_to is set."""

    now_s: float
    req_id: str = ""
    reply_to: str = ""


# --------------------------------------------------------------------------
# the reply (store -> reply_to)


class StoreReply(Msg):
    """The answer to one request. `ok` is status == OK; on failure `error` says
    why in words fit for a log line or an API error message. The payload fields
    used depend on the request: Get -> response_json; GetChain -> chain (+ missing);
    ListInputItems -> items + has_more; Put/Delete/Sweep -> none."""

    req_id: str
    ok: bool
    status: StoreStatus = StoreStatus.OK
    error: str = ""
    response_json: bytes = b""
    chain: tuple[ChainLink, ...] = ()
    missing: str = ""  # GetChain: the first ancestor id no longer stored ("" = complete)
    items: tuple[StoreItem, ...] = ()
    has_more: bool = False


Message = Union[
    Submit,
    Reject,
    Enqueue,
    Cancel,
    EndThinking,
    SessionClose,
    Finished,
    Tick,
    Suspend,
    Resume,
    KvRequest,
    KvReply,
    StepPlan,
    StepResult,
    StepFailed,
    TokenOut,
    TokenBatch,
    DeltaBatch,
    DetokOpen,
    DetokClose,
    Delta,
    Figures,
    RequestStats,
    StepStats,
    Fault,
    Unload,
    Reload,
    MemoryState,
    KvForget,
    LoraLoad,
    LoraUnload,
    LoraState,
    StorePut,
    StoreGet,
    StoreGetChain,
    StoreDelete,
    StoreListInputItems,
    StoreSweep,
    StoreReply,
]
