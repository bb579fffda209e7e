"""Boot: resolve and load the model, build the engine, serve HTTP on uvloop."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import importlib.util
import os
import signal
import sys
import time
from pathlib import Path
from typing import NamedTuple

import msgspec
from aiohttp import web

from imp.config import ServerConfig, gpu_runner_options, replica_devices, step_tokens
from imp.constrain.compile import GrammarCache
from imp.actors.faults import FaultPlan
from imp.actors.otlp_config import OtlpConfig
from imp.constrain.vocab import from_tokenizer
from imp.engine.local import LocalEngine
from imp.http.app import create_app
from imp.http.closing import close_when_quiet
from imp.precompile import boot_warm
from imp.settle import settle_after_boot
from imp.text.model import TextModel

log = logging.getLogger("imp")


def _progress(msg: str) -> None:
    print(f"imp: {msg}", file=sys.stderr, flush=True)


def open_responses_store(cfg: ServerConfig):
    """The Responses store, opened (and checked) before the model loads: a corrupt, locked or
    read-only file is a start-up error naming it, never a 500 per request."""
    from imp.fetch import cache_dir
    from imp.store.config import DEFAULT_FILENAME, StoreConfig
    from imp.store.sqlite import open_store

    if cfg.responses_store == "off":
        return None
    path = cfg.responses_store or str(cache_dir() / DEFAULT_FILENAME)
    return open_store(StoreConfig(path, cfg.responses_store_max_responses, cfg.responses_store_max_bytes,
                                  cfg.responses_store_max_age_s), now_s=time.time())


def warm_up_prefill(runner, tokens: int = 128) -> float | None:
    """A short prefill at boot (before anything is admitted, into blocks the allocator has
    not handed out yet, sequence forgotten after): its rate is what /v1/estimate's
    est_ttft_s uses until real prefills are measured. Also warms the kernels."""
    from imp.messages import SamplingParams, SeqWork
    from imp.model.team import inference_mode

    n = min(tokens, runner.num_blocks * runner.block_size - 1, int(runner.config.context_length) - 1)
    if n < 16:
        return None
    table = tuple(range((n + runner.block_size - 1) // runner.block_size))
    work = [SeqWork("warm-up", tuple(range(1, n + 1)), 0, table, True, SamplingParams(max_tokens=1, temperature=0.0))]
    rate = None
    with inference_mode():
        for _ in range(2):  # the first may still compile
            t0 = time.perf_counter()
            runner.step(work)
            rate = n / (time.perf_counter() - t0)
    if hasattr(runner, "forget"):
        runner.forget(("warm-up",))
    return rate


def model_name(path: Path) -> str:
    return path.stem if path.suffix == ".gguf" else path.name


def text_parts(cfg: ServerConfig, path: Path, metadata: dict):
    """The tokenizer and chat template of the model at path (its metadata already read)."""
    from imp.text.chat_template import ChatTemplate
    from imp.text.tokenizer import Tokenizer

    template = ChatTemplate.from_metadata(metadata, override_path=cfg.chat_template)
    if path.is_dir():  # HF directory: tokenizer.json; BOS/EOS texts for the template from it
        from imp.text.hf_tokenizer import HFTokenizer

        tokenizer = HFTokenizer.from_dir(path)
        template = ChatTemplate(template.source, tokenizer.token_text("bos"), tokenizer.token_text("eos"))
    else:
        tokenizer = Tokenizer.from_gguf_metadata(metadata)
    return tokenizer, template


def load_embedder(cfg: ServerConfig):
    """The --embedding-model encoder (imp.model.bert), or None. Loaded in every process that
    answers HTTP: it is small (all-MiniLM-L6-v2: 87 MB of fp32) and runs on the CPU."""
    if not cfg.embedding_model:
        return None
    from imp.fetch import resolve_model
    from imp.model.bert import BertEncoder

    t0 = time.monotonic()
    enc = BertEncoder.load(resolve_model(cfg.embedding_model))
    enc.embed(enc.tokenize(["warm up"]))  # Numba's GELU loads (or compiles) now, not at a request
    _progress(f"embedding model {enc.name}: {enc.hidden} dimensions, inputs up to {enc.max_tokens} tokens, "
              f"loaded in {time.monotonic() - t0:.1f}s")
    return enc


def load_text(cfg: ServerConfig) -> tuple[TextModel, GrammarCache]:
    """What an API-server process needs of the model: its text side and grammar vocabulary,
    read from the file's header (the weights stay with the engine process)."""
    from imp.fetch import resolve_model
    from imp.formats.gguf_loader import open_gguf

    path = Path(resolve_model(cfg.model))
    if path.is_dir():
        from imp.formats.hf_dir import open_hf_dir  # torch: only an HF directory needs it

        g = open_hf_dir(path)
    else:
        g = open_gguf(str(path))
    tokenizer, template = text_parts(cfg, path, g.metadata)
    return (TextModel.build(tokenizer, template, g.metadata),
            GrammarCache(from_tokenizer(tokenizer, int(g.config.vocab_size))))


