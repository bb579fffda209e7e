"""A finished request's record: its trace ids, its timeline, its JSONL line, and the writer.

The OTLP exporter, `--log-requests` and the queue-time histogram all read a
RequestStats through the functions here, so the span, the log line and
/metrics agree on the ids and on where queue, prefill and decode begin and
end. Everything here is a plain function of the message (the times in it were
read by the driver as they happened), except the writer thread and the random
bits, which the caller passes in.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from dataclasses import dataclass
from typing import Callable

import msgspec

from imp.messages import RequestStats

log = logging.getLogger("imp.request_log")

# W3C trace-context: version-traceid-parentid-flags, lowercase hex only
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-[^\s]*)?")


@dataclass(frozen=True)
class TraceIds:
    trace_id: int  # the caller's (traceparent) or minted
    span_id: int  # this hop's SERVER span, always minted
    parent_span_id: int  # the caller's span; 0 = a root span (no usable traceparent)
    sampled: bool  # the caller's sampled flag; True for a minted root


def parse_traceparent(header: str) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a W3C traceparent, or None when it is absent
    or invalid: all-zero ids, version ff, and a version-00 header with trailing fields are
    ignored as the spec says, and the request is traced as a fresh root."""
    m = _TRACEPARENT.fullmatch(header.strip())
    if m is None:
        return None
    version, tid, pid, flags, rest = m.groups()
    trace_id, parent = int(tid, 16), int(pid, 16)
    if version == "ff" or (version == "00" and rest) or trace_id == 0 or parent == 0:
        return None
    return trace_id, parent, bool(int(flags, 16) & 0x01)


def nonzero_bits(randbits: Callable[[int], int], k: int) -> int:
    """A random k-bit id that is not zero (zero means 'invalid' in W3C and OTLP)."""
    while True:
        v = randbits(k)
        if v:
            return v


def mint_ids(traceparent: str, randbits: Callable[[int], int]) -> TraceIds:
    """The ids of one request. Minted whether or not anything is exported, so the JSONL
    line carries the ids the span would have."""
    parsed = parse_traceparent(traceparent) if traceparent else None
    span_id = nonzero_bits(randbits, 64)
    if parsed is None:
        return TraceIds(nonzero_bits(randbits, 128), span_id, 0, True)
    trace_id, parent, sampled = parsed
    return TraceIds(trace_id, span_id, parent, sampled)


# ---------------------------------------------------------------------------- the timeline


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


@dataclass(frozen=True)
class Timeline:
    """Where a request's phases begin and end, in the driver's Unix nanoseconds.

    start = arrival (0 when the driver recorded no wall times: then only the lengths mean
    anything); queue_end = the first batch; first = the first generated token; end = done.
    """

    start: int
    queue_end: int | None
    first: int | None
    end: int

    @property
    def queue(self) -> tuple[int, int] | None:
        """Arrival to the first batch. A request that ended without a first batch or a token
        (cancelled or timed out in the queue) waited its whole life."""
        if self.queue_end is not None:
            return self.start, self.queue_end
        return (self.start, self.end) if self.first is None else None

    @property
    def prefill(self) -> tuple[int, int] | None:
        """The first batch to the first token (from arrival when the first batch is not
        known); one that ended in prefill runs to the end."""
        if self.first is not None:
            return (self.queue_end if self.queue_end is not None else self.start), self.first
        return (self.queue_end, self.end) if self.queue_end is not None and self.end > self.queue_end else None

    @property
    def decode(self) -> tuple[int, int] | None:
        return (self.first, self.end) if self.first is not None else None

    @property
    def queue_s(self) -> float:
        q = self.queue
        return (q[1] - q[0]) / 1e9 if q else 0.0

    @property
    def ttft_s(self) -> float | None:
        return (self.first - self.start) / 1e9 if self.first is not None else None

    @property
    def duration_s(self) -> float:
        return (self.end - self.start) / 1e9


def timeline(m: RequestStats) -> Timeline:
    """The request's timeline: the driver's wall times where it recorded them, else the
    lengths it measured (queue_s / ttft_s / duration_s) laid from arrival. Clamped so the
    phases are ordered and inside [start, end] whatever clock skew the driver saw."""
    start = m.arrival_unix_ns
    end = max(start, m.end_unix_ns or start + _ns(m.duration_s))
    first = m.first_token_unix_ns or (start + _ns(m.ttft_s) if m.ttft_s > 0 else None)
    qe = m.queue_end_unix_ns or (start + _ns(m.queue_s) if m.queue_s > 0 else None)
    if first is not None:
        first = min(max(first, start), end)
    if qe is not None:
        qe = min(max(qe, start), first if first is not None else end)
    return Timeline(start, qe, first, end)


# ---------------------------------------------------------------------------- the JSONL line


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def finish_reasons(m: RequestStats) -> tuple[str, ...]:
    return m.finish_reasons or ((m.finish,) if m.finish else ())


def log_record(m: RequestStats, ids: TraceIds, t: Timeline) -> dict:
    """One --log-requests line: the server's id next to the client's, the trace ids the
    span carries (exported or not), tokens and timings."""
    return {
        "ts_unix_ns": t.end,
        "req_id": m.request_id,
        "client_request_id": m.client_request_id or None,
        "endpoint": m.endpoint,
        "model": m.model,
        "status": m.status,
        "stream": m.stream,
        "trace_id": f"{ids.trace_id:032x}",
        "span_id": f"{ids.span_id:016x}",
        "parent_span_id": f"{ids.parent_span_id:016x}" if ids.parent_span_id else None,
        "sampled": ids.sampled,
        "prompt_tokens": m.prompt_tokens,
        "completion_tokens": m.completion_tokens,
        "cached_tokens": m.cached_tokens,
        "finish_reasons": list(finish_reasons(m)),
        "reject_code": m.reject_code or None,
        "queue_ms": _ms(t.queue_s),
        "ttft_ms": _ms(t.ttft_s),
        "duration_ms": _ms(t.duration_s),
        "arrival_unix_ns": t.start,
    }


_CLOSE = object()


class RequestLogWriter:
    """Appends JSON lines to a file on its own thread: the event loop only enqueues.

    Lines are encoded and written by the thread and flushed whenever it has drained its
    queue, so a reader sees a request's line within moments of its end, and a slow disk
    delays the file, never a request.
    """

    def __init__(self, path: str):
        self.path = path
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._file = open(path, "ab")  # opened at boot: a bad path fails the boot, not a request
        self._thread = threading.Thread(target=self._run, name="imp-request-log", daemon=True)
        self._thread.start()

    def write(self, record: dict) -> None:
        self._q.put(record)

    def _run(self) -> None:
        enc = msgspec.json.Encoder()
        while True:
            item = self._q.get()
            try:
                while True:
                    if item is _CLOSE:
                        self._file.flush()
                        return
                    self._file.write(enc.encode(item) + b"\n")
                    try:
                        item = self._q.get_nowait()
                    except queue.Empty:
                        break
                self._file.flush()
            except OSError as exc:  # a full disk loses lines, not the server
                log.warning("request log %s: %s", self.path, exc)

    def close(self, timeout_s: float = 5.0) -> None:
        self._q.put(_CLOSE)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._file.close()
