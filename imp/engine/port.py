"""The engine port: the one narrow interface HTTP talks to the engine through.

Everything that crosses it is a msgspec Struct (or a message of the
catalogue), so the same port can be served in-process (`imp.engine.local`)
or from another process over a longer queue: token ids and typed values go
in, Deltas come out. HTTP never reaches past it into actors, cores or the
model; what it needs to know about the model is the `ModelCard` (fixed at
boot) and a `Snapshot` of the figures the actors publish.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol, Union

import msgspec

from imp.messages import Delta, Fault, KvFigures, QueueFigures, Reject, RequestStats, SamplingParams


class _Value(msgspec.Struct, frozen=True, kw_only=True):
    """A plain value crossing the port (every field encoded: JSON answers read them all)."""


class Submission(_Value):
    """One generation request, tokenized and resolved (text never crosses)."""

    req_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    n: int = 1
    priority: int = 0
    stop: tuple[str, ...] = ()
    salt: str = ""  # prefix-cache key of an adapter (LoRA) or a prompt-scoring request
    cache_prompt: bool = False
    session_id: str = ""
    cfg_prompt: tuple[int, ...] = ()  # classifier-free guidance: the shadow sequence's prompt
    pin_tokens: int = 0  # Anthropic cache_control: keep the first N prompt tokens' blocks warm after it (0: none)


class ModelCard(_Value):
    """What the engine serves, fixed at boot."""

    name: str
    path: str  # the model file or directory it was loaded from
    fingerprint: str
    context_length: int
    vocab_size: int
    block_size: int
    kv_blocks: int  # per replica
    kv_bytes_per_token: int | None
    replicas: int
    max_batch_size: int  # per replica
    max_queued_tokens: int
    retry_after_s: float  # what a 429 tells the client to wait
    device: str  # "cpu" | "cuda"
    created: int  # unix seconds the engine came up
    speculative: bool = False  # a request that does not say speculates (--speculative on, and the executor verifies)
    spec_draft_max: int = 0  # 0: this engine never speculates (the executor cannot verify drafts, or --spec-draft-max 0)
    logit_lens: bool = False  # every executor keeps each layer's residual (the fused CPU forward)


class Rates(_Value):
    decode_tok_s: float = 0.0
    decode_streams: int = 0
    prefill_tok_s_recent: float | None = None
    decode_tok_s_recent: float | None = None
    decode_tok_s_lifetime: float | None = None
    prefill_tok_s_lifetime: float | None = None
    decode_tokens_total: int = 0
    prefill_tokens_total: int = 0


class SpecRow(_Value):
    """A live request's drafter (imp.core.spec) so far: verify rounds, draft tokens fed and kept."""

    rounds: int
    drafted: int
    accepted: int
    accept_rate: float | None  # accepted / drafted; None before the first draft


class Warm(_Value):
    """How much of a prompt the prefix cache holds now: its tokens in the pool or on the disk tier (a read,
    not a compute), on_disk of them on the tier; tier "exact" (every block an alloc could take), "block" (a
    prefix of them) or "miss" (the capacity reference's names)."""

    tokens: int
    tier: str
    on_disk: int = 0


class CacheRow(_Value):
    """A live request's cache as it found it on arrival (/v1/metrics)."""

    tier: str
    warm_tokens: int


class LiveRow(_Value):
    """One live request as /v1/metrics lists it."""

    id: str
    state: str  # queued | prefill | decode
    prompt_tokens: int
    generated: int
    max_tokens: int
    n: int
    elapsed_s: float
    ttft_s: float | None = None
    decode_tok_s: float | None = None
    speculative: SpecRow | None = None  # None: no drafter runs for it (the reference's `speculative: null`)
    cache: CacheRow | None = None


class Snapshot(_Value):
    """The engine's published figures at one moment."""

    kv: KvFigures  # summed over replicas
    replica_kv: tuple[KvFigures, ...]  # one per replica
    queue: QueueFigures
    rates: Rates
    suspended: bool
    draining: bool
    fault: str | None
    rejections: int
    last_reject_reason: str | None
    in_flight: int  # requests admitted and not finished
    uptime_s: float
    live: tuple[LiveRow, ...] = ()
    idle_suspended: bool = False  # --idle-unload-seconds released the model; the next request reloads it
    weights_loaded: bool = True  # False while suspended (operator or idle) with the model released