class _Models(NamedTuple):
    path: Path
    loaders: list
    runners: list
    tokenizer: object
    name: str
    text: TextModel
    boot_rate: float | None
    grammars: GrammarCache


def _load_models(cfg: ServerConfig) -> _Models:
    """The model's parts: every replica's runner (and its reload call), the text side, the
    warm-up prefill, the grammar vocabulary; all a boot compiles (imp.precompile)."""
    from imp.fetch import resolve_model
    from imp.model.runner import ModelRunner

    gpu = any(d.startswith("cuda") for d in replica_devices(cfg))
    if gpu and importlib.util.find_spec("torch") is None:
        raise SystemExit("imp: --device cuda runs on torch and CuPy, which are not installed: "
                         "pip install 'imp[gpu]'")
    if cfg.threads and gpu:
        import torch  # the GPU runner's host ops; the CPU runner sets its own (ModelRunner.load)

        torch.set_num_threads(cfg.threads)
    path = Path(resolve_model(cfg.model))
    t0 = time.monotonic()
    _progress(f"loading {path.name} ...")

    null = os.environ.get("IMP_NULL_RUNNER") == "1"  # benchmarks: the server's own cost, no model math
    if null:
        _progress("IMP_NULL_RUNNER=1: a runner that computes nothing answers every step (benchmark only)")

    def loader(device: str):
        """The load call for one replica; suspend calls it again to reload what it released."""
        if null:
            from imp.model.null_runner import NullRunner, PacedNullRunner

            step_us = int(os.environ.get("IMP_NULL_STEP_US", "0"))  # > 0: a paced make-believe device
            row_us = float(os.environ.get("IMP_NULL_ROW_US", "0"))  # its cost model: + a decode row, + a prompt token
            token_us = float(os.environ.get("IMP_NULL_TOKEN_US", "0"))
            mixed_us = float(os.environ.get("IMP_NULL_MIXED_US", "0"))  # + a step with both kinds of rows
            kv_bytes = int(os.environ.get("IMP_NULL_KV_BYTES", "0"))  # > 0: prompt cache tiers, blocks this size
            ctx_us = float(os.environ.get("IMP_NULL_CTX_US", "0"))  # + attention: a decode row per 1k positions
            prompt_ctx_us = float(os.environ.get("IMP_NULL_PROMPT_CTX_US", "0"))  # a prompt row per 1k positions
            ctx_by = {int(b): float(us) for b, us in (x.split(":") for x in
                                                       os.environ.get("IMP_NULL_PROMPT_CTX_BY", "").split(",") if x)}
            report_by = os.environ.get("IMP_NULL_REPORT_CTX_BY", "1") != "0"
            buckets = ()
            if os.environ.get("IMP_NULL_BUCKETS") == "1":  # prompt rows cost their mixed-graph bucket (a GPU's)
                from imp.gpu.mixed import prompt_buckets

                buckets = prompt_buckets(step_tokens(cfg))
            if step_us > 0:
                return lambda: PacedNullRunner.load(str(path), block_size=cfg.block_size,
                                                    kv_tokens=cfg.kv_cache_tokens, step_us=step_us,
                                                    row_us=row_us, token_us=token_us, mixed_us=mixed_us,
                                                    kv_bytes=kv_bytes, buckets=buckets, ctx_us=ctx_us,
                                                    prompt_ctx_us=prompt_ctx_us, prompt_ctx_by=ctx_by,
                                                    report_ctx_by=report_by)
            return lambda: NullRunner.load(str(path), block_size=cfg.block_size, kv_tokens=cfg.kv_cache_tokens,
                                           kv_bytes=kv_bytes)
        if device.startswith("cuda"):
            from imp.gpu.runner import GpuModelRunner

            decided: dict = {}  # the first load's dense copies and matmul kernels, decided the same on a reload
            return lambda: GpuModelRunner.load(str(path), block_size=cfg.block_size, kv_tokens=cfg.kv_cache_tokens,
                                               device=device, max_graph_batch=cfg.max_batch_size, decided=decided,
                                               requant=cfg.weights,
                                               **gpu_runner_options(cfg),
                                               graphs=cfg.gpu_graphs != "off",
                                               max_prompt_rows=step_tokens(cfg) if cfg.gpu_graphs == "all" else 0)
        return lambda: ModelRunner.load(str(path), block_size=cfg.block_size, kv_tokens=cfg.kv_cache_tokens,
                                        num_threads=cfg.threads, adaptive_threads=not cfg.fixed_threads,
                                        requant=cfg.weights)

    loaders = [loader(device) for device in replica_devices(cfg)]  # data parallel: one model copy each
    runners = [load() for load in loaders]
    runner = runners[0]
    tokenizer, template = text_parts(cfg, path, runner.metadata)
    name = model_name(path)
    _progress(
        f"loaded {name} in {time.monotonic() - t0:.1f}s: {runner.config.n_layers} layers, "
        f"ctx {runner.config.context_length}, KV pool {runner.num_blocks} x {runner.block_size} tokens"
        + (f" on each of {len(runners)} replicas ({', '.join(replica_devices(cfg))})" if len(runners) > 1 else "")
    )
    if getattr(runner, "weights_note", ""):
        _progress(runner.weights_note)
    text = TextModel.build(tokenizer, template, runner.metadata)
    boot_rate = warm_up_prefill(runner)
    if boot_rate:
        _progress(f"warm-up prefill: {boot_rate:.0f} tokens/s (est_ttft_s uses it until requests are measured)")
    t1 = time.monotonic()
    grammars = GrammarCache(from_tokenizer(tokenizer, int(runner.config.vocab_size)))
    _progress(f"grammar engine ready for {tokenizer.vocab_size} tokens in {time.monotonic() - t1:.1f}s")
    return _Models(path, loaders, runners, tokenizer, name, text, boot_rate, grammars)


