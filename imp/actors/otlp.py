"""OTLP exporter actor: one OpenTelemetry SERVER span per finished generation request.

It receives the RequestStats the driver produced for each request (the same
message the metrics actor gets) and turns it into a span tree on the request's
own recorded timeline: a SERVER span named after the route, with children
queue / prefill / decode. Every timestamp comes from the message; nothing here
reads the clock. A W3C traceparent puts the span inside the caller's trace; a
clear sampled flag exports nothing (counted). Spans are handed to the SDK's
BatchSpanProcessor, whose thread exports them over OTLP/HTTP in one-second
batches, so handling a message is a deque append: a slow or dead collector
costs one warning and counted failures, never request latency.

The same actor writes --log-requests (imp/actors/request_log.py), so the JSONL
line carries the ids the span carries, minted even when nothing is exported.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from typing import Callable, Sequence

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from imp.actors.base import Actor, Bus
from imp.actors.metrics import OtlpCounters, refused
from imp.actors.otlp_config import DEFAULT_SERVICE_NAME, OtlpConfig  # noqa: F401  (OtlpConfig: re-exported)
from imp.actors.request_log import (RequestLogWriter, Timeline, TraceIds, finish_reasons, log_record, mint_ids,
                                    nonzero_bits, timeline)
from imp.messages import Msg, RequestStats

log = logging.getLogger("imp.otlp")

# the span's name is the route the request came in on (RequestStats.endpoint is the metrics label)
ENDPOINT_PATHS = {
    "chat_completions": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "infill": "/infill",
    "responses": "/v1/responses",
    "embeddings": "/v1/embeddings",
    "rerank": "/v1/rerank",
    "score": "/v1/score",
}
_SCOPE = InstrumentationScope("imp.server")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def traced(m: RequestStats) -> bool:
    """Only requests that reached generation get a span (a refusal emits none)."""
    return not refused(m)


def server_attributes(m: RequestStats, t: Timeline) -> dict:
    """The reference's span attributes, exactly; imp.ttft_ms only when a token came."""
    attrs = {
        "imp.request_id": m.request_id,
        "imp.client_request_id": m.client_request_id,
        "gen_ai.request.model": m.model,
        "gen_ai.usage.input_tokens": m.prompt_tokens,
        "gen_ai.usage.output_tokens": m.completion_tokens,
        "imp.cached_tokens": m.cached_tokens,
        "gen_ai.response.finish_reasons": finish_reasons(m),
        "imp.stream": m.stream,
        "imp.queue_ms": round(t.queue_s * 1e3, 3),
    }
    if t.ttft_s is not None:
        attrs["imp.ttft_ms"] = round(t.ttft_s * 1e3, 3)
    if m.spec_verify_steps:  # a verify step ran for it (imp.http.pipeline.spec_usage: the usage keys' twins)
        attrs.update({"imp.spec_drafted": m.spec_drafted, "imp.spec_accepted": m.spec_accepted,
                      "imp.spec_emitted": m.spec_accepted + m.spec_verify_steps,
                      "imp.spec_verify_steps": m.spec_verify_steps})
    return attrs


def request_spans(m: RequestStats, ids: TraceIds, t: Timeline, resource: Resource,
                  randbits: Callable[[int], int]) -> list[ReadableSpan]:
    """The SERVER span and its queue / prefill / decode children, children first (the order
    a tracer would end them in)."""
    ctx = SpanContext(ids.trace_id, ids.span_id, is_remote=False, trace_flags=_SAMPLED)
    parent = (SpanContext(ids.trace_id, ids.parent_span_id, is_remote=True, trace_flags=_SAMPLED)
              if ids.parent_span_id else None)
    status = Status(StatusCode.ERROR, f"HTTP {m.status}") if m.status >= 500 else Status(StatusCode.UNSET)
    spans = []
    for name, phase in (("queue", t.queue), ("prefill", t.prefill), ("decode", t.decode)):
        if phase is None:
            continue
        child = SpanContext(ids.trace_id, nonzero_bits(randbits, 64), is_remote=False, trace_flags=_SAMPLED)
        spans.append(ReadableSpan(name, child, parent=ctx, resource=resource, attributes={},
                                  kind=SpanKind.INTERNAL, start_time=phase[0], end_time=phase[1],
                                  instrumentation_scope=_SCOPE))
    spans.append(ReadableSpan(ENDPOINT_PATHS.get(m.endpoint, "/" + m.endpoint), ctx, parent=parent,
                              resource=resource, attributes=server_attributes(m, t), kind=SpanKind.SERVER,
                              status=status, start_time=t.start, end_time=t.end, instrumentation_scope=_SCOPE))
    return spans


