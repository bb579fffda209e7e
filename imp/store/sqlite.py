"""Opening the store file: every reason it cannot serve is found here, at boot.

`open_store(config)` runs once, before the server accepts a request. It reads
the header (a file that is not SQLite fails here), switches to WAL, runs
`PRAGMA quick_check`, migrates the schema inside an IMMEDIATE transaction
(which proves the file is writable and that no one else holds its lock), and
applies the limits once. Anything wrong is a `StoreOpenError` naming the file
and what to do, so the operator sees one clear start-up error instead of a 500
on every `store: true` request later.

The connection is opened here, on the boot thread, and then handed to the
store's writer thread (worker.py), which is its only user from then on; that is
why `check_same_thread` is off (the sqlite3 module is built serialized,
threadsafety 3, so the handover itself is safe).
"""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import sqlite_utils

from imp.store import ops
from imp.store.config import StoreConfig
from imp.store.schema import SchemaError, migrate
from imp.store.stats import Stats

log = logging.getLogger("imp.store")


class StoreOpenError(Exception):
    """The responses store cannot be used; raised at boot, the message names the file."""


@dataclass
class StoreDB:
    """An open, validated store: the connection and the committed counters."""

    db: sqlite_utils.Database
    config: StoreConfig
    path: Path
    stats: Stats = field(default_factory=Stats)

    def close(self) -> None:
        # the last connection to close checkpoints the WAL into the main file
        self.db.close()


def _why(e: sqlite3.Error) -> str:
    name = getattr(e, "sqlite_errorname", "") or ""
    text = str(e)
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
        return "is locked by another process (another imp server on the same --responses-store?)"
    if name.startswith("SQLITE_READONLY") or "readonly" in text:
        return "is read-only (check the permissions of the file and of its directory, which WAL writes into)"
    if name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT")) or "not a database" in text or "malformed" in text:
        return "is not a valid SQLite database or is corrupt (move it aside to start with an empty store)"
    if name.startswith(("SQLITE_CANTOPEN", "SQLITE_PERM")):
        return "cannot be opened (is its directory writable?)"
    if name.startswith("SQLITE_FULL"):
        return "cannot be written: the disk is full"
    return "cannot be used"


def _error(path: Path, e: Exception) -> StoreOpenError:
    if isinstance(e, sqlite3.Error):
        return StoreOpenError(f"responses store {path} {_why(e)}: {e}")
    return StoreOpenError(f"responses store {path}: {e}")


def open_store(config: StoreConfig, now_s: float = 0.0) -> StoreDB:
    """Open and validate the store; raise StoreOpenError if it cannot serve.

    now_s (the boot's wall clock, 0 = skip) evicts what aged out while the
    server was down; the count and bytes limits are applied in any case (they
    may have been lowered since the file was written).
    """
    path = Path(config.path).expanduser()
    if path.is_dir():
        raise StoreOpenError(f"responses store {path}: is a directory, not a database file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise StoreOpenError(f"responses store {path}: cannot create its directory: {e}") from e
    try:
        conn = sqlite3.connect(str(path), timeout=config.open_timeout_s, check_same_thread=False)
    except sqlite3.Error as e:
        raise _error(path, e) from e
    try:
        store = _validate(conn, config, path, now_s)
    except BaseException as e:
        conn.close()
        if isinstance(e, StoreOpenError):
            raise
        if isinstance(e, (sqlite3.Error, SchemaError, OSError)):
            raise _error(path, e) from e
        raise
    log.info("responses store %s: %d responses, %d bytes", path, store.stats.rows, store.stats.bytes)
    return store


def _validate(conn: sqlite3.Connection, config: StoreConfig, path: Path, now_s: float) -> StoreDB:
    db = sqlite_utils.Database(conn, execute_plugins=False)
    db.execute("SELECT count(*) FROM sqlite_master").fetchone()  # reads the header: garbage fails here
    db.enable_wal()
    if db.journal_mode != "wal":
        raise StoreOpenError(f"responses store {path}: SQLite cannot use WAL mode on it (journal_mode "
                             f"stays {db.journal_mode!r}; a network filesystem?)")
    db.execute(f"PRAGMA synchronous={config.synchronous}")
    if config.integrity_check:
        problems = [r[0] for r in db.execute("PRAGMA quick_check(5)")]
        if problems != ["ok"]:
            raise StoreOpenError(f"responses store {path} is corrupt (move it aside to start with an empty "
                                 f"store): {'; '.join(problems).replace(chr(10), ' ')}")
    have, want = migrate(db)
    if have != want:
        log.info("responses store %s: schema %d -> %d", path, have, want)
    db.execute(f"PRAGMA busy_timeout={int(config.busy_timeout_s * 1000)}")
    rows, size = db.execute("SELECT count(*), coalesce(sum(bytes), 0) FROM responses").fetchone()
    store = StoreDB(db, config, path, Stats(rows=rows, bytes=size))
    tally = Stats()
    db.execute("BEGIN IMMEDIATE")
    ops.evict(db, config, now_s, -1, store.stats, tally)
    db.execute("COMMIT")
    store.stats.add(tally)
    return store