def cpu_boot(cfg: ServerConfig) -> bool:
    """A boot whose kernels are all CPU Numba ones (imp.precompile's case)."""
    return (not any(d.startswith("cuda") for d in replica_devices(cfg))
            and os.environ.get("IMP_NULL_RUNNER") != "1")


def compile_steps(cfg: ServerConfig, text_only: bool = False) -> None:
    """What `python -m imp _precompile` runs: a boot's steps that compile (the model's parts or,
    text_only, an API server's text side; the embedder), nothing that writes (no event log, no
    store)."""
    if text_only:
        load_text(cfg)
    else:
        _warm_tier(cfg)
        _load_models(cfg)
    load_embedder(cfg)


def _warm_tier(cfg: ServerConfig) -> None:
    """The prompt cache tier's compiled reads and digest (imp.actors.kvtier_io), where there is a tier."""
    if cfg.prompt_cache_dir or cfg.host_cache_gb:
        from imp.actors import kvtier_io

        kvtier_io.warm()


def compile_head(cfg: ServerConfig) -> None:
    """A cold boot's second compile child (`_precompile head`), beside the forward's: the layers'
    kernels other than the GEMMs (which the forward's child compiles first; it then finds these in
    the disk cache: Gemma's ~42 s of compiling split over two cores) and the output head. A model
    without the fused CPU forward has nothing to compile here."""
    import numpy as np

    from imp.fetch import resolve_model
    from imp.model.fused import FusedModel
    from imp.model.runner import ModelRunner

    runner = ModelRunner.load(str(resolve_model(cfg.model)), block_size=cfg.block_size, kv_tokens=256,
                              num_threads=cfg.threads)
    model = runner.model
    if isinstance(model, FusedModel):
        model.compile_layer_parts(runner.cache)  # first: the forward's child needs them before the head
        for rows in (1, 2):  # the file loop's head (AMX machines) takes one route for one token, another for more
            model.head_logits(np.zeros((rows, model.cfg.d_model), np.float32))


def precompile_main(argv: list[str]) -> int:
    """`python -m imp _precompile engine|text` (a ServerConfig as JSON on stdin): run a CPU boot's
    steps (the same calls the server makes) so that everything they compile lands in the cache."""
    import msgspec

    if os.environ.get("IMP_PROGRESS_FD"):  # the parent shows each finished kernel on its port (imp.bootstatus)
        from imp.bootstatus import child_reporter

        child_reporter(int(os.environ["IMP_PROGRESS_FD"]))
    cfg = msgspec.json.decode(sys.stdin.buffer.read(), type=ServerConfig)
    if argv[:1] == ["head"]:
        compile_head(cfg)
    else:
        compile_steps(cfg, text_only=argv[:1] == ["text"])
    return 0


