"""The store's operations: plain functions of (database, config, message) -> reply.

They run on the writer thread only (see worker.py), inside the transaction it
holds for writes. A write records what it changed in `tally` (the open
transaction's delta); the worker adds that to the committed totals after
COMMIT. SQLite errors propagate to the worker, which turns them into a FAILED
reply and counts them; the refusals decided here (not found, conflict, too
large, bad paging) are replies, not errors.

Eviction is oldest first: by insertion order (`seq`) for the count and bytes
limits, by `created_at` for the age limit. The response just written is never
its own victim (a put larger than max_bytes is refused up front instead).
"""

from __future__ import annotations

import sqlite3

import sqlite_utils

from imp.store.config import StoreConfig
from imp.store.messages import (
    ChainLink,
    StoreDelete,
    StoreGet,
    StoreGetChain,
    StoreItem,
    StoreListInputItems,
    StorePut,
    StoreReply,
    StoreStatus,
    StoreSweep,
    failed,
)
from imp.store.stats import Stats

_IN_CHUNK = 500  # ids per `IN (...)`: far under SQLite's variable limit


def _expired(cfg: StoreConfig, now_s: float, created_at: float) -> bool:
    return bool(cfg.max_age_s and now_s and created_at < now_s - cfg.max_age_s)


def _not_found(req_id: str, response_id: str) -> StoreReply:
    return failed(req_id, StoreStatus.NOT_FOUND, f"no stored response with id {response_id!r}")


# --------------------------------------------------------------------------
# writes


def put(db: sqlite_utils.Database, cfg: StoreConfig, msg: StorePut, totals: Stats, tally: Stats) -> StoreReply:
    if not msg.response_id:
        return failed(msg.req_id, StoreStatus.INVALID, "response_id is empty")
    if any(not it.id for it in msg.input_items):
        return failed(msg.req_id, StoreStatus.INVALID, "an input item has no id")
    size = len(msg.response_json) + sum(len(it.json) for it in msg.input_items)
    if cfg.max_bytes and size > cfg.max_bytes:
        return failed(msg.req_id, StoreStatus.TOO_LARGE,
                      f"response {msg.response_id} is {size} bytes with its input, over the store's max_bytes {cfg.max_bytes}")
    try:
        text = msg.response_json.decode()
        items = [(msg.response_id, pos, it.id, it.json.decode()) for pos, it in enumerate(msg.input_items)]
    except UnicodeDecodeError as e:
        return failed(msg.req_id, StoreStatus.INVALID, f"response {msg.response_id}: JSON is not UTF-8 ({e})")
    try:
        cur = db.execute(
            "INSERT INTO responses (id, previous_response_id, created_at, model, bytes, json) VALUES (?, ?, ?, ?, ?, ?)",
            [msg.response_id, msg.previous_response_id, msg.created_at, msg.model, size, text],
        )
    except sqlite3.IntegrityError:
        return failed(msg.req_id, StoreStatus.CONFLICT, f"response {msg.response_id} is already stored")
    db.conn.executemany("INSERT INTO input_items (response_id, position, item_id, json) VALUES (?, ?, ?, ?)", items)
    tally.rows += 1
    tally.bytes += size
    evict(db, cfg, msg.now_s or msg.created_at, cur.lastrowid, totals, tally)
    return StoreReply(msg.req_id, True)


def delete(db: sqlite_utils.Database, cfg: StoreConfig, msg: StoreDelete, totals: Stats, tally: Stats) -> StoreReply:
    rows = db.execute("DELETE FROM responses WHERE id = ? RETURNING bytes", [msg.response_id]).fetchall()
    if not rows:
        return _not_found(msg.req_id, msg.response_id)
    db.execute("DELETE FROM input_items WHERE response_id = ?", [msg.response_id])
    tally.rows -= 1
    tally.bytes -= rows[0][0]
    tally.deleted += 1
    return StoreReply(msg.req_id, True)


def sweep(db: sqlite_utils.Database, cfg: StoreConfig, msg: StoreSweep, totals: Stats, tally: Stats) -> StoreReply:
    evict(db, cfg, msg.now_s, -1, totals, tally)
    return StoreReply(msg.req_id, True)


def evict(db: sqlite_utils.Database, cfg: StoreConfig, now_s: float, keep_seq: int, totals: Stats, tally: Stats) -> None:
    """Apply the three limits, oldest first; `keep_seq` is the row just written."""
    if cfg.max_age_s and now_s:
        old = db.execute("SELECT seq, id, bytes FROM responses WHERE created_at < ? AND seq != ?",
                         [now_s - cfg.max_age_s, keep_seq]).fetchall()
        _drop(db, old, tally, "evicted_age")
    if cfg.max_responses:
        excess = totals.rows + tally.rows - cfg.max_responses
        if excess > 0:
            rows = db.execute("SELECT seq, id, bytes FROM responses WHERE seq != ? ORDER BY seq LIMIT ?",
                              [keep_seq, excess]).fetchall()
            _drop(db, rows, tally, "evicted_count")
    if cfg.max_bytes:
        over = totals.bytes + tally.bytes - cfg.max_bytes
        while over > 0:
            victims, freed = [], 0
            for row in db.execute("SELECT seq, id, bytes FROM responses WHERE seq != ? ORDER BY seq LIMIT 64", [keep_seq]):
                victims.append(row)
                freed += row[2]
                if freed >= over:
                    break
            if not victims:
                break  # only the kept row is left (it fits: put refused anything larger)
            _drop(db, victims, tally, "evicted_bytes")
            over -= freed


