"""Server configuration: read once at boot (CLI flags), frozen, validated."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DECODE_ATTENTION = ("auto", "mma", "split", "paged")  # --gpu-decode-attention (imp.gpu.runner.decode_kernel)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    model: str = "smollm2-135m"
    event_log: str | None = None
    kv_cache_tokens: int | None = None
    block_size: int = 16
    max_batch_size: int = 64
    # tokens a step computes; 0 = auto: 512 on a CPU, 1024 on a GPU (at 256 streams with 128-token answers every
    # step must admit ~2 prompts beside 256 decode rows; 512 left room for one and the queue grew, issue 33;
    # 2048 made the bursts' mixed steps long: PERFORMANCE.md "Where the time goes at 64-256 streams")
    max_step_tokens: int = 0
    # > 0: prompt chunks beside decode rows sized to keep such a step near this (imp/core/itl.py); 0 = off
    # (off by default: on the CPU it trades rare 600 ms stalls for many 100 ms steps, PERFORMANCE.md "ITL")
    itl_target_ms: float = 0.0
    # without a target: a step with decode rows takes at most this many times a decode-only step, unless the
    # waiting prompts need more (imp/core/itl.py); 0 = off; -1 = auto: 3 on a GPU, off on a CPU. On the H100 the
    # 8B shape's 860-token chunks beside 16 streams made ITL p99 4.2x p50, 2.6x at 3 (-2 % tok/s); SmolLM2's mixed
    # steps stay under 3 decode steps, so it does not bind there (PERFORMANCE.md "The default penalty on the
    # device"); 2.5 had cost 10-15 % through HTTP at 16-64 streams when a mixed step had a 2 ms fixed part
    itl_ratio: float = -1.0
    # draft-free speculation (imp/core/spec.py) for requests that do not say ("speculative"): on / off / auto
    # (on where the executor says so: the CPU's; the GPU's verify steps are not pipelined and not yet measured,
    # so there a request asks for it); a draft is at most spec_draft_max tokens (0: never, whatever a request asks)
    speculative: str = "auto"
    spec_draft_max: int = 8
    max_tokens: int | None = None  # fixed default for max_tokens; None = rest of context
    max_output_tokens: int | None = None  # server-wide cap on every request's output (llama-server's -n)
    max_queued_tokens: int = 0
    request_timeout_s: float = 0.0
    lora_dir: str | None = None  # POST /admin/lora/load reads adapters from under this directory only
    idle_unload_s: float = 0.0  # release the model after this many idle seconds (0 = never)
    # the prefix cache's disk tier (imp/actors/kvtier.py): every cached KV block written through to this
    # directory, read back on a later hit (after eviction, suspend, idle unload or a restart); None = none
    prompt_cache_dir: str | None = None
    prompt_cache_gb: float = 8.0  # the tier's size; the least recently used blocks go first
    # the prefix cache's host-memory tier (in front of the disk tier, or alone): GB of cached blocks kept in host
    # memory, written through as blocks become cache entries (a device->host copy each on a GPU: opt-in). On the
    # CPU executor the pool is host memory already
    host_cache_gb: float = 0.0
    # swap instead of recompute: a running request preempted for want of blocks parks its KV in a host swap area
    # of swap_space_gb (pinned on a GPU; vLLM's --swap-space) when the boot-measured costs say the copies beat
    # computing its context again ("auto"), always when there is room ("swap"), or never ("recompute")
    swap_space_gb: float = 4.0
    preemption_mode: str = "auto"
    shutdown_timeout_s: float = 30.0  # SIGTERM: how long admitted requests may run on
    # then: the listener stays open (everything 503 draining) until no request has come for this long, so a
    # balancer that still routes here resends elsewhere instead of seeing a closed connection (imp/http/closing.py)
    shutdown_quiet_s: float = 1.0
    # HAProxy agent-check port (imp/http/agent.py): one line a connection, up/drain/down and a weight from
    # queue and KV pressure, so load steers a balancer without failing its checks; 0 = off
    agent_port: int = 0
    chat_template: str | None = None
    embedding_model: str | None = None  # /v1/embeddings and /v1/rerank (a sentence-transformers BERT)
    # models on demand (imp/engine/fleet.py): every model of the directory (and the models file) served by
    # name, loaded when a request names it, the least recently used unloaded first when the budget is full
    models_dir: str | None = None
    models_file: str | None = None  # TOML / JSON: aliases and per-model idle unload (imp/engine/catalog.py)
    models_memory_gb: float = 0.0  # the resident models' budget: the GPU's memory on cuda, RAM on cpu; 0 = none
    models_host_memory_gb: float = 0.0  # with a GPU: host RAM the resident models may hold; 0 = no limit
    model_swap_drain_s: float = 30.0  # an unload waits this long for the model's requests (never cancelled)
    api_key: str | None = None
    api_key_file: str | None = None  # more keys, one per line (read once at boot)
    rate_limit: int = 0  # requests per minute per key (per address without keys); 0 = none
    strict_fields: bool = False  # a body field no one defines is a 400 (else reported and ignored)
    threads: int | None = None
    # the CPU forward narrows to one thread while a neighbour takes the cores (imp.model.governor)
    fixed_threads: bool = False
    device: str = "cpu"  # "cpu" or "cuda[:N]": which executor runs the model
    pipeline_depth: int = 0  # steps in flight: 2 plans step N+1 while N runs; 0 = auto (2 on a GPU, 1 on CPU)
    data_parallel: int = 1  # model replicas, one executor each (cuda:K, cuda:K+1, ... from --device)
    # GPU GEMVs of quantized weights: "int8" activations (llama.cpp's Q8_1: ~1.7x faster decode at batch 1 on
    # an 8B Q4_K_M, numerics of the CPU runner's block kernels; imp.kernels.cuda.gemv_int8_act), or "fp32" ones
    gpu_activations: str = "int8"
    # GPU: every matmul row on the int8 tensor-core GEMM (no cuBLAS, no dense copy), so that a request's tokens
    # do not depend on what shares its steps (vLLM's VLLM_BATCH_INVARIANT, SGLang's deterministic inference);
    # the CPU runner is batch invariant always
    batch_invariant: bool = False
    # GPU decode rows' attention: "split" (imp.kernels.cuda.paged_decode_split: a CTA a KV head and its query heads,
    # long contexts cut into segments over several CTAs), "mma" (paged_decode_mma: tensor cores, rows whose block
    # tables share a cached prefix read it once a step; bf16 caches, D 64/128, G <= 16), "paged" (paged_decode_attention:
    # a CTA a query head and row), or "auto" (the default since 2026-12-07: mma at head dim 128, split else; the
    # runner decides, imp.gpu.runner.decode_kernel). Measured on an H200 in one call (bench/gpu.py, PERFORMANCE.md):
    # the 8B shape (D 128) with mma at least as fast in every cell (b1 / b64 at 128 tokens +3 %, b1 at 4-32k +5-11 %)
    # and 16 rows after a shared 16k / 32k prompt 515 / 277 -> 1,478 / 1,181 tok/s; SmolLM2's shape (D 64, G 3) 4-7 %
    # slower at short contexts and 15 % at one stream at 32k (the kernel bench: 1.4-1.9x a layer at 1k contexts),
    # though 2.3-3.3x with 16 rows on a shared prompt. All three are batch invariant; each has its own bits: one
    # kernel for every decode row of a server
    gpu_decode_attention: str = "auto"
    # a BF16 / F16 / F32 model's matrices as stored at load: "native", or "q8_0" (imp/formats/requant.py: int8 with a
    # scale per 32 weights, half BF16's bytes a step; 98.6 % of BF16's greedy tokens on SmolLM2 upcast, where FP8 E4M3
    # kept 91.5-94.1 %: bench/fp8_accuracy.py). CPU and GPU executors alike; quantized matrices stay as they are
    weights: str = "native"
    # GPU CUDA graphs: "all" (decode steps and steps with prompt rows, imp.gpu.mixed), "decode" (prompt steps
    # eager: a shorter boot, less memory) or "off" (every step eager)
    gpu_graphs: str = "all"
    # API-server processes in front of one engine process (0 = HTTP in the engine's own
    # process; -1 = auto: 0 on CPU, where the cores are the model's, else from the cores)
    api_servers: int = -1
    log_level: str = "info"
    otlp_endpoint: str | None = None  # OTLP/HTTP traces URL (else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT at boot)
    log_requests: str | None = None  # JSONL file: one line per generation request
    # the Responses store (SQLite): None = under the cache dir; "off" = no store (store: true is a 400)
    responses_store: str | None = None
    responses_store_max_responses: int = 10_000
    responses_store_max_bytes: int = 1 << 30
    responses_store_max_age_s: float = 30 * 86400.0

    def __post_init__(self):
        checks = [
            (0 < self.port < 65536, "--port must be in 1..65535"),
            (self.block_size in (8, 16, 32, 64), "--block-size must be 8, 16, 32 or 64"),
            (self.max_batch_size >= 1, "--max-batch-size must be >= 1"),
            (self.max_step_tokens == 0 or self.max_step_tokens >= 16, "--max-step-tokens must be >= 16 (0 = auto)"),
            (self.itl_target_ms >= 0, "--itl-target-ms must be >= 0 (0 = off)"),
            (self.itl_ratio in (-1.0, 0.0) or 1.2 <= self.itl_ratio <= 100,
             "--itl-ratio must be -1 (auto), 0 (off) or 1.2..100"),
            (self.speculative in ("on", "off", "auto"), "--speculative must be on, off or auto"),
            (0 <= self.spec_draft_max <= 64, "--spec-draft-max must be 0..64"),
            (self.kv_cache_tokens is None or self.kv_cache_tokens >= self.block_size, "--kv-cache-tokens too small"),
            (self.max_tokens is None or self.max_tokens >= 1, "--max-tokens must be >= 1"),
            (self.max_output_tokens is None or self.max_output_tokens >= 1, "--max-output-tokens must be >= 1"),
            (self.max_queued_tokens >= 0, "--max-queued-tokens must be >= 0"),
            (self.request_timeout_s >= 0, "--request-timeout must be >= 0"),
            (self.rate_limit >= 0, "--rate-limit must be >= 0 (requests per minute; 0 = off)"),
            (self.idle_unload_s >= 0, "--idle-unload-seconds must be >= 0 (0 = off)"),
            (self.prompt_cache_gb > 0, "--prompt-cache-gb must be > 0"),
            (self.host_cache_gb >= 0, "--host-cache-gb must be >= 0 (0 = no host tier)"),
            (self.swap_space_gb >= 0, "--swap-space must be >= 0 (GB; 0 = no swap area)"),
            (self.preemption_mode in ("auto", "swap", "recompute"), "--preemption-mode must be auto, swap or recompute"),
            (self.shutdown_timeout_s >= 0, "--shutdown-timeout must be >= 0"),
            (0 <= self.shutdown_quiet_s <= 60, "--shutdown-quiet must be in 0..60 seconds"),
            (self.models_memory_gb >= 0, "--models-memory must be >= 0 (GB; 0 = no limit)"),
            (self.models_host_memory_gb >= 0, "--models-host-memory must be >= 0 (GB; 0 = no limit)"),
            (0 <= self.model_swap_drain_s <= 3600, "--model-swap-drain must be in 0..3600 seconds"),
            (0 <= self.agent_port < 65536 and self.agent_port != self.port,
             "--agent-port must be in 1..65535 and not --port (0 = off)"),
            (self.device == "cpu" or self.device.startswith("cuda"), "--device must be cpu or cuda[:N]"),
            (self.gpu_activations in ("fp32", "int8"), "--gpu-activations must be fp32 or int8"),
            (self.gpu_decode_attention in DECODE_ATTENTION, "--gpu-decode-attention must be auto, mma, split or paged"),
            (self.weights in ("native", "q8_0"), "--weights must be native or q8_0"),
            (self.gpu_graphs in ("all", "decode", "off"), "--gpu-graphs must be all, decode or off"),
            (not self.batch_invariant or self.gpu_activations == "int8",
             "--batch-invariant needs --gpu-activations int8 (the fp32 path's matmuls are cuBLAS's)"),
            (self.pipeline_depth in (0, 1, 2), "--pipeline-depth must be 1 or 2 (0 = auto)"),
            (1 <= self.data_parallel <= 64, "--data-parallel must be 1..64"),
            (-1 <= self.api_servers <= 64, "--api-servers must be 0..64 (0 = one process; default: auto)"),
            (self.responses_store_max_responses >= 0, "--responses-store-max-responses must be >= 0"),
            (self.responses_store_max_bytes >= 0, "--responses-store-max-bytes must be >= 0"),
            (self.responses_store_max_age_s >= 0, "--responses-store-max-age must be >= 0"),
        ]
        for ok, why in checks:
            if not ok:
                raise ValueError(why)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--model", "-m", default=d.model, help="GGUF path or packaged model name (smollm2-135m)")
    p.add_argument("--event-log", default=None, help="write every actor message to this file")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool size in tokens")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
    p.add_argument("--max-step-tokens", type=int, default=d.max_step_tokens,
                   help="tokens a step computes (default 0 = auto: 512 on a CPU, 1024 on a GPU)")
    p.add_argument("--itl-target-ms", type=float, default=d.itl_target_ms,
                   help="size the prompt chunks that share a step with running streams so that the step takes "
                        "about this long (or twice a decode step, if longer), from measured step times (default 0 = "
                        "off: chunks of --max-step-tokens)")
    p.add_argument("--itl-ratio", type=float, default=d.itl_ratio,
                   help="without --itl-target-ms: a step beside running streams takes at most this many times a "
                        "decode-only step, unless the waiting prompts need more (0 = off; default -1 = auto: 3 on a "
                        "GPU, off on a CPU)")
    p.add_argument("--speculative", choices=("on", "off", "auto"), default=d.speculative,
                   help="draft-free speculative decoding for requests that do not say (their \"speculative\"): "
                        "the sequence's own prompt and output predict its next tokens, verified in one step; the "
                        "output is the same token for token (default auto: on with the CPU executor; with the GPU's, for the "
                        "requests that ask, until its verify steps are measured)")
    p.add_argument("--spec-draft-max", type=int, default=d.spec_draft_max,
                   help="most drafted tokens a step verifies for one sequence (0 = no speculation at all)")
    p.add_argument("--max-tokens", type=int, default=None, help="default max_tokens (else rest of context)")
    p.add_argument("--max-output-tokens", type=int, default=None,
                   help="cap every request's output at N tokens (a normal max_tokens / length stop)")
    p.add_argument("--max-queued-tokens", type=int, default=0, help="429 beyond this many queued prompt tokens")
    p.add_argument("--request-timeout", dest="request_timeout_s", type=float, default=0.0)
    p.add_argument("--lora-dir", default=None,
                   help="directory of LoRA adapters (PEFT dirs or .safetensors) that POST /admin/lora/load may read")
    p.add_argument("--idle-unload-seconds", dest="idle_unload_s", type=float, default=0.0,
                   help="release the weights and KV pool after N s without a request; the next one reloads "
                        "them inside itself (0 = off)")
    p.add_argument("--prompt-cache-dir", default=None,
                   help="keep the prefix cache's KV blocks in this directory too (a disk tier): a prompt seen "
                        "before, even before a restart, is read back instead of computed")
    p.add_argument("--prompt-cache-gb", type=float, default=d.prompt_cache_gb,
                   help="the disk tier's size in GB (least recently used blocks dropped first)")
    p.add_argument("--swap-space", dest="swap_space_gb", type=float, default=d.swap_space_gb,
                   help="GB of host memory (pinned on a GPU) where a request preempted for want of KV blocks parks "
                        "its KV instead of computing it again (0 = none)")
    p.add_argument("--preemption-mode", choices=("auto", "swap", "recompute"), default=d.preemption_mode,
                   help="a preempted request's KV: swapped out when the measured copy cost beats recomputing it "
                        "(auto), swapped whenever the swap space has room, or always recomputed")
    p.add_argument("--host-cache-gb", type=float, default=d.host_cache_gb,
                   help="keep this many GB of the prefix cache's blocks in host memory too (a host tier in front "
                        "of --prompt-cache-dir, or alone): a block the pool evicted comes back by a copy, not a "
                        "recompute (0 = none; on the CPU executor the pool is host memory already)")
    p.add_argument("--shutdown-timeout", dest="shutdown_timeout_s", type=float, default=d.shutdown_timeout_s,
                   help="on SIGTERM, seconds the admitted requests may run on (new ones get 503 draining)")
    p.add_argument("--shutdown-quiet", dest="shutdown_quiet_s", type=float, default=d.shutdown_quiet_s,
                   help="after the drain, keep answering 503 draining until no request has come for S seconds "
                        "(a load balancer still routing here resends them elsewhere), within --shutdown-timeout")
    p.add_argument("--agent-port", type=int, default=d.agent_port,
                   help="answer HAProxy's agent-check on this TCP port: 'up ready N%%' (a weight from queue and KV "
                        "pressure), 'drain' while suspended or draining, 'down' after an engine fault (0 = off; "
                        "deploy/haproxy.cfg)")
    p.add_argument("--chat-template", default=None, help="jinja file overriding the model's template")
    p.add_argument("--embedding-model", default=None,
                   help="sentence-embedding model for /v1/embeddings and /v1/rerank: all-minilm-l6-v2 "
                        "(fetched) or a sentence-transformers folder")
    p.add_argument("--models-dir", default=None,
                   help="directory of models (GGUF files, one level down too, and HF directories) served by name: "
                        "a request naming one loads it (GET /v1/models lists them)")
    p.add_argument("--models-file", default=None,
                   help="TOML or JSON table of models by name: aliases (\"*\" = any other name), path, "
                        "idle_unload_seconds (imp/engine/catalog.py)")
    p.add_argument("--models-memory", dest="models_memory_gb", type=float, default=d.models_memory_gb,
                   help="GB the resident models may hold together (the GPU's memory with --device cuda, else RAM): "
                        "loading one past it unloads the least recently used idle model first (0 = no limit)")
    p.add_argument("--models-host-memory", dest="models_host_memory_gb", type=float, default=d.models_host_memory_gb,
                   help="with a GPU: GB of host RAM the resident models may hold (pinned swap areas; 0 = no limit)")
    p.add_argument("--model-swap-drain", dest="model_swap_drain_s", type=float, default=d.model_swap_drain_s,
                   help="seconds an unload waits for the model's running requests (never cancelled); past it "
                        "the request that wanted the swap gets 503 model_swap_timeout")
    p.add_argument("--api-key", default=None, help="require this key on every route but /health and /ready "
                   "(Authorization: Bearer KEY or x-api-key: KEY)")
    p.add_argument("--api-key-file", default=None, help="file of accepted keys, one per line ('#' comments)")
    p.add_argument("--rate-limit", type=int, default=0,
                   help="requests per minute per key (per client address without keys); past it 429 + Retry-After")
    p.add_argument("--strict-fields", action="store_true",
                   help="a request body field no one defines is a 400 naming it, as the official APIs answer "
                   "(default: ignored, named in the imp-ignored-fields header, logged once, counted)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU forward threads (default: one per physical core)")
    p.add_argument("--fixed-threads", action="store_true",
                   help="always use all --threads (default: the CPU forward drops to one thread while another "
                   "process keeps its threads from the cores, and probes back; see imp/model/governor.py)")
    p.add_argument("--device", default=d.device, help="cpu (default) or cuda:N (GPU executor)")
    p.add_argument("--gpu-activations", choices=("fp32", "int8"), default=d.gpu_activations,
                   help="GPU matmuls of quantized weights at decode: int8 activations (default; dp4a, as "
                        "llama.cpp: faster at small batches, the CPU runner's numerics) or fp32 ones")
    p.add_argument("--gpu-decode-attention", choices=DECODE_ATTENTION, default=d.gpu_decode_attention,
                   help="GPU decode rows' attention: auto (default: mma at head dim 128, split else), mma (tensor "
                        "cores; rows sharing a cached prefix read it once a step), split (a CTA a KV head, long "
                        "contexts over several CTAs) or paged (a CTA a query head)")
    p.add_argument("--weights", choices=("native", "q8_0"), default=d.weights,
                   help="store a BF16 / F16 / F32 model's matrices as Q8_0 at load (half the bytes a decode step "
                        "reads and the weights' memory; near BF16's tokens) or as they are (native, default)")
    p.add_argument("--gpu-graphs", choices=("all", "decode", "off"), default=d.gpu_graphs,
                   help="GPU CUDA graphs: all (default: decode steps and steps with prompt rows), decode (prompt "
                        "steps eager: shorter boot, less memory) or off (every step eager)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="GPU: every matmul on the int8 GEMM, so a request's tokens do not depend on the requests "
                        "beside it (slower at one stream and in prefill; the CPU path is invariant always)")
    p.add_argument("--pipeline-depth", type=int, default=0,
                   help="steps in flight: 2 = plan step N+1 while step N runs (default: 2 on a GPU, 1 on CPU)")
    p.add_argument("--data-parallel", type=int, default=1,
                   help="model replicas, one scheduler + KV pool + executor each; with --device cuda:K they take "
                        "cuda:K .. cuda:K+N-1 (on CPU they share the cores)")
    p.add_argument("--api-servers", type=int, default=-1,
                   help="HTTP API-server processes in front of one engine process, sharing the port "
                        "(0 = HTTP in the engine's process; default: 0 on CPU, else from the cores)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--otlp-endpoint", default=None,
                   help="full OTLP/HTTP traces URL of a collector, e.g. http://127.0.0.1:4318/v1/traces "
                        "(else $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; $OTEL_SERVICE_NAME names the service)")
    p.add_argument("--log-requests", default=None, help="append one JSONL line per generation request to this file")
    p.add_argument("--responses-store", default=None,
                   help="SQLite file of stored responses (default: responses.sqlite3 in the cache dir; off = none)")
    p.add_argument("--responses-store-max-responses", type=int, default=d.responses_store_max_responses,
                   help="evict the oldest stored responses past this many (0 = no limit)")
    p.add_argument("--responses-store-max-bytes", type=int, default=d.responses_store_max_bytes,
                   help="evict the oldest past this many bytes of stored JSON (0 = no limit)")
    p.add_argument("--responses-store-max-age", dest="responses_store_max_age_s", type=float,
                   default=d.responses_store_max_age_s, help="evict stored responses older than this (seconds)")


def replica_devices(cfg: ServerConfig) -> list[str]:
    """One device per replica: cuda:K, cuda:K+1, ... from --device cuda[:K]; "cpu" repeated."""
    if not cfg.device.startswith("cuda"):
        return ["cpu"] * cfg.data_parallel
    base = int(cfg.device.partition(":")[2] or 0)
    return [f"cuda:{base + i}" for i in range(cfg.data_parallel)]


def api_servers(cfg: ServerConfig, cores: int) -> int:
    """--api-servers, auto resolved: on CPU the cores run the model, so HTTP stays in its
    process; on a GPU the per-token host work moves off the engine's loop."""
    if cfg.api_servers >= 0:
        return cfg.api_servers
    if not cfg.device.startswith("cuda") or cores < 4:
        return 0
    return max(1, min(4, cores // 16))  # one on a 16-core host: measured best at 16-64 streams


def fleet_mode(cfg: ServerConfig) -> bool:
    """Models on demand: a --models-dir or --models-file names more than the boot model."""
    return bool(cfg.models_dir or cfg.models_file)


def pipeline_depth(cfg: ServerConfig) -> int:
    return cfg.pipeline_depth or (2 if cfg.device.startswith("cuda") else 1)


def step_tokens(cfg: ServerConfig) -> int:
    return cfg.max_step_tokens or (1024 if cfg.device.startswith("cuda") else 512)


def gpu_runner_options(cfg: ServerConfig) -> dict:
    """The GPU runner's numerics from a config: what imp.server loads it with, and bench/gpu.py's default rows."""
    return {"int8_act": cfg.gpu_activations == "int8", "batch_invariant": cfg.batch_invariant,
            "decode_attention": cfg.gpu_decode_attention}


def itl_ratio(cfg: ServerConfig) -> float:
    """--itl-ratio, auto resolved: 3 on a GPU (a large model's prompt chunks cost several decode steps there),
    off on a CPU (where --itl-target-ms is the policy to reach for)."""
    if cfg.itl_ratio >= 0:
        return cfg.itl_ratio
    return 3.0 if cfg.device.startswith("cuda") else 0.0


def itl_policy_on(cfg: ServerConfig) -> bool:
    """An ITL policy (a target or the ratio, auto resolved) caps prompt chunks beside decode rows: the boot then
    measures the runner's mixed-step buckets and the scheduler's config carries them."""
    return bool(cfg.itl_target_ms or itl_ratio(cfg))



def config_from_args(ns: argparse.Namespace) -> ServerConfig:
    fields = ServerConfig.__dataclass_fields__
    return ServerConfig(**{k: v for k, v in vars(ns).items() if k in fields})