def load_engine(cfg: ServerConfig, store=None, embedder: bool = False, status_port: bool = False):
    """Everything that reads the disk or the environment happens here, once. The engine sends
    token ids; the port's stream makes the text where it is sent (imp.engine.render). embedder: also load
    the --embedding-model encoder (one process serving both) and return it third. status_port: this
    process will serve HTTP on cfg.port, so a cold compile answers 503 'compiling' there meanwhile."""
    from imp.formats.lora import LoraFiles
    from imp.model.lora import LoraTable

    def steps():
        _warm_tier(cfg)
        return _load_models(cfg), (load_embedder(cfg) if embedder else None)

    (path, loaders, runners, tokenizer, name, text, boot_rate, grammars), enc = boot_warm(
        steps, cfg, _progress, enabled=cpu_boot(cfg), status_at=(cfg.host, cfg.port) if status_port else None)

    otlp = OtlpConfig.resolve(cfg.otlp_endpoint, cfg.log_requests, os.environ)  # the environment, read once
    faults = FaultPlan.parse(os.environ.get("IMP_FAULT_INJECT"))
    if faults is not None:
        _progress(f"fault injection armed: {faults.kind} fault at step {faults.at_step} (IMP_FAULT_INJECT)")
    engine = LocalEngine(cfg, runners, tokenizer, name, str(path), grammars=grammars, store=store, otlp=otlp,
                         faults=faults, loaders=loaders, boot_prefill_tok_s=boot_rate,
                         lora_files=LoraFiles(cfg.lora_dir), lora_tables=[LoraTable() for _ in loaders])
    return (engine, text, enc) if embedder else (engine, text)


def model_log(path: str | None, name: str) -> str | None:
    """A fleet model's event-log stream beside the boot model's: events.log -> events.<name>.log."""
    if not path:
        return None
    p = Path(path)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return str(p.with_name(f"{p.stem}.{safe}{p.suffix}"))


def model_header(path: Path) -> tuple[int, int]:
    """(context length, KV bytes per token at 2-byte elements) from a model's header, (0, 0) if unreadable:
    the catalogue's figures before a model loads (imp.engine.catalog)."""
    try:
        if path.is_dir():
            from imp.formats.hf_dir import read_config

            cfg, _ = read_config(path)
        else:
            from imp.formats.gguf_loader import open_gguf

            cfg = open_gguf(str(path)).config
        return int(cfg.context_length), 2 * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim
    except Exception:  # noqa: BLE001 - a broken file is listed; loading it answers why
        return 0, 0


def fleet_for(cfg: ServerConfig, engine, text):
    """Models on demand (--models-dir / --models-file): the boot model and a builder for the others, each
    model its own engine and event-log stream (imp.engine.fleet). CatalogError for a bad models file."""
    from imp.core.residency import Budget
    from imp.engine.catalog import entry_for, scan
    from imp.engine.fleet import Fleet

    gpu = cfg.device.startswith("cuda")
    catalog = scan(cfg.models_dir, cfg.models_file, model_header)
    first = next((e for e in catalog.entries if Path(e.path) == Path(engine.card.path).resolve()), None)
    first = first or entry_for(Path(engine.card.path), engine.card.name, header=model_header)
    # the fleet's name everywhere (responses' `model`, metrics' label, the log's header): set before it starts
    engine.card = msgspec.structs.replace(engine.card, name=first.name)
    gb = 2**30
    budget = Budget(int(cfg.models_memory_gb * gb), int(cfg.models_host_memory_gb * gb)) if gpu else \
        Budget(0, int(cfg.models_memory_gb * gb))

    async def build(entry):
        mcfg = dataclasses.replace(cfg, model=entry.path, event_log=model_log(cfg.event_log, entry.name),
                                   idle_unload_s=0.0, agent_port=0)
        eng, tm = await asyncio.to_thread(load_engine, mcfg, None)  # the file read off the loop
        eng.card = msgspec.structs.replace(eng.card, name=entry.name)
        eng.store_home = engine  # the one Responses store
        await eng.start()
        return eng, tm, eng.grammars

    return Fleet(catalog, budget, build, first, (engine, text, engine.grammars), on_gpu=gpu,
                 drain_s=cfg.model_swap_drain_s, idle_s=cfg.idle_unload_s, kv_tokens=cfg.kv_cache_tokens or 16384)


async def unless_signalled(aw, signals: asyncio.Queue):
    """aw's result, or None when a (second) signal comes first (aw is cancelled then)."""
    task = asyncio.ensure_future(aw)
    again = asyncio.ensure_future(signals.get())
    await asyncio.wait((task, again), return_when=asyncio.FIRST_COMPLETED)
    again.cancel()
    if not task.done():
        task.cancel()
        return None
    return task.result()


