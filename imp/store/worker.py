"""The store's writer thread: the one user of the SQLite connection.

The actor hands it requests in bus order; it answers them in that order.
Group commit: it takes whatever has queued up (at most batch_max), runs the
writes inside one IMMEDIATE transaction, each in its own savepoint (a failing
put does not take its neighbours down), and commits once. No reply to a write
leaves before its COMMIT returned, so every `ok=True` the HTTP side saw is in
the WAL file and survives the process being killed the next instant. The delay
a write waits for its commit is bounded by the batch in front of it, not by a
timer.

Reads run on this same thread, after committing any writes queued before them:
a read sees every write sent before it (read-your-writes for a client that puts
and then GETs or continues the chain), and it never sees a write that might
still roll back. The cost, measured with 2 KB responses on a shared 2-core box
(tests/test_store.py prints the first figure): a GET queued behind 50
concurrent writers waits about one batch, median 7-12 ms; a second read-only
connection on its own thread answered the same GETs in a median 3 ms, and
with 1-10 writers both are under 1 ms. Not worth losing the ordering for: a
GET or a chain read happens once per request, next to seconds of generation.

SQLite errors become FAILED replies and are counted (write_failures,
read_failures) and logged; the thread itself never dies of one.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
from typing import Callable

from imp.store import ops
from imp.store.messages import (
    WRITES,
    StoreDelete,
    StoreGet,
    StoreGetChain,
    StoreListInputItems,
    StorePut,
    StoreReply,
    StoreStatus,
    StoreSweep,
    failed,
)
from imp.store.sqlite import StoreDB
from imp.store.stats import Stats

log = logging.getLogger("imp.store")

_STOP = object()
_WRITE_OPS = {StorePut: ops.put, StoreDelete: ops.delete, StoreSweep: ops.sweep}
_READ_OPS = {StoreGet: ops.get, StoreGetChain: ops.chain, StoreListInputItems: ops.input_items}

Replies = list[tuple[str, StoreReply]]  # (reply_to, reply)


class Worker:
    def __init__(self, store: StoreDB, deliver: Callable[[Replies], None]):
        self.store = store
        self.deliver = deliver  # called on this thread with each batch's replies, in order
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        # daemon: if the process ends without on_stop, an uncommitted batch simply never
        # happened (SQLite rolls it back at the next open) and nobody was told it did
        self.thread = threading.Thread(target=self._run, name="store-writer", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, msg) -> None:
        self.q.put(msg)

    def close(self, timeout_s: float = 30.0) -> None:
        """Answer and commit everything submitted so far, then close the file."""
        if not self.thread.is_alive():
            if self.thread.ident is None:  # never started: the connection is still ours to close
                self.store.close()
            return
        self.q.put(_STOP)
        self.thread.join(timeout_s)

    # the thread --------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self.store.close()

    def _serve(self) -> None:
        batch_max = self.store.config.batch_max
        stop = False
        while not stop:
            batch = [self.q.get()]
            while len(batch) < batch_max:
                try:
                    batch.append(self.q.get_nowait())
                except queue.Empty:
                    break
            if _STOP in batch:
                stop = True
                batch = [m for m in batch if m is not _STOP]
            replies = _Batch(self.store).run(batch)
            out = [(to, r) for to, r in replies if to]
            if out:
                self.deliver(out)


class _Batch:
    """One pass over a batch: an open transaction, its replies and its delta."""

    def __init__(self, store: StoreDB):
        self.store = store
        self.db = store.db
        self.stats = store.stats
        self.done: Replies = []  # answered: committed, or reads
        self.pending: Replies = []  # writes in the open transaction, answered at COMMIT
        self.tally = Stats()  # what the open transaction changed

    def run(self, batch: list) -> Replies:
        for msg in batch:
            try:
                if isinstance(msg, WRITES):
                    self._write(msg)
                else:
                    self._commit()
                    self.done.append((msg.reply_to, self._read(msg)))
            except Exception as e:  # noqa: BLE001 - last resort: a bug must fail requests, not kill the thread
                log.exception("responses store: %s failed", type(msg).__name__)
                self._abort(f"internal error: {type(e).__name__}: {e}")
                self.done.append((getattr(msg, "reply_to", ""), failed(getattr(msg, "req_id", ""),
                                  StoreStatus.FAILED, f"responses store internal error: {type(e).__name__}: {e}")))
        self._commit()
        return self.done

    def _write(self, msg) -> None:
        if not self.db.conn.in_transaction:
            try:
                self.db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:
                self.pending.append((msg.reply_to, self._write_failed(msg, e)))
                return
        totals = Stats()
        totals.add(self.stats)
        totals.add(self.tally)
        delta = Stats()
        try:
            with self.db.atomic():  # a savepoint: only this request rolls back on error
                reply = _WRITE_OPS[type(msg)](self.db, self.store.config, msg, totals, delta)
        except Exception as e:  # noqa: BLE001 - SQLite's refusal, or a bug: this request fails, the rest go on
            reply = self._write_failed(msg, e)
            if not self.db.conn.in_transaction:
                # some errors (disk full, I/O) roll back the whole transaction, savepoints and all
                self._abort(str(e))
        else:
            self.tally.add(delta)
        self.pending.append((msg.reply_to, reply))

    def _read(self, msg) -> StoreReply:
        try:
            return _READ_OPS[type(msg)](self.db, self.store.config, msg)
        except Exception as e:  # noqa: BLE001 - as for writes
            self.stats.read_failures += 1
            log.error("responses store %s: %s %s: read failed: %s", self.store.path, type(msg).__name__,
                      msg.response_id, e)
            return failed(msg.req_id, StoreStatus.FAILED, f"responses store read failed: {e}")

    def _commit(self) -> None:
        if not self.db.conn.in_transaction:
            self.done += self.pending
            self.pending = []
            return
        try:
            self.db.execute("COMMIT")
        except sqlite3.Error as e:
            self.db.rollback()
            self._abort(f"commit failed: {e}")
            return
        self.stats.add(self.tally)
        self.tally = Stats()
        self.done += self.pending
        self.pending = []

    def _abort(self, why: str) -> None:
        """The open transaction is lost: every write in it failed, whatever it answered."""
        if self.db.conn.in_transaction:
            self.db.rollback()
        for to, r in self.pending:
            if r.ok:
                self.stats.write_failures += 1
                log.error("responses store %s: request %s rolled back: %s", self.store.path, r.req_id, why)
                r = failed(r.req_id, StoreStatus.FAILED, f"responses store write failed: {why}")
            self.done.append((to, r))
        self.pending = []
        self.tally = Stats()

    def _write_failed(self, msg, e: Exception) -> StoreReply:
        self.stats.write_failures += 1
        what = getattr(msg, "response_id", "") or "sweep"
        log.error("responses store %s: %s %s: write failed: %s", self.store.path, type(msg).__name__, what, e)
        return failed(msg.req_id, StoreStatus.FAILED, f"responses store write failed: {e}")