def _drop(db: sqlite_utils.Database, rows: list, tally: Stats, reason: str) -> None:
    if not rows:
        return
    db.conn.executemany("DELETE FROM input_items WHERE response_id = ?", [(r[1],) for r in rows])
    db.conn.executemany("DELETE FROM responses WHERE seq = ?", [(r[0],) for r in rows])
    freed = sum(r[2] for r in rows)
    tally.rows -= len(rows)
    tally.bytes -= freed
    tally.evicted_size += freed
    setattr(tally, reason, getattr(tally, reason) + len(rows))


# --------------------------------------------------------------------------
# reads


def get(db: sqlite_utils.Database, cfg: StoreConfig, msg: StoreGet) -> StoreReply:
    row = db.execute("SELECT json, created_at FROM responses WHERE id = ?", [msg.response_id]).fetchone()
    if row is None or _expired(cfg, msg.now_s, row[1]):
        return _not_found(msg.req_id, msg.response_id)
    return StoreReply(msg.req_id, True, response_json=row[0].encode())


_CHAIN = """
WITH RECURSIVE chain(id, depth) AS (
    SELECT ?, 0
    UNION ALL
    SELECT r.previous_response_id, c.depth + 1 FROM chain c JOIN responses r ON r.id = c.id
    WHERE r.previous_response_id != '' AND c.depth < ?
)
SELECT c.depth, c.id, r.previous_response_id, r.created_at, r.json
FROM chain c LEFT JOIN responses r ON r.id = c.id ORDER BY c.depth
"""


def chain(db: sqlite_utils.Database, cfg: StoreConfig, msg: StoreGetChain) -> StoreReply:
    """Walk previous_response_id up from response_id; answer oldest first.

    The walk stops at the first link that is not stored (deleted, evicted, or
    past the age limit): the links after it are returned and its id is named in
    `missing`, so the caller decides whether a conversation with a hole is
    acceptable instead of the store silently answering a shorter one.
    """
    rows = db.execute(_CHAIN, [msg.response_id, cfg.max_chain]).fetchall()
    if len(rows) > cfg.max_chain and rows[-1][4] is not None:  # a stored link past the bound (or a cycle)
        return failed(msg.req_id, StoreStatus.INVALID,
                      f"response {msg.response_id}: previous_response_id chain longer than {cfg.max_chain} responses")
    links, missing = [], ""
    for _, rid, prev, created_at, text in rows:
        if text is None or _expired(cfg, msg.now_s, created_at):
            missing = rid
            break
        links.append((rid, prev, text))
    if not links:
        return _not_found(msg.req_id, msg.response_id)
    items = _items_of(db, [rid for rid, _, _ in links])
    out = [ChainLink(rid, prev, text.encode(), tuple(items.get(rid, ()))) for rid, prev, text in reversed(links)]
    return StoreReply(msg.req_id, True, chain=tuple(out), missing=missing)


def _items_of(db: sqlite_utils.Database, ids: list[str]) -> dict[str, list[StoreItem]]:
    out: dict[str, list[StoreItem]] = {}
    for i in range(0, len(ids), _IN_CHUNK):
        part = ids[i:i + _IN_CHUNK]
        marks = ",".join("?" * len(part))
        for rid, item_id, text in db.execute(
            f"SELECT response_id, item_id, json FROM input_items WHERE response_id IN ({marks}) "
            "ORDER BY response_id, position", part,
        ):
            out.setdefault(rid, []).append(StoreItem(item_id, text.encode()))
    return out


def input_items(db: sqlite_utils.Database, cfg: StoreConfig, msg: StoreListInputItems) -> StoreReply:
    if not 1 <= msg.limit <= 100:
        return failed(msg.req_id, StoreStatus.INVALID, f"limit must be 1..100, got {msg.limit}")
    if msg.order not in ("asc", "desc"):
        return failed(msg.req_id, StoreStatus.INVALID, f"order must be 'asc' or 'desc', got {msg.order!r}")
    row = db.execute("SELECT created_at FROM responses WHERE id = ?", [msg.response_id]).fetchone()
    if row is None or _expired(cfg, msg.now_s, row[0]):
        return _not_found(msg.req_id, msg.response_id)
    asc = msg.order == "asc"
    start = -1 if asc else 1 << 62
    if msg.after:
        hit = db.execute("SELECT position FROM input_items WHERE response_id = ? AND item_id = ? ORDER BY position LIMIT 1",
                         [msg.response_id, msg.after]).fetchone()
        if hit is None:
            return failed(msg.req_id, StoreStatus.INVALID,
                          f"after: response {msg.response_id} has no input item {msg.after!r}")
        start = hit[0]
    sql = ("SELECT item_id, json FROM input_items WHERE response_id = ? AND position > ? ORDER BY position ASC LIMIT ?"
           if asc else
           "SELECT item_id, json FROM input_items WHERE response_id = ? AND position < ? ORDER BY position DESC LIMIT ?")
    rows = db.execute(sql, [msg.response_id, start, msg.limit + 1]).fetchall()
    items = [StoreItem(i, t.encode()) for i, t in rows[:msg.limit]]
    return StoreReply(msg.req_id, True, items=tuple(items), has_more=len(rows) > msg.limit)
