"""The event log: every message delivered between actors, in order.

File format: a stream of frames, each a 4-byte little-endian length followed by
a msgpack document. The first frame is a `LogHeader`; every later frame is an
`Envelope`. Records are encoded on the event-loop thread (msgspec is fast) and
written by a background thread in batches, so the log never blocks a step on
disk I/O. Without a file the log keeps a bounded in-memory ring of encoded envelopes,
enough to dump the recent past when something goes wrong (`dump`).
"""

from __future__ import annotations

import collections
import struct
import threading
from pathlib import Path
from typing import Any, Iterator

import msgspec

from imp.log.upcast import READERS
from imp.messages import SCHEMA_VERSION, Message

_LEN = struct.Struct("<I")


class LogHeader(msgspec.Struct, frozen=True):
    schema_version: int
    fingerprint: str  # model fingerprint: replaying against another model is refused
    configs: dict[str, dict[str, Any]]  # core name -> its frozen config, as builtins
    created_ns: int = 0
    note: str = ""


class Envelope(msgspec.Struct, frozen=True, array_like=True, gc=False):
    seq: int
    sender: str
    receiver: str
    step: int  # the scheduler's step at the time (logical clock)
    wall_ns: int  # recorded for humans; no decision ever reads it
    payload: Message


_enc = msgspec.msgpack.Encoder()
_env_dec = msgspec.msgpack.Decoder(Envelope)
_hdr_dec = msgspec.msgpack.Decoder(LogHeader)


def _frame(doc: bytes) -> bytes:
    return _LEN.pack(len(doc)) + doc


class EventLog:
    """Append-only log. `append` is cheap; file writes happen on a thread."""

    def __init__(self, path: str | Path | None = None, ring: int = 20000):
        self.path = Path(path) if path else None
        # the ring keeps encoded frames, not objects: 20k live message objects
        # would make every cyclic-GC pass walk them (measured: +1 ms/step at batch 256)
        self.ring: collections.deque[bytes] = collections.deque(maxlen=ring)
        self.count = 0
        self._buf: list[bytes] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._fh = None
        self._thread: threading.Thread | None = None
        self.enabled = True

    def open(self, header: LogHeader) -> None:
        self.header = header
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "wb")
        self._fh.write(_frame(_enc.encode(header)))
        self._thread = threading.Thread(target=self._writer, name="eventlog", daemon=True)
        self._thread.start()

    def append(self, env: Envelope) -> None:
        if not self.enabled:
            return
        self.count += 1
        doc = _frame(_enc.encode(env))
        self.ring.append(doc)
        if self._fh is not None:
            with self._lock:
                self._buf.append(doc)
            if len(self._buf) >= 256:
                self._wake.set()

    def _writer(self) -> None:
        while True:
            self._wake.wait(0.05)
            self._wake.clear()
            with self._lock:
                buf, self._buf = self._buf, []
            if buf and self._fh is not None:
                self._fh.write(b"".join(buf))
                self._fh.flush()
            if self._closed:
                return

    def flush(self) -> None:
        """Write everything appended so far (synchronously)."""
        if self._fh is None:
            return
        with self._lock:
            buf, self._buf = self._buf, []
        if buf:
            self._fh.write(b"".join(buf))
            self._fh.flush()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def dump(self, path: str | Path) -> None:
        """Write the in-memory ring (with the header) to a file."""
        with open(path, "wb") as fh:
            fh.write(_frame(_enc.encode(self.header)))
            fh.write(b"".join(self.ring))


def read_log(path: str | Path) -> tuple[LogHeader, Iterator[Envelope]]:
    """Read a log file: its header and an iterator over its envelopes."""
    data = Path(path).read_bytes()
    view = memoryview(data)
    off = 0

    def frame() -> bytes | None:
        nonlocal off
        if off + 4 > len(data):
            return None
        (n,) = _LEN.unpack_from(data, off)
        if off + 4 + n > len(data):  # a torn last record: the writer died mid-write
            return None
        doc = view[off + 4 : off + 4 + n]
        off += 4 + n
        return doc

    first = frame()
    if first is None:
        raise ValueError(f"{path}: empty or not an imp event log")
    header = _hdr_dec.decode(first)
    version = READERS.get(header.schema_version)
    if version is None:
        raise ValueError(f"{path}: log schema v{header.schema_version}; this imp reads "
                         f"{', '.join(f'v{v}' for v in sorted(READERS))}")
    if header.schema_version == SCHEMA_VERSION:
        dec, up = _env_dec, None
    else:  # an old log: decode with that version's shapes, upcast each payload to today's
        dec = msgspec.msgpack.Decoder(_envelope_type(header.schema_version, version.payload_type))
        up = version.upcast

    def records() -> Iterator[Envelope]:
        while (doc := frame()) is not None:
            env = dec.decode(doc)
            if up is not None:
                env = Envelope(env.seq, env.sender, env.receiver, env.step, env.wall_ns, up(env.payload))
            yield env

    return header, records()


def _envelope_type(version: int, payload_type) -> type:
    return msgspec.defstruct(f"EnvelopeV{version}", [("seq", int), ("sender", str), ("receiver", str),
                                                     ("step", int), ("wall_ns", int), ("payload", payload_type)],
                             frozen=True, array_like=True, gc=False)
