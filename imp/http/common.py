"""Probe and catalogue routes: /health, /ready, /v1/models, /metrics."""

from __future__ import annotations

import os
from pathlib import Path

from aiohttp import web

from imp.http.app import ENGINE
from imp.http.errors import ApiError


def _kv_fields(engine) -> dict:
    kv = engine.kv
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
    }


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    q = engine.metrics.queue
    body = {
        "status": "ok",
        "pid": os.getpid(),
        "model_loaded": True,
        "model": engine.model_name,
        "queue_depth": q.waiting + q.running,
        "queue_waiting": q.waiting,
        "queue_running": q.running,
        "preemptions": q.preemptions,
        "cancellations": q.cancellations,
        "timeouts": q.timeouts,
        "swaps": 0,  # a preempted request is recomputed, never swapped to host memory
        "queued_prompt_tokens": q.queued_prompt_tokens,
        "suspended": False,
        **_kv_fields(engine),
    }
    fault = engine.fault
    if fault:
        body.update(status="unhealthy", code="engine_faulted", error=fault)
        return web.json_response(body, status=503)
    if request.query.get("ready") in ("1", "true"):
        reason = None
        if q.waiting > 0:
            reason = "queue"
        elif q.running >= engine.cfg.max_batch_size:
            reason = "busy"
        if reason:
            body.update(ready=False, reason=reason)
            return web.json_response(body, status=503, headers={"Retry-After": "1"})
        body["ready"] = True
    return web.json_response(body)


async def ready(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine.fault:
        return web.json_response({"ready": False, "code": "engine_faulted", "error": engine.fault}, status=503)
    if engine.draining:
        return web.json_response({"ready": False, "code": "draining"}, status=503)
    return web.json_response({"ready": True, "model": engine.model_name})


def _model_entry(engine) -> dict:
    kv = engine.kv
    return {
        "id": engine.model_name,
        "object": "model",
        "created": int(engine.started_at),
        "owned_by": "imp",
        "loaded": True,
        "context_length": engine.max_context,
        "max_context_at_width_1": min(engine.max_context, kv.total * kv.block_size),
    }


def _directory(engine) -> list[dict]:
    """The other GGUFs of --models-dir (one level, split parts skipped), not loaded."""
    d = engine.cfg.models_dir
    if not d or not Path(d).is_dir():
        return []
    loaded = Path(getattr(engine, "model_path", "")).resolve() if getattr(engine, "model_path", None) else None
    out = []
    for p in sorted(Path(d).glob("*.gguf")) + sorted(Path(d).glob("*/*.gguf")):
        if p.resolve() == loaded or p.stem == engine.model_name:
            continue
        try:
            size = p.stat().st_size
        except OSError:
            continue
        out.append({"id": p.stem, "object": "model", "created": int(p.stat().st_mtime), "owned_by": "imp",
                    "loaded": False, "size_bytes": size})
    return out


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response({"object": "list", "data": [_model_entry(engine), *_directory(engine)]})


async def model(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    name = request.match_info["model"]
    if name == engine.model_name:
        return web.json_response(_model_entry(engine))
    for m in _directory(engine):
        if m["id"] == name:
            return web.json_response(m)
    raise ApiError(404, f"model '{name[:128]}' not found", code="model_not_found")


async def info(request: web.Request) -> web.Response:
    """TGI's /info shape."""
    engine = request.app[ENGINE]
    kv = engine.kv
    cfg = engine.cfg
    return web.json_response({
        "model_id": engine.model_name,
        "model_sha": engine.runner.fingerprint,
        "model_dtype": "gguf",
        "model_device_type": "cpu",
        "model_pipeline_tag": "text-generation",
        "max_concurrent_requests": cfg.max_batch_size,
        "max_best_of": 1,
        "max_stop_sequences": 16,
        "max_input_tokens": engine.max_context - 1,
        "max_input_length": engine.max_context - 1,
        "max_total_tokens": engine.max_context,
        "waiting_served_ratio": 0.0,
        "max_batch_total_tokens": kv.total * kv.block_size,
        "max_waiting_tokens": cfg.max_queued_tokens,
        "max_batch_size": cfg.max_batch_size,
        "max_client_batch_size": 1,
        "validation_workers": 1,
        "router": "imp",
        "version": "0.1.0",
        "sha": None,
        "docker_label": None,
    })


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(body=engine.metrics.exposition(), content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})
