"""The prefix cache's tiers past the pool: host memory, then disk (--prompt-cache-dir). The executor's I/O.

The allocator (imp.core.kv) decides what is written, read and dropped; this keeps, writes, reads and deletes.
Every block that becomes a cache entry is written through: into the host tier (an LRU of host_blocks blocks'
bytes; on a GPU this is where the device pool's evicted blocks come back from without a file read) and to a
file. A load looks in host memory first, then on disk (and keeps what it read in host memory: the next
load of it is a copy). The host tier is the process's: it survives pool eviction, suspend/resume and idle
unload, not a restart; the files survive a restart.

A file is named by its key (the block's chained hash: model fingerprint, adapter salt and every token
before it are in it) and lives in a directory per model and KV layout, and its header repeats all of
it, so a file is only ever used for the same tokens of the same model in the same layout:

    DIR/<fingerprint[:16]>-<layout>/<key hex>.kv
    header: MAGIC, key (32 bytes), fingerprint (64 ASCII), layout (64 ASCII), payload length (u64),
            the payload's digest (16 bytes, `_digest`); then the payload (the block's K then V, every layer)

(The digest guards against a torn or damaged file, not a forger: the sum of the payload's 64-bit words and
the sum of its 4 KB pages' sums weighted by their place, mod 2**64, so a flipped bit, a zeroed or short
stretch and a page moved or lost all show. One compiled pass without the GIL, beside the read
(imp.actors.kvtier_io, which also reads a chunk of files in one call): CRC-32 ran at 1-3.5 GB/s and held a
restart's 20k-token read-back on the H200 to 0.62 s (8B shape: 2.6 GB, 16 threads; BLAKE2b before it at 0.9).
The name and header already say whose KV it is; a file someone forged to match them is outside what a cache
directory defends against.)

A file that is foreign (another model's or layout's, moved in by hand), stale (an older format) or
corrupt (short, bad digest) is not used: one log line, and the file is removed when it is ours but
broken. Writes go to a temporary name and are renamed into place, so a crash leaves no half file. A
full disk or an unwritable directory: one warning, and the tier answers "not saved" / "not found":
the server serves on without it, never a failed request.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import struct
import zlib
from pathlib import Path

import numpy as np

from imp.actors import kvtier_io

log = logging.getLogger("imp.kvtier")

MAGIC = b"IMPKV\x03\x00\x00"  # \x01: BLAKE2b-128, \x02: CRC-32 (stale now)
_HEAD = struct.Struct("<8s32s64s64sQ16s")


class TierUnavailable(OSError):
    """The directory cannot be made or written: no disk tier."""


class KvTier:
    def __init__(self, root: str | os.PathLike | None, fingerprint: str, layout: str, host_blocks: int = 0):
        """root None: host memory only (host_blocks > 0)."""
        self.fingerprint, self.layout = fingerprint, layout
        self.host: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()  # key -> payload, LRU first
        self.host_blocks = host_blocks
        self.dir: Path | None = None
        if root is not None:
            slug = "".join(c if c.isalnum() else "_" for c in layout)
            self.dir = Path(root) / f"{fingerprint[:16]}-{slug}"
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                probe = self.dir / ".probe"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as exc:
                raise TierUnavailable(f"prompt cache directory {self.dir}: {exc}") from exc
        self._warned = False
        self._host_lock = threading.Lock()  # saves on the file thread, fetches on the read threads
        self.saved = self.loaded = self.bytes_in = self.bytes_out = self.host_hits = 0

    def _path(self, key: bytes) -> Path:
        return self.dir / f"{key.hex()}.kv"

    def scan(self) -> tuple[bytes, ...]:
        """The keys of this model's files, oldest first (by mtime): the allocator's index at boot."""
        if self.dir is None:
            return ()
        found = []
        for p in self.dir.iterdir():
            name = p.name
            if name.endswith(".kv") and len(name) == 67:
                try:
                    found.append((p.stat().st_mtime_ns, bytes.fromhex(name[:64])))
                except (OSError, ValueError):
                    log.info("[kvtier] %s: not a cache file, ignored", p)
            elif not name.startswith(".tmp"):
                log.info("[kvtier] %s: not a cache file, ignored", p)
        for other in self.dir.parent.iterdir():
            if other.is_dir() and other != self.dir:
                log.info("[kvtier] %s: another model's or layout's cache, not read", other)
        return tuple(k for _, k in sorted(found))

    def save(self, key: bytes, payload) -> bool:
        """payload: the block's bytes, or a function that returns them (a device copy still in flight)."""
        if callable(payload):
            payload = payload()
        if self.host_blocks:
            self._keep(key, bytes(payload))
        if self.dir is None:
            return bool(self.host_blocks)
        head = _HEAD.pack(MAGIC, key, self.fingerprint.encode()[:64], self.layout.encode()[:64], len(payload),
                          _digest(payload))
        tmp = self.dir / f".tmp-{key.hex()}-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
            os.replace(tmp, self._path(key))
        except OSError as exc:  # a full disk, a directory gone: the tier stops saving, the server goes on
            if not self._warned:
                log.warning("[kvtier] cannot write the prompt cache (%s): blocks are not saved until it can", exc)
                self._warned = True
            _unlink(tmp)
            return False
        self.saved += 1
        self.bytes_out += len(head) + len(payload)
        return True

    def _keep(self, key: bytes, payload: bytes) -> None:
        with self._host_lock:
            self.host[key] = payload
            self.host.move_to_end(key)
            while len(self.host) > self.host_blocks:  # the oldest leaves host memory (its file, if any, stays)
                self.host.popitem(last=False)

    def _from_host(self, key: bytes, size: int) -> bytes | None:
        """key's payload from host memory (now its newest), if there whole; counted as a host hit."""
        with self._host_lock:
            got = self.host.get(key)
            if got is None or len(got) != size:
                return None
            self.host.move_to_end(key)
            self.host_hits += 1
            return got

    def fetch(self, key: bytes, size: int, into=None) -> tuple[bytes | memoryview | None, str]:
        """(the payload saved under key, "host" or "disk"), or (None, "") when neither has it whole. into: a
        writable buffer of size bytes to put it in (a GPU's pinned staging buffer), returned as the payload."""
        got = self._from_host(key, size)
        if got is not None:
            if into is None:
                return got, "host"
            memoryview(into).cast("B")[:] = got
            return into, "host"
        data = self.load(key, size, into)
        if data is not None and self.host_blocks:
            self._keep(key, bytes(data))
        return data, "disk" if data is not None else ""

    def fetch_many(self, keys: list[bytes], size: int, out: np.ndarray) -> list[str]:
        """`fetch` for a chunk: key i's payload into slot i of `out` (uint8, slot j at j x size), the disk's in one
        read_files call. [where key i came from: "host", "disk", or "" when neither has it whole]."""
        where = [""] * len(keys)
        misses = []
        for i, key in enumerate(keys):
            got = self._from_host(key, size)
            if got is not None:
                out[i * size:(i + 1) * size] = np.frombuffer(got, np.uint8)
                where[i] = "host"
            else:
                misses.append(i)
        if misses:
            read = self.load_many([keys[i] for i in misses], size, out, misses)
            for i, ok in zip(misses, read):
                if ok:
                    where[i] = "disk"
                    if self.host_blocks:
                        self._keep(keys[i], out[i * size:(i + 1) * size].tobytes())
        return where

    def load(self, key: bytes, size: int, into=None) -> memoryview | None:
        """The payload of key's file, if the file is whole and this model's and layout's (size bytes); read into
        `into` when given (no buffer of its own: a 2 MB read was an mmap and 512 page faults each)."""
        buf = np.empty(size, np.uint8) if into is None else np.frombuffer(memoryview(into).cast("B"), np.uint8)
        if not self.load_many([key], size, buf)[0]:
            return None
        return into if into is not None else memoryview(buf)

    def load_many(self, keys: list[bytes], size: int, out: np.ndarray, slots=None) -> list[bool]:
        """Each key's payload into its slot of `out` (uint8; key i's slot is slots[i], else i; slot j at j x size),
        files read and summed in one call without the GIL (imp.actors.kvtier_io: a restart's read threads beside
        a busy event loop). [whether key i's file was whole and this model's and layout's]; a bad one's slot holds
        garbage, its file is gone with a log line. A file missing (dropped meanwhile, or never written) is False
        without a word: that block is computed."""
        if self.dir is None or not keys:
            return [False] * len(keys)
        paths = [os.fsencode(self._path(k)) for k in keys]
        heads, got, sums = kvtier_io.read_files(paths, _HEAD.size, out, size, slots)
        ok = []
        for i, key in enumerate(keys):
            n = int(got[i])
            why = ""
            if n in (kvtier_io.NO_FILE, kvtier_io.FAILED):  # not there, or unreadable now: computed, file left
                ok.append(False)
                continue
            if n == kvtier_io.SHORT_HEAD:
                why = "short"
            else:
                magic, k, fp, lay, length, digest = _HEAD.unpack(heads[i].tobytes())
                j = i if slots is None else int(slots[i])
                if magic != MAGIC:
                    why = "stale (another format)"
                elif fp.rstrip(b"\0").decode(errors="replace") != self.fingerprint[:64] or k != key:
                    why = "foreign (another model's or key's)"
                elif lay.rstrip(b"\0").decode(errors="replace") != self.layout[:64]:
                    why = "foreign (another KV layout)"
                elif n != size or length != size or _pack(int(sums[i, 0]), int(sums[i, 1]),
                                                          out[j * size:(j + 1) * size]) != digest:
                    why = "corrupt"
            if why:
                log.warning("[kvtier] %s: %s, not used", os.fsdecode(paths[i]), why)
                _unlink(Path(os.fsdecode(paths[i])))
                ok.append(False)
                continue
            self.loaded += 1
            self.bytes_in += _HEAD.size + size
            ok.append(True)
        return ok

    def drop(self, key: bytes) -> None:
        with self._host_lock:
            self.host.pop(key, None)
        if self.dir is not None:
            _unlink(self._path(key))


def _unlink(path: Path) -> None:
    """Remove a file if it is there; a failure leaves it (the next boot's scan logs it, a load checks it)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _digest(payload) -> bytes:
    """16 bytes: the sum of the payload's 64-bit words and the sum of its 4 KB pages' sums times 1, 3, 5, ...
    (mod 2**64), the bytes past the last whole word by CRC-32 (imp.actors.kvtier_io's compiled loop)."""
    return _pack(*kvtier_io.sums(payload), payload)


def _pack(total: int, placed: int, payload) -> bytes:
    """The digest from the words' two sums and the payload's bytes past its last whole word."""
    b = memoryview(payload).cast("B")
    return struct.pack("<QQ", total, placed ^ zlib.crc32(b[len(b) // 8 * 8:]))


