"""Capacity and live metrics: GET /v1/capacity/plan, POST /v1/estimate, GET /v1/metrics.

A load balancer (or a harness fanning out subagents) reads these to decide how
many requests to send and when. Every figure comes from the engine port: the
`ModelCard` fixed at boot (pool size, KV bytes per token, slots) and a
`Snapshot` of what the actors publish (the scheduler's KvFigures and
QueueFigures, the metrics actor's step rates, ingress's live requests).
Nothing here asks a core anything.

The memory band is KV pressure, `max(used, reserved) / total` blocks: `used`
are blocks held by live sequences, `reserved` what the running requests were
admitted with (it already counts their used blocks, so the two are not
summed). green < 0.70 <= yellow < 0.85 <= orange < 0.95 <= red.
"""

from __future__ import annotations

import math
import os

import msgspec
from aiohttp import web

from imp.engine.port import ModelCard, Snapshot
from imp.http import keys
from imp.http.pipeline.served import NotResident, not_resident, served
from imp.http.dialects.chat.parse import parse as parse_chat
from imp.http.pipeline import fields as B
from imp.http.pipeline.estimate import blocks_for, estimate_for
from imp.http.errors import bad
from imp.messages import KvFigures, QueueFigures

BANDS = (("green", 0.70), ("yellow", 0.85), ("orange", 0.95))  # below the bound; else red
BAND_NAMES = ("green", "yellow", "orange", "red")
_MAX_WIDTH = 1 << 20
_MAX_DEPTH = 1 << 31


# --------------------------------------------------------------------------- pure helpers


def kv_pressure(kv: KvFigures) -> float:
    return max(kv.used, kv.reserved) / kv.total if kv.total else 1.0


def band_of(kv: KvFigures) -> str:
    p = kv_pressure(kv)
    return next((name for name, bound in BANDS if p < bound), "red")


