"""What the actors report: queue and KV figures, step shapes and request latencies to
metrics; an actor's fault to ingress and metrics."""

from __future__ import annotations

from imp.messages.base import Msg, Struct
from imp.messages.step import KvFigures


class QueueFigures(Struct):
    waiting: int
    running: int
    queued_prompt_tokens: int
    preemptions: int = 0
    cancellations: int = 0
    timeouts: int = 0
    steps: int = 0


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
    drafted: int = 0  # draft tokens fed by verify shares
    accepted: int = 0  # of those, kept
    verify_rows: int = 0  # verify shares (each emitted its kept drafts + 1)
    verify_misses: int = 0  # verify shares that kept none of their draft


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
    ignored_fields: tuple[str, ...] = ()  # body fields nobody defines, reported (imp.http.pipeline.fates)
    # speculation, summed over the choices (TokenOut.spec_*): the span's imp.spec_* attributes
    spec_drafted: int = 0
    spec_accepted: int = 0
    spec_verify_steps: int = 0


class Fault(Msg):
    """any -> ingress/metrics: an actor failed; waiting callers get an error."""

    actor: str
    error: str
