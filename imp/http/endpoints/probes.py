"""Probe, catalogue and admin routes: /health, /ready, /v1/models, /metrics, /admin/suspend|resume."""

from __future__ import annotations

import os
from pathlib import Path

from aiohttp import web

from imp.http import keys
from imp.http.endpoints import readiness
from imp.http.endpoints.capacity import band_of
from imp.http.errors import ApiError, bad


def _kv_fields(kv) -> dict:
    return {
        "kv_blocks_total": kv.total,
        "kv_blocks_free": kv.free,
        "kv_blocks_used": kv.used,
        "kv_blocks_reserved": kv.reserved,
        "kv_blocks_cached": kv.cached,
        "kv_blocks_pinned": kv.pinned,
        "kv_evictions": kv.evictions,
        "kv_block_size": kv.block_size,
        "kv_capacity_tokens": kv.total * kv.block_size,
        "kv_ceiling_blocks": kv.total,
        "kv_pool_growable": False,
        "kv_pool_bandwidth_gbps": 0.0,
        "kv_tier_blocks": kv.tier_blocks,  # the disk tier (--prompt-cache-dir): blocks held, and running totals
        "kv_tier_saves": kv.tier_saves,
        "kv_tier_hits": kv.tier_hits,
        "kv_tier_misses": kv.tier_misses,
        "kv_swap_blocks": kv.swap_blocks,  # the swap area (--swap-space): its slots, those parked requests hold
        "kv_swap_blocks_used": kv.swap_used,
    }


async def health(request: web.Request) -> web.Response:
    port = request.app[keys.PORT]
    card, snap = port.card, await port.snapshot()
    q = snap.queue
    body = {
        "status": "ok",
        "pid": os.getpid(),
        "model_loaded": True,
        "model": card.name,
        "queue_depth": q.waiting + q.running,
        "queue_waiting": q.waiting,
        "queue_running": q.running,
        "preemptions": q.preemptions,
        "cancellations": q.cancellations,
        "timeouts": q.timeouts,
        "swaps": snap.kv.swaps_out,  # preemptions whose KV went to the swap area instead of being recomputed
        "queued_prompt_tokens": q.queued_prompt_tokens,
        "suspended": snap.suspended,
        "idle_unload_seconds": request.app[keys.CONFIG].idle_unload_s,
        "idle_suspended": snap.idle_suspended,
        "weights_loaded": snap.weights_loaded,
        **_kv_fields(snap.kv),
    }
    fleet = request.app.get(keys.FLEET)
    if fleet is not None:  # models on demand: the figures above are the boot model's; each resident one's here
        st = await fleet.status()
        body["swapping"], body["models_loaded"] = st["swapping"], st["loaded"]
        body["models"] = {}
        for p in fleet.ports():
            s = await p.snapshot()
            body["models"][p.card.name] = {
                "queue_waiting": s.queue.waiting, "queue_running": s.queue.running,
                "kv_blocks_total": s.kv.total, "kv_blocks_used": s.kv.used, "kv_blocks_reserved": s.kv.reserved,
                "kv_block_size": s.kv.block_size, "fault": s.fault}
    if snap.fault:
        body.update(status="unhealthy", code="engine_faulted", error=snap.fault)
        return web.json_response(body, status=503)
    if request.query.get("ready") in ("1", "true"):
        # 503 with a one-word reason while a new request would not start at once (imp.http.endpoints.readiness)
        reason = readiness.busy(snap, card)
        body["band"] = band_of(snap.kv)
        if reason:
            body.update(ready=False, reason=reason)
            return web.json_response(body, status=503, headers={"Retry-After": "1"})
        body["ready"] = True
    return web.json_response(body)


async def ready(request: web.Request) -> web.Response:
    """200 only when an inference request would be taken now; else 503 with a stable code.

    imp loads its boot model before it listens, so `no_model` answers only for an engine port without a
    card; `swapping` while models on demand (--models-dir) load or swap one.
    """
    port = request.app[keys.PORT]
    fleet = request.app.get(keys.FLEET)

    def no(code: str, **extra) -> web.Response:
        return web.json_response({"ready": False, "code": code, **extra}, status=503)

    if getattr(port, "card", None) is None:
        return no("no_model")
    snap = await port.snapshot()
    code = readiness.not_ready(snap)  # a state, never load: a balancer's check must not flap
    if code == "engine_faulted":
        return no(code, error=snap.fault)
    if code == "suspended":
        return no(code, hint="POST /admin/resume")
    if code:
        return no(code)
    swapping = (await fleet.status())["swapping"] if fleet is not None else None
    if swapping:
        return no("swapping", model=swapping)
    # an idle suspend stays ready: the next request reloads the model inside itself
    return web.json_response({"ready": True, "model": port.card.name, "suspended": False,
                              "idle_suspended": snap.idle_suspended})


async def suspend(request: web.Request) -> web.Response:
    """POST /admin/suspend[?drain_s=N]: stop admitting, then wait (up to N s,
    default 30) for the admitted requests to finish; they are never cancelled.
    Sticky until POST /admin/resume. Drained, the weights and the KV pool are released
    (kv_released: true, with the bytes measured before and after); a drain that timed
    out keeps them (kv_released: false, error says why)."""
    raw = request.query.get("drain_s", "30")
    try:
        drain_s = float(raw)
    except ValueError:
        raise bad(f"'drain_s' must be a number of seconds, got {raw[:32]!r}", "drain_s") from None
    if not 0 <= drain_s <= 600:
        raise bad(f"'drain_s' must be in 0..600, got {drain_s}", "drain_s")
    # models on demand: every resident model is released, and none loads until /admin/resume (imp.engine.fleet)
    res = await (request.app.get(keys.FLEET) or request.app[keys.PORT]).suspend(drain_s)
    body = {"suspended": res.suspended, "drained": res.drained, "in_flight": res.in_flight,
            "kv_released": res.kv_released, "weights_released": res.kv_released,
            "memory": {"rss_before": res.rss_before, "rss_after": res.rss_after}}
    if res.models_released:
        body["models_released"] = list(res.models_released)
    if res.device_free_before or res.device_free_after:
        body["memory"].update(device_free_before=res.device_free_before, device_free_after=res.device_free_after)
    if res.error:
        body["error"] = res.error
    return web.json_response(body)


