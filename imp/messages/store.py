"""The Responses store (imp/store): ingress asks, the store actor answers. Every request
names `reply_to` and a `req_id` the requester picked; the store answers exactly one
StoreReply with that req_id (reply_to "" = no reply). Time arrives as now_s (the
requester's wall clock); JSON travels as bytes the HTTP side encoded (the store never
parses it)."""

from __future__ import annotations

import enum

from imp.messages.base import Msg, Struct


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


def failed(req_id: str, status: StoreStatus, error: str) -> StoreReply:
    """The reply to a request that failed: the store's own refusals and errors (imp.store.ops,
    worker) and the client's when the store does not answer (imp.actors.store_client)."""
    return StoreReply(req_id, False, status, error)