class SuspendResult(_Value):
    suspended: bool
    drained: bool
    in_flight: int
    kv_released: bool  # the weights and the KV pool were released (every replica)
    rss_before: int = 0  # bytes, summed over replicas (CPU: the process; GPU: the card's free)
    rss_after: int = 0
    device_free_before: int = 0
    device_free_after: int = 0
    error: str = ""  # why the memory was not released (drain timed out, a runner that cannot unload)
    models_released: tuple[str, ...] = ()  # models on demand: the other resident models, drained and released


class ResumeResult(_Value):
    suspended: bool
    reloaded: bool  # the weights and KV pool were loaded again by this call
    seconds: float = 0.0


# what a request's stream yields: its Deltas, or why it stopped early
StreamItem = Union[Delta, Reject, Fault]


class LoraInfo(_Value):
    """A loaded LoRA adapter. Ids are never reused; they survive suspend and resume."""

    id: int
    name: str
    path: str
    nbytes: int = 0


class LoraRefused(Exception):
    """Why a LoRA load or unload was refused: HTTP answers `status` with `code`."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class ModelRefused(Exception):
    """Why a model cannot be had (models on demand, imp.engine.fleet): HTTP answers `status` with `code` in the
    route's dialect; retry_after (seconds) for a 503 worth retrying."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


class RequestStream(Protocol):
    """A submitted request's output. Iterate for its items; `aclose()` before the
    end cancels the request upstream (its KV is freed within a step)."""

    def __aiter__(self) -> AsyncIterator[StreamItem]: ...

    async def aclose(self) -> None: ...


class EnginePort(Protocol):
    card: ModelCard

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    @property
    def fault(self) -> str | None: ...

    async def snapshot(self, with_live: bool = False) -> Snapshot: ...

    async def warm(self, prompt: tuple[int, ...], salt: str = "") -> Warm: ...

    async def metrics_text(self) -> bytes: ...

    def submit(self, sub: Submission) -> RequestStream: ...

    def end_thinking(self, req_id: str, token_ids: tuple[int, ...]) -> bool: ...

    def close_session(self, session_id: str) -> None: ...

    def serve_peers(self, handler) -> None:
        """handler: async (action, some_id) -> (status, body), or None when the request is not
        running in this process; what other API-server processes' `ask_peers` reach."""

    async def ask_peers(self, action: str, some_id: str):
        """A control call (e.g. "end_thinking") for a request this process does not hold, asked
        of the other API servers: their (status, body), or None when none runs it."""

    async def suspend(self, drain_s: float) -> SuspendResult: ...

    async def resume(self) -> ResumeResult: ...

    async def drain(self, timeout_s: float) -> int: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def lora_load(self, path: str, name: str | None) -> LoraInfo:
        """Load an adapter (path relative to --lora-dir, or inside it); LoraRefused."""

    async def lora_unload(self, lora_id: int | None, name: str | None) -> LoraInfo:
        """Drop an adapter once no request uses it; LoraRefused."""

    def loras(self) -> tuple[LoraInfo, ...]: ...

    def lora_named(self, name: str) -> int | None: ...

    def report(self, stats: RequestStats) -> None: ...

    @property
    def store(self):
        """The Responses store's client (async put / get / chain / delete / input_items, each
        answering a StoreReply), or None when the server runs without a store."""


class Models(Protocol):
    """Models on demand (--models-dir): what HTTP asks of the fleet, in this process (imp.engine.fleet) or in
    the engine process (imp.engine.remote_fleet). Every refusal is a ModelRefused."""

    default: str  # the boot model's name: a request without `model` gets it

    def serve(self, name: str, timeout_s: float = 0.0, load: bool = True):
        """async context manager -> (EnginePort, TextModel, GrammarCache) of the model name names, loaded first
        if need be (load=False: ModelRefused 409 model_not_loaded instead), kept resident until the block ends."""

    async def rows(self) -> list[dict]: ...  # /v1/models: every model, then the resident models' adapters

    async def status(self) -> dict: ...  # {"swapping": name | None, "loaded": [names]}

    async def resident(self) -> list[dict]: ...  # /v1/metrics resident_models

    async def load_row(self, name: str) -> dict: ...

    async def unload_row(self, name: str, drain_s: float | None = None) -> dict: ...

    async def metrics_text(self) -> bytes: ...

    async def suspend(self, drain_s: float) -> SuspendResult: ...  # every model released; nothing loads until resume

    async def resume(self) -> ResumeResult: ...

    def ports(self) -> list: ...  # the resident models' EnginePorts

    async def drain(self, timeout_s: float) -> int: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
