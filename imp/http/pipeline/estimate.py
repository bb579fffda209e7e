"""Whether one request fits, without running it: POST /v1/estimate and "dry_run": true.

A generation route's body with `"dry_run": true` is parsed and rendered by the pipeline as
usual and answered with this estimate instead of being run (`imp.http.pipeline.run`);
`/v1/estimate` takes a chat-completions body. The figures come from the engine port's
`ModelCard` and a `Snapshot`; nothing here asks a core anything.
"""

from __future__ import annotations

from aiohttp import web

from imp.http import keys
from imp.http.pipeline import resolve
from imp.http.pipeline.request import GenerateRequest
from imp.engine.port import Warm
from imp.messages import KvFigures


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def estimate(prompt_tokens: int, *, max_tokens: int | None, n: int, kv: KvFigures, bytes_per_token: int | None,
             max_context: int, prefill_tok_s: float | None, queued_prompt_tokens: int, model: str,
             replica_kv: list[KvFigures] | None = None, warm: Warm | None = None) -> dict:
    """Whether one request fits, without running it. KV only: imp's prefill
    scratch is transient and not counted. With data-parallel replicas
    (replica_kv) it must fit one replica's pool: the emptiest, for fits_now. warm: what the prefix cache
    holds of the prompt (EnginePort.warm): it is not computed again, so it leaves the TTFT estimate."""
    tier, on_disk = (warm.tier, warm.on_disk) if warm is not None else ("miss", 0)
    warm = min(warm.tokens, prompt_tokens) if warm is not None else 0
    tokens = prompt_tokens + n * (max_tokens or 0)
    need_blocks = blocks_for(tokens, kv.block_size)
    pools = replica_kv or [kv]
    free_now = max(r.total - max(r.used, r.reserved) for r in pools)
    pool_total = max(r.total for r in pools)
    todo = queued_prompt_tokens + prompt_tokens - warm
    return {
        "model": model,
        "prompt_tokens": prompt_tokens,
        "warm_tokens": warm,
        "cache_tier": tier,
        "warm_tokens_on_disk": on_disk,  # of warm_tokens, those the disk tier holds (read back, not computed)
        "max_tokens": max_tokens,
        "need_blocks": need_blocks,
        "need_bytes": need_blocks * kv.block_size * bytes_per_token if bytes_per_token else None,
        "fits_now": need_blocks <= free_now,
        "fits_drained": need_blocks <= pool_total,
        "context_ok": prompt_tokens + 1 <= max_context,
        "context_limit": max_context,
        "est_ttft_s": round(todo / prefill_tok_s, 3) if prefill_tok_s else None,
        "resident": True,
    }


async def estimate_for(request: web.Request, req: GenerateRequest, port=None, tm=None) -> dict:
    """A parsed request -> the estimate: rendered and tokenized as the run would be, never run. port, tm: the
    model's (imp.http.pipeline.served), else the boot model's."""
    port, tm = port or request.app[keys.PORT], tm or request.app[keys.TEXT]
    card = port.card
    prompt = await resolve.render_off_loop(req, tm, card)
    snap = await port.snapshot()
    warm = await port.warm(tuple(prompt.ids), "")  # the base model's cache (an adapter's is salted apart)
    return estimate(len(prompt.ids), max_tokens=req.max_tokens, n=req.n, kv=snap.kv, warm=warm,
                    bytes_per_token=card.kv_bytes_per_token, max_context=card.context_length,
                    prefill_tok_s=snap.rates.prefill_tok_s_recent, queued_prompt_tokens=snap.queue.queued_prompt_tokens,
                    model=card.name, replica_kv=list(snap.replica_kv) if card.replicas > 1 else None)
