"""A request body and its fields: JSON in, typed values out, or a 400 naming the field.

Every dialect parses its wire body with these (each with its own ranges);
none of them clamps a value that would silently change the output.
"""

from __future__ import annotations

import asyncio
import json
import math
import re

from aiohttp import web

from imp.http.errors import bad

_MISSING = object()


_BIG = 256 * 1024  # bodies past this are parsed on a worker thread


def _parse(raw: bytes):
    body = json.loads(raw)
    # a lone UTF-16 surrogate ("\ud800") parses but cannot be encoded: find it now,
    # not as a 500 deep in the tokenizer
    json.dumps(body, ensure_ascii=False).encode()
    return body


async def read_json(request: web.Request) -> dict:
    """The body as a JSON object; every way it can be malformed is a 400. A large body is
    parsed off the event loop (an 8 MB body takes tens of ms: streams must not stall)."""
    try:
        raw = await request.read()
        body = await asyncio.to_thread(_parse, raw) if len(raw) > _BIG else _parse(raw)
    except RecursionError:
        raise bad("request body is nested too deeply") from None
    except UnicodeEncodeError:
        raise bad("request body holds an unpaired UTF-16 surrogate (\\ud800-\\udfff) in a string") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise bad(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    return body


def is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def num(body: dict, name: str, lo=None, hi=None, *, integer=False, default=None,
        lo_open=False, hi_open=False, where: str | None = None):
    """A numeric field: None/absent -> default; wrong type or range -> 400."""
    where = where or name
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if integer:
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise bad(f"'{where}' must be an integer, got {type(v).__name__}", where)
    elif not is_num(v):
        raise bad(f"'{where}' must be a number, got {type(v).__name__}", where)
    if isinstance(v, float) and not math.isfinite(v):
        raise bad(f"'{where}' must be finite", where)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(f"'{where}' must be {'>' if lo_open else '>='} {lo}, got {v}", where)
    if hi is not None and (v >= hi if hi_open else v > hi):
        raise bad(f"'{where}' must be {'<' if hi_open else '<='} {hi}, got {v}", where)
    return v


def boolean(body: dict, name: str, default: bool = False, *, where: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{where or name}' must be a boolean", where or name)
    return v


def string(body: dict, name: str, default: str | None = None, *, required=False,
           where: str | None = None) -> str | None:
    where = where or name
    v = body.get(name)
    if v is None:
        if required:
            raise bad(f"'{where}' is required", where)
        return default
    if not isinstance(v, str):
        raise bad(f"'{where}' must be a string", where)
    return v


def obj(body: dict, name: str, *, where: str | None = None) -> dict | None:
    v = body.get(name)
    if v is not None and not isinstance(v, dict):
        raise bad(f"'{where or name}' must be an object", where or name)
    return v


def model_name(body: dict) -> str:
    """`model` is required on the OpenAI and Anthropic routes (the reference says so)."""
    v = body.get("model")
    if not isinstance(v, str) or not v:
        raise bad("'model' is required and must be a non-empty string", "model")
    return v


def lora_name(body: dict) -> str:
    """`lora`: the name of an adapter loaded with POST /admin/lora/load (checked at submit)."""
    v = body.get("lora")
    if v is None:
        return ""
    if not isinstance(v, str) or not v or len(v) > 256:
        raise bad("'lora' must be the name of a loaded LoRA adapter (a non-empty string)", "lora")
    return v


TEMPLATE_FIELDS = ("chat_template", "template")  # refused on every dialect (below)


def refuse_request_template(body: dict) -> None:
    """A chat template sent in a request (vLLM's `chat_template`, llama.cpp's `template`) is
    Jinja run on the server: refused on every dialect. The template is the model's, or
    --chat-template, fixed at boot; `chat_template_kwargs` may still set its variables."""
    for name in ("chat_template", "template"):
        if body.get(name) is not None:
            raise bad(f"'{name}': request-supplied chat templates are refused; the server's template is "
                      "fixed at boot (--chat-template)", name, "unsupported_parameter")


def stop_list(body: dict, name: str = "stop") -> tuple[str, ...]:
    v = body.get(name)
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad(f"'{name}' must be a string or a list of strings", name)
    if len(v) > 16:
        raise bad(f"'{name}' takes at most 16 strings", name)
    return tuple(s for s in v if s)


def dry_breakers(body: dict, name: str = "dry_sequence_breakers") -> tuple[str, ...] | None:
    """llama.cpp's DRY sequence breakers: a non-empty list of non-empty strings (None: the default set).
    A breaker past 40 bytes is cut there, as llama.cpp cuts it (imp.sampling.dry.MAX_CHAR_LEN)."""
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not v or not all(isinstance(x, str) and x for x in v):
        raise bad(f"'{name}' must be a non-empty list of non-empty strings", name)
    if len(v) > 64 or any(len(x) > 256 for x in v):
        raise bad(f"'{name}' takes at most 64 strings of at most 256 characters", name)
    return tuple(v)


BANNED_MAX_BYTES = 256  # a phrase or pattern (imp.core.banned.WINDOW: how far back a match may start)


def _phrases(body: dict, name: str, most: int, what: str) -> tuple[str, ...]:
    """A string or a list of 1..`most` non-empty strings of at most BANNED_MAX_BYTES bytes each ([] = off)."""
    v = body.get(name)
    if v is None or v == []:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise bad(f"'{name}' must be a list of non-empty {what}", name)
    if len(v) > most or any(len(x.encode("utf-8", "surrogatepass")) > BANNED_MAX_BYTES for x in v):
        raise bad(f"'{name}' takes at most {most} {what} of at most {BANNED_MAX_BYTES} bytes each", name)
    return tuple(v)


def banned_strings(body: dict, name: str = "banned_strings") -> tuple[str, ...]:
    """TabbyAPI's banned strings: 1..64 non-empty strings of at most 256 UTF-8 bytes ([] = off)."""
    return _phrases(body, name, 64, "strings")


def banned_regex(body: dict, name: str = "banned_regex") -> tuple[str, ...]:
    """1..16 patterns of at most 256 bytes (Python `re` syntax); one that does not compile, or that
    matches the empty string (it would match everywhere), is a 400 naming it ([] = off)."""
    v = _phrases(body, name, 16, "regular expressions")
    for x in v:
        try:
            rx = re.compile(x)
        except (re.error, RecursionError, OverflowError) as exc:
            raise bad(f"'{name}': pattern {x!r} does not compile: {exc}", name) from None
        if rx.search("") is not None:
            raise bad(f"'{name}': pattern {x!r} matches the empty string (it would match everywhere)", name)
    return v


def logit_lens(body: dict, name: str = "logit_lens") -> int:
    """true = the top 5 per layer, 1..20 = the top N, false / 0 / absent = off."""
    v = body.get(name)
    if v is None or v is False or v == 0:
        return 0
    if v is True:
        return 5
    if isinstance(v, int) and 1 <= v <= 20:
        return v
    raise bad(f"'{name}' must be true, false or an integer 1..20 (the top N per layer)", name)


def session_id(body: dict) -> str:
    sid = string(body, "session_id", "")
    if len(sid) > 256 or any(not c.isprintable() for c in sid):
        raise bad("'session_id' must be at most 256 printable characters", "session_id")
    return sid


SESSION_HEADER = "X-Session-Id"


def session_header(body: dict, headers) -> None:
    """`X-Session-Id: S` means `"session_id": "S"`: a proxy cannot read a body, so the header is what
    it hashes to send a conversation back where its prefix is cached (deploy/haproxy.cfg). A body
    that sends its own session_id wins; the header then only steered the proxy. Checked as the
    field is (`session_id` below)."""
    sid = headers.get(SESSION_HEADER)
    if not sid or body.get("session_id") not in (None, ""):
        return
    if len(sid) > 256 or not sid.isprintable():
        raise bad(f"the {SESSION_HEADER} header must be at most 256 printable characters", SESSION_HEADER)
    body["session_id"] = sid


SPEC_CHAIN_CAP = 16  # {"speculative": {"mtp_k": N}}: N's bound when no MTP head is armed (the reference's)


def speculative(body: dict) -> tuple[bool | None, int]:
    """`speculative`: true / false switch every drafter (None: the server's --speculative); the object
    form {"mtp_k": N} addresses the trained MTP head alone (0..16 here: no head is armed, so N > 0 is
    declined at the finish) and leaves the matcher as the server runs it. -> (on, mtp_k; -1 = not asked)"""
    v = body.get("speculative")
    if v is None or isinstance(v, bool):
        return v, -1
    if not isinstance(v, dict):
        raise bad("'speculative' must be true, false or an object {\"mtp_k\": N}", "speculative")
    extra = [k for k in v if k != "mtp_k"]
    if extra:
        raise bad(f"'speculative.{extra[0]}' is not a field of speculative (it takes mtp_k)", f"speculative.{extra[0]}")
    k = num(v, "mtp_k", 0, SPEC_CHAIN_CAP, integer=True, where="speculative.mtp_k")
    return None, -1 if k is None else k


def logit_bias(body: dict, vocab_size: int) -> tuple[tuple[int, float], ...]:
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise bad("'logit_bias' must be an object of token id -> bias", "logit_bias")
    out = []
    for k, v in raw.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise bad(f"'logit_bias' key {k!r} is not a token id", "logit_bias") from None
        if not 0 <= tid < vocab_size:
            raise bad(f"'logit_bias' token id {tid} is outside the vocabulary (0..{vocab_size - 1})", "logit_bias")
        if not is_num(v) or not math.isfinite(v) or not -100 <= v <= 100:
            raise bad(f"'logit_bias' value for {k} must be a number in [-100, 100]", "logit_bias")
        out.append((tid, float(v)))
    return tuple(out)


# --------------------------------------------------------------------------- field tables
# A dialect lists the fields it takes as a table (name -> how it is read) and reads them in
# one pass: the table is its request schema, in one place, and each value is checked by the
# same readers as above (same ranges, same 400s naming the field).


class Field:
    def read(self, body: dict, name: str):
        raise NotImplementedError


class Num(Field):
    def __init__(self, lo=None, hi=None, *, integer=False, default=None, lo_open=False, hi_open=False):
        self.lo, self.hi, self.integer, self.default, self.lo_open, self.hi_open = \
            lo, hi, integer, default, lo_open, hi_open

    def read(self, body: dict, name: str):
        return num(body, name, self.lo, self.hi, integer=self.integer, default=self.default,
                   lo_open=self.lo_open, hi_open=self.hi_open)


class Bool(Field):
    def __init__(self, default: bool = False):
        self.default = default

    def read(self, body: dict, name: str):
        return boolean(body, name, self.default)


class Str(Field):
    def __init__(self, default: str | None = None, *, required: bool = False):
        self.default, self.required = default, required

    def read(self, body: dict, name: str):
        return string(body, name, self.default, required=self.required)


class Obj(Field):
    def read(self, body: dict, name: str):
        return obj(body, name)


class Read(Field):
    """A field with a reader of its own: fn(body) -> value (it names the field in its 400s)."""

    def __init__(self, fn):
        self.fn = fn

    def read(self, body: dict, name: str):
        return self.fn(body)


PRIORITY = Num(-(2**31), 2**31 - 1, integer=True, default=0)
# imp's own scheduling fields, the same on every dialect
SCHEDULING = {"priority": PRIORITY, "cache_prompt": Bool(), "session_id": Read(session_id), "lora": Read(lora_name)}


def read(body: dict, table: dict[str, Field]) -> dict:
    """Every field of the table, read and checked, in the table's order."""
    return {name: f.read(body, name) for name, f in table.items()}