async def drain(engine, signals: asyncio.Queue, timeout_s: float) -> int | None:
    """SIGTERM's drain: admission closes (503 draining), admitted requests run on for up to
    timeout_s; a second signal stops waiting. How many were left, None if cut by a signal."""
    return await unless_signalled(engine.drain(timeout_s), signals)


async def _serve(cfg: ServerConfig, engine: LocalEngine, text: TextModel, api_keys: tuple[str, ...],
                 embedder=None, fleet=None) -> None:
    app = create_app(engine, text, cfg, grammars=engine.grammars, api_keys=api_keys, embedder=embedder,
                     fleet=fleet)
    freed = settle_after_boot()
    if freed:
        _progress(f"released {freed // 1024} MB of LLVM's code pages (only compiling runs them)")
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    # backlog as the process layout's socket (procs.py): aiohttp's 128 drops the SYNs of a
    # burst of clients while the loop is busy, and each dropped SYN costs its client 1 s
    site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True, backlog=1024)
    await site.start()
    _progress(f"serving on http://{cfg.host}:{cfg.port}")
    if cfg.agent_port:  # HAProxy's agent-check: up/drain/down and a weight from queue and KV (imp.http.agent)
        from imp.http.agent import engine_answer, start_agent

        await start_agent(cfg.host, cfg.agent_port, engine_answer(engine, fleet))
        _progress(f"agent-check on {cfg.host}:{cfg.agent_port}")
    signals = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, signals.put_nowait, sig)
        except NotImplementedError:  # pragma: no cover - non-unix
            pass
    sig = await signals.get()
    # Drain: /ready answers 503 draining, new requests 503, admitted ones finish (a second
    # signal stops waiting). Then the app's cleanup stops the actors: the event log and the
    # Responses store are flushed and closed before the process exits 0.
    _progress(f"{signal.Signals(sig).name}: draining (up to {cfg.shutdown_timeout_s:g}s) ...")
    t_sig = time.monotonic()
    left = await drain(fleet or engine, signals, cfg.shutdown_timeout_s)
    if left is not None:  # the listener closes once the balancer has stopped sending (imp.http.closing)
        await unless_signalled(close_when_quiet(app, cfg.shutdown_quiet_s,
                                                cfg.shutdown_timeout_s - (time.monotonic() - t_sig)), signals)
    _progress("shutting down" + (f": the engine faulted ({engine.fault})" if engine.fault else
                                 f": {left} requests still running are cut" if left else
                                 ": second signal, requests still running are cut" if left is None else ""))
    await runner.cleanup()


def setup_logging(cfg: ServerConfig) -> None:
    logging.basicConfig(
        level=getattr(logging, cfg.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def serve(cfg: ServerConfig) -> None:
    """One process: the engine and HTTP on one event loop (--api-servers 0; see imp.procs)."""
    setup_logging(cfg)
    from imp.fetch import FetchError
    from imp.formats.gguf_file import ModelFileError
    from imp.http.access import load_api_keys
    from imp.store.sqlite import StoreOpenError

    try:
        api_keys = load_api_keys(cfg.api_key, cfg.api_key_file)
        store = open_responses_store(cfg)
    except (StoreOpenError, ValueError) as exc:
        _progress(f"cannot start: {exc}")
        sys.exit(2)
    from imp.config import fleet_mode
    from imp.engine.catalog import CatalogError

    fleet = None
    try:
        if fleet_mode(cfg):  # the fleet unloads idle models itself, the boot one too
            from imp.engine.catalog import read_models_file

            if cfg.models_file:
                read_models_file(cfg.models_file)  # a bad file is a start-up error before the model loads
            engine, text, embedder = load_engine(dataclasses.replace(cfg, idle_unload_s=0.0), store, embedder=True,
                                                 status_port=True)
            fleet = fleet_for(cfg, engine, text)
            _progress(f"models on demand: {len(fleet.catalog.entries)} models by name"
                      + (f", budget {cfg.models_memory_gb:g} GB" if cfg.models_memory_gb else ", no memory budget"))
        else:
            engine, text, embedder = load_engine(cfg, store, embedder=True, status_port=True)
    except (ModelFileError, FetchError, CatalogError) as exc:  # a wrong --model: one line, not a traceback
        _progress(f"cannot start: {exc}")
        sys.exit(2)
    try:
        import uvloop

        uvloop.run(_serve(cfg, engine, text, api_keys, embedder, fleet))
    except ImportError:  # pragma: no cover
        asyncio.run(_serve(cfg, engine, text, api_keys, embedder, fleet))