class CountingExporter(SpanExporter):
    """Wraps the OTLP exporter: counts what the collector took and what it refused, and
    says so once per outage (the SDK's own per-batch log lines are silenced: at a
    batch a second they would be noise, and the counter carries the number)."""

    def __init__(self, inner: SpanExporter, counters: OtlpCounters, endpoint: str):
        self.inner, self.counters, self.endpoint = inner, counters, endpoint
        self.down = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # noqa: BLE001 - an exporter bug must not kill the batch thread
            log.debug("OTLP export raised", exc_info=True)
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            self.counters.spans_exported.inc(len(spans))
            if self.down:
                log.info("OTLP collector %s is reachable again", self.endpoint)
                self.down = False
        else:
            self.counters.export_failures.inc()
            if not self.down:
                log.warning("OTLP export to %s failed; dropping span batches until it answers "
                            "(counted in imp_otlp_export_failures_total)", self.endpoint)
                self.down = True
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _Once(logging.Filter):
    """Lets the first record of a kind through (the SDK's 'Queue full' is per span)."""

    def __init__(self):
        super().__init__()
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "Queue full" not in record.getMessage():
            return True
        first, self.seen = not self.seen, True
        return first


def _quiet_sdk_logs() -> None:
    # CountingExporter speaks for the exporter (one warning per outage, counters for the rest)
    logging.getLogger("opentelemetry.exporter.otlp.proto.http.trace_exporter").setLevel(logging.CRITICAL)
    internal = logging.getLogger("opentelemetry.sdk._shared_internal")
    if not any(isinstance(f, _Once) for f in internal.filters):
        internal.addFilter(_Once())


def otlp_http_exporter(cfg: OtlpConfig) -> SpanExporter:
    # imported here: the exporter package is needed only when an endpoint is configured
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=cfg.endpoint, timeout=cfg.timeout_s)


async def _off_loop(fn: Callable[[], object], limit_s: float) -> None:
    """Run a blocking shutdown on a daemon thread and wait at most limit_s for it: a flush
    to a dead collector must not hold the server's exit (nor the loop's executor)."""
    t = threading.Thread(target=fn, daemon=True, name="imp-otlp-shutdown")
    t.start()
    waited = 0.0
    while t.is_alive() and waited < limit_s:
        await asyncio.sleep(0.02)
        waited += 0.02


class OtlpActor(Actor):
    name = "otlp"

    def __init__(self, bus: Bus, cfg: OtlpConfig, counters: OtlpCounters, *,
                 exporter: SpanExporter | None = None, randbits: Callable[[int], int] = secrets.randbits):
        """counters: the metrics actor's `otlp` (so they read 0 without an exporter);
        exporter: a SpanExporter instead of OTLP/HTTP to cfg.endpoint (tests)."""
        super().__init__(bus)
        self.cfg, self.counters, self.randbits = cfg, counters, randbits
        self.resource = Resource({"service.name": cfg.service_name, "telemetry.sdk.language": "python",
                                  "telemetry.sdk.name": "opentelemetry"})
        self.processor: BatchSpanProcessor | None = None
        if cfg.endpoint or exporter is not None:
            _quiet_sdk_logs()
            inner = exporter if exporter is not None else otlp_http_exporter(cfg)
            self.processor = BatchSpanProcessor(CountingExporter(inner, counters, cfg.endpoint or "exporter"),
                                                schedule_delay_millis=cfg.schedule_delay_ms)
        self.request_log = RequestLogWriter(cfg.log_requests) if cfg.log_requests else None

    def record(self, m: RequestStats) -> TraceIds:
        """One finished request: its span tree to the batch queue, its line to the log."""
        ids = mint_ids(m.traceparent, self.randbits)
        t = timeline(m)
        if self.processor is not None and traced(m):
            if not ids.sampled:
                self.counters.unsampled.inc()
            elif t.start > 0:  # a request without wall times cannot be placed on a trace
                for span in request_spans(m, ids, t, self.resource, self.randbits):
                    self.processor.on_end(span)
        if self.request_log is not None:
            self.request_log.write(log_record(m, ids, t))
        return ids

    async def on_message(self, sender: str, msg: Msg) -> None:
        if isinstance(msg, RequestStats):
            self.record(msg)

    async def on_stop(self) -> None:
        # flush what is queued, within a bound: the collector may be gone
        if self.processor is not None:
            await _off_loop(self.processor.shutdown, min(self.cfg.timeout_s, 5.0))
        if self.request_log is not None:
            await _off_loop(self.request_log.close, 5.0)
