"""Probe, catalogue and admin routes: /health, /ready, /v1/models, /metrics, /admin/suspend|resume."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from aiohttp import web

from imp.http.app import ENGINE
from imp.http.capacity import band_of
from imp.http.errors import ApiError, bad


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
        "suspended": engine.ingress.suspended,
        **_kv_fields(engine),
    }
    fault = engine.fault
    if fault:
        body.update(status="unhealthy", code="engine_faulted", error=fault)
        return web.json_response(body, status=503)
    if request.query.get("ready") in ("1", "true"):
        # 503 with a one-word reason while a new request would not start at once
        band = band_of(engine.kv)
        reason = None
        if engine.ingress.suspended:
            reason = "suspended"
        elif engine.draining:
            reason = "draining"
        elif band in ("orange", "red"):
            reason = "pressure"
        elif q.waiting > 0:
            reason = "queue"
        elif q.running >= engine.cfg.max_batch_size * len(engine.runners):
            reason = "busy"
        body["band"] = band
        if reason:
            body.update(ready=False, reason=reason)
            return web.json_response(body, status=503, headers={"Retry-After": "1"})
        body["ready"] = True
    return web.json_response(body)


async def ready(request: web.Request) -> web.Response:
    """200 only when an inference request would be taken now; else 503 with a stable code.

    imp loads its model before it listens and never swaps it, so `no_model`
    answers only for an engine without a runner and `swapping` never does.
    """
    engine = request.app[ENGINE]

    def no(code: str, **extra) -> web.Response:
        return web.json_response({"ready": False, "code": code, **extra}, status=503)

    if getattr(engine, "runner", None) is None:
        return no("no_model")
    if engine.fault:
        return no("engine_faulted", error=engine.fault)
    if engine.ingress.suspended:
        return no("suspended", hint="POST /admin/resume")
    if engine.draining:
        return no("draining")
    return web.json_response({"ready": True, "model": engine.model_name, "suspended": False,
                              "idle_suspended": False})


def _in_flight(engine) -> int:
    q = engine.metrics.queue
    return max(sum(not h.done for h in engine.ingress.handles.values()), q.waiting + q.running)


async def suspend(request: web.Request) -> web.Response:
    """POST /admin/suspend[?drain_s=N]: stop admitting, then wait (up to N s,
    default 30) for the admitted requests to finish; they are never cancelled.
    Sticky until POST /admin/resume. The CPU build keeps its weights and KV pool
    mapped (kv_released: false)."""
    engine = request.app[ENGINE]
    raw = request.query.get("drain_s", "30")
    try:
        drain_s = float(raw)
    except ValueError:
        raise bad(f"'drain_s' must be a number of seconds, got {raw[:32]!r}", "drain_s") from None
    if not 0 <= drain_s <= 600:
        raise bad(f"'drain_s' must be in 0..600, got {drain_s}", "drain_s")
    engine.ingress.suspend()  # FIFO: every Submit sent after this is refused by admission
    deadline = time.monotonic() + drain_s
    while _in_flight(engine) and time.monotonic() < deadline and not engine.fault:
        await asyncio.sleep(0.05)
    left = _in_flight(engine)
    return web.json_response({"suspended": True, "drained": left == 0, "in_flight": left,
                              "kv_released": False})


async def resume(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    engine.ingress.resume()
    return web.json_response({"suspended": False})


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
    """The other models of --models-dir, not loaded: GGUF files (one level down too)
    and HF directories (config.json + *.safetensors)."""
    d = engine.cfg.models_dir
    if not d or not Path(d).is_dir():
        return []
    loaded = Path(getattr(engine, "model_path", "")).resolve() if getattr(engine, "model_path", None) else None
    out = []
    hf_dirs = [c.parent for c in sorted(Path(d).glob("*/config.json")) if any(c.parent.glob("*.safetensors"))]
    for p in sorted(Path(d).glob("*.gguf")) + sorted(Path(d).glob("*/*.gguf")) + hf_dirs:
        name = p.name if p.is_dir() else p.stem
        if p.resolve() == loaded or name == engine.model_name:
            continue
        try:
            size = sum(f.stat().st_size for f in p.glob("*.safetensors")) if p.is_dir() else p.stat().st_size
        except OSError:
            continue
        out.append({"id": name, "object": "model", "created": int(p.stat().st_mtime), "owned_by": "imp",
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