async def resume(request: web.Request) -> web.Response:
    """POST /admin/resume: admit again; released weights and KV pool are loaded first."""
    res = await (request.app.get(keys.FLEET) or request.app[keys.PORT]).resume()
    return web.json_response({"suspended": res.suspended, "reloaded": res.reloaded, "seconds": round(res.seconds, 3)})


def _model_entry(card) -> dict:
    # a stream lives in one replica's pool
    return {
        "id": card.name,
        "object": "model",
        "created": card.created,
        "owned_by": "imp",
        "loaded": True,
        "context_length": card.context_length,
        "max_context_at_width_1": min(card.context_length, card.kv_blocks * card.block_size),
    }


def _embedding(request: web.Request, card) -> list[dict]:
    """The --embedding-model, when one is loaded (what /v1/embeddings and /v1/rerank serve)."""
    e = request.app.get(keys.EMBEDDER)
    if e is None:
        return []
    return [{"id": e.name, "object": "model", "created": card.created, "owned_by": "imp", "loaded": True,
             "task": "embedding", "dimensions": e.hidden, "context_length": e.max_tokens}]


def _directory(card, models_dir: str | None) -> list[dict]:
    """The other models of --models-dir, not loaded: GGUF files (one level down too)
    and HF directories (config.json + *.safetensors)."""
    d = models_dir
    if not d or not Path(d).is_dir():
        return []
    loaded = Path(card.path).resolve() if card.path else None
    out = []
    hf_dirs = [c.parent for c in sorted(Path(d).glob("*/config.json")) if any(c.parent.glob("*.safetensors"))]
    for p in sorted(Path(d).glob("*.gguf")) + sorted(Path(d).glob("*/*.gguf")) + hf_dirs:
        name = p.name if p.is_dir() else p.stem
        if p.resolve() == loaded or name == card.name:
            continue
        try:
            size = sum(f.stat().st_size for f in p.glob("*.safetensors")) if p.is_dir() else p.stat().st_size
        except OSError:
            continue
        out.append({"id": name, "object": "model", "created": int(p.stat().st_mtime), "owned_by": "imp",
                    "loaded": False, "size_bytes": size})
    return out


def _adapters(port, card) -> list[dict]:
    """Loaded LoRA adapters, listed as vLLM lists them: a model whose parent is the base (a
    request may name one as its `model`, or in `lora`)."""
    return [{"id": a.name, "object": "model", "created": card.created, "owned_by": "imp", "parent": card.name,
             "root": a.path, "lora_id": a.id} for a in port.loras()]


async def models(request: web.Request) -> web.Response:
    port = request.app[keys.PORT]
    card = port.card
    fleet = request.app.get(keys.FLEET)
    if fleet is not None:  # models on demand: every model of the catalog, resident or not
        return web.json_response({"object": "list", "data": [*await fleet.rows(), *_embedding(request, card)]})
    return web.json_response({"object": "list", "data": [_model_entry(card), *_adapters(port, card),
                                                         *_embedding(request, card),
                                                         *_directory(card, request.app[keys.CONFIG].models_dir)]})


async def model(request: web.Request) -> web.Response:
    card = request.app[keys.PORT].card
    name = request.match_info["model"]
    fleet = request.app.get(keys.FLEET)
    if fleet is not None:
        for m in [*await fleet.rows(), *_embedding(request, card)]:
            if m["id"] == name or name in m.get("aliases", ()):
                return web.json_response(m)
        raise ApiError(404, f"model '{name[:128]}' not found", code="model_not_found")
    if name == card.name:
        return web.json_response(_model_entry(card))
    for m in [*_adapters(request.app[keys.PORT], card), *_embedding(request, card),
              *_directory(card, request.app[keys.CONFIG].models_dir)]:
        if m["id"] == name:
            return web.json_response(m)
    raise ApiError(404, f"model '{name[:128]}' not found", code="model_not_found")


async def info(request: web.Request) -> web.Response:
    """TGI's /info shape."""
    card, cfg = request.app[keys.PORT].card, request.app[keys.CONFIG]
    slots = card.max_batch_size * card.replicas
    return web.json_response({
        "model_id": card.name,
        "model_sha": card.fingerprint,
        "model_dtype": "gguf",
        "model_device_type": card.device,
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": slots,
        "max_best_of": 1,
        "max_stop_sequences": 16,
        "max_input_tokens": card.context_length - 1,
        "max_input_length": card.context_length - 1,
        "max_total_tokens": card.context_length,
        "waiting_served_ratio": 0.0,
        "max_batch_total_tokens": card.kv_blocks * card.replicas * card.block_size,
        "max_waiting_tokens": cfg.max_queued_tokens,
        "max_batch_size": slots,
        "max_client_batch_size": 1,
        "validation_workers": 1,
        "router": "imp",
        "version": "0.1.0",
        "sha": None,
        "docker_label": None,
    })


async def metrics(request: web.Request) -> web.Response:
    fleet = request.app.get(keys.FLEET)  # models on demand: every model's, labelled model="..."
    body = await (fleet.metrics_text() if fleet is not None else request.app[keys.PORT].metrics_text())
    return web.Response(body=body, content_type="text/plain", charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})