def plan(width: int, depth: int, *, kv: KvFigures, queue: QueueFigures, max_context: int,
         decode_batch: int, model: str, replicas: int = 1) -> dict:
    """Can `width` streams of `depth` tokens fit the pool (ok), and start now (admit_now)?

    With data-parallel replicas (kv = their sum, decode_batch = all their slots) a
    stream lives in one replica's pool: the streams are spread evenly over them."""
    pool = kv.total // replicas  # one replica's blocks
    per_stream = pool // -(-width // replicas)  # blocks
    max_ctx_w = min(max_context, per_stream * kv.block_size)
    need = blocks_for(depth, kv.block_size)
    max_w = replicas * (pool // need) if depth <= max_context else 0
    ok = depth <= max_ctx_w
    band = band_of(kv)
    slots = max(0, decode_batch - queue.running)
    free = min(slots, 1) if band == "yellow" else slots
    if not ok:
        reason = f"depth {depth} exceeds max context {max_ctx_w} at width {width}"
    elif band in ("orange", "red"):
        reason = f"governor {band}"
    elif queue.waiting:
        reason = f"{queue.waiting} waiting for a slot"
    elif free < width:
        reason = f"{free} free slot(s) of {decode_batch}, need {width}"
    else:
        reason = "ok"
    return {
        "width": width, "depth": depth, "ok": ok,
        "max_context_at_width": max_ctx_w, "max_width_at_depth": max_w,
        "model": model, "band": band, "decode_batch": decode_batch,
        "in_flight": queue.running, "waiting": queue.waiting, "slots": slots,
        "admit_now": reason == "ok", "reason": reason,
    }


def _int_param(request: web.Request, name: str, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        raise bad(f"query parameter '{name}' is required", name)
    try:
        v = int(raw)
    except ValueError:
        raise bad(f"'{name}' must be an integer, got {raw[:32]!r}", name) from None
    if not 1 <= v <= hi:
        raise bad(f"'{name}' must be in 1..{hi}, got {v}", name)
    return v


# --------------------------------------------------------------------------- snapshot

# the fields of each section: a section whose probe fails answers them all as null
SECTIONS = {
    "status": ("model", "suspended", "draining", "fault", "uptime_s"),
    "concurrency": ("decode_batch", "queue_cap", "queued_tokens_cap", "in_flight", "waiting"),
    "queue": ("waiting", "cap", "queued_prompt_tokens", "eta_s", "retry_after_s", "rejections",
              "last_reject_reason", "preemptions", "cancellations", "timeouts"),
    "governor": ("band", "enabled", "kv_pressure", "thresholds"),
    "memory": ("rss_bytes", "headroom_bytes", "kv_pool_bytes", "kv_used_bytes", "kv_cached_bytes",
               "kv_free_bytes", "kv_bytes_per_token"),
    "rates": ("decode_tok_s", "decode_streams", "prefill_tok_s_recent", "decode_tok_s_recent",
              "decode_tok_s_lifetime", "prefill_tok_s_lifetime", "decode_tokens_total", "prefill_tokens_total"),
    "capacity": ("block_size", "kv_blocks_total", "kv_capacity_tokens", "max_context", "max_ctx_at_width"),
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def _widths(decode_batch: int) -> list[int]:
    w, out = 1, []
    while w < decode_batch:
        out.append(w)
        w *= 2
    return out + [decode_batch]


def snapshot(card: ModelCard, snap: Snapshot) -> dict:
    """GET /v1/metrics' body from the card and one snapshot; a section whose
    probe fails answers its fields as null, the rest still answers."""
    kv, q = snap.kv, snap.queue
    reps = card.replicas  # data-parallel replicas: a stream lives in one of their pools
    slots_total = card.max_batch_size * reps

    def status():
        return {"model": card.name, "suspended": snap.suspended, "draining": snap.draining,
                "fault": snap.fault, "uptime_s": round(snap.uptime_s, 1)}

    def concurrency():
        return {"decode_batch": slots_total, "queue_cap": None,  # imp caps tokens, not requests
                "queued_tokens_cap": card.max_queued_tokens or None, "in_flight": q.running, "waiting": q.waiting}

    def queue():
        rate = snap.rates.prefill_tok_s_recent
        eta = 0.0 if not q.waiting else (round(q.queued_prompt_tokens / rate, 3) if rate else None)
        return {"waiting": q.waiting, "cap": None, "queued_prompt_tokens": q.queued_prompt_tokens, "eta_s": eta,
                "retry_after_s": card.retry_after_s, "rejections": snap.rejections,
                "last_reject_reason": snap.last_reject_reason, "preemptions": q.preemptions,
                "cancellations": q.cancellations, "timeouts": q.timeouts}

    def governor():
        # it reports a band; /health?ready=1 and the plan route act on it, nothing evicts
        return {"band": band_of(kv), "enabled": True, "kv_pressure": round(kv_pressure(kv), 4),
                "thresholds": {name: bound for name, bound in BANDS}}

    def memory():
        bpt = card.kv_bytes_per_token
        per_block = kv.block_size * bpt
        return {"rss_bytes": _rss_bytes(), "headroom_bytes": _mem_available(),
                "kv_pool_bytes": kv.total * per_block, "kv_used_bytes": kv.used * per_block,
                "kv_cached_bytes": kv.cached * per_block, "kv_free_bytes": kv.free * per_block,
                "kv_bytes_per_token": bpt}

    def capacity():
        return {"block_size": kv.block_size, "kv_blocks_total": kv.total,
                "kv_capacity_tokens": kv.total * kv.block_size, "max_context": card.context_length,
                "max_ctx_at_width": {str(w): plan(w, 1, kv=kv, queue=q, max_context=card.context_length,
                                                  decode_batch=slots_total, model="", replicas=reps)["max_context_at_width"]
                                     for w in _widths(slots_total)}}

    builders = {"status": status, "concurrency": concurrency, "queue": queue, "governor": governor,
                "memory": memory, "rates": lambda: msgspec.to_builtins(snap.rates), "capacity": capacity}
    out: dict = {}
    for name, build in builders.items():
        try:
            out[name] = build()
        except Exception:  # noqa: BLE001 - a failed probe nulls its section, the rest still answers
            out[name] = dict.fromkeys(SECTIONS[name])
    out["requests"] = [msgspec.to_builtins(r) for r in snap.live]
    out["resident_models"] = [{"model": card.name, "kind": "chat", "in_flight": q.running, "waiting": q.waiting}]
    return {"server": out}


def _label(v) -> str:
    return str(v).replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def prometheus(snap: dict) -> str:
    """The snapshot as Prometheus text: one gauge per numeric field, imp_<section>_<field>."""
    s = snap["server"]
    model = (s.get("status") or {}).get("model") or ""
    lines: list[str] = []

    def gauge(name: str, samples: list[tuple[dict, float]], help_: str) -> None:
        samples = [(lab, v) for lab, v in samples if v is not None]
        if not samples:
            return
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} gauge")
        for lab, v in samples:
            ls = ",".join(f'{k}="{_label(x)}"' for k, x in lab.items())
            lines.append(f"{name}{{{ls}}} {float(v)!r}" if ls else f"{name} {float(v)!r}")

    for section in ("status", "concurrency", "queue", "governor", "memory", "rates", "capacity"):
        for key, v in (s.get(section) or {}).items():
            if isinstance(v, bool) or (isinstance(v, (int, float)) and math.isfinite(v)):
                gauge(f"imp_{section}_{key}", [({"model": model}, v)], f"{section}.{key} of GET /v1/metrics")
    band = (s.get("governor") or {}).get("band")
    if band:
        gauge("imp_governor_band", [({"model": model, "band": b}, int(b == band)) for b in BAND_NAMES],
              "1 for the current KV pressure band")
    widths = (s.get("capacity") or {}).get("max_ctx_at_width") or {}
    gauge("imp_capacity_max_ctx", [({"model": model, "width": w}, v) for w, v in widths.items()],
          "tokens per stream that fit the KV pool at this many streams")
    if s.get("requests") is not None:
        gauge("imp_requests_count", [({}, len(s["requests"]))], "live generation requests")
    gauge("imp_resident_models_in_flight", [({"model": r["model"], "kind": r["kind"]}, r["in_flight"])
                                            for r in s.get("resident_models") or []],
          "streams generating now, per resident model")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- handlers


async def capacity_plan(request: web.Request) -> web.Response:
    if request.query.get("model") and request.app.get(keys.FLEET) is not None:  # that model's pool
        async with served(request, request.query["model"]) as model:
            return await _plan(request, model.port)
    return await _plan(request, request.app[keys.PORT])


async def _plan(request: web.Request, port) -> web.Response:
    width = _int_param(request, "width", _MAX_WIDTH)
    depth = _int_param(request, "depth", _MAX_DEPTH)
    card, snap = port.card, await port.snapshot()
    return web.json_response(plan(width, depth, kv=snap.kv, queue=snap.queue, max_context=card.context_length,
                                  decode_batch=card.max_batch_size * card.replicas, model=card.name,
                                  replicas=card.replicas))


async def estimate_route(request: web.Request) -> web.Response:
    """POST /v1/estimate: a chat-completions body, parsed as the chat route parses it, rendered,
    never run (the same answer as "dry_run": true on a generation route)."""
    body = await B.read_json(request)
    B.boolean(body, "dry_run")  # a non-boolean is a 400 here as well
    try:  # an estimate never loads a model (capacity reference)
        async with served(request, body.get("model"), load=False) as model:
            return web.json_response(await estimate_for(request, parse_chat(body, model.text.tokenizer.vocab_size),
                                                        model.port, model.text))
    except NotResident as nr:
        return web.json_response(await not_resident(request, nr.name))


async def metrics_json(request: web.Request) -> web.Response:
    port = request.app[keys.PORT]
    fmt = request.query.get("format", "json")
    if fmt not in ("json", "prometheus"):
        raise bad(f"'format' must be json or prometheus, got {fmt[:32]!r}", "format")
    snap = snapshot(port.card, await port.snapshot(with_live=True))
    fleet = request.app.get(keys.FLEET)
    if fleet is not None:  # models on demand: a row per resident model (the sections above are the boot model's)
        snap["server"]["resident_models"] = await fleet.resident()
    if fmt == "prometheus":
        return web.Response(text=prometheus(snap), content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})
    return web.json_response(snap)
