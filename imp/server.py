"""Boot: resolve and load the model, build the engine, serve HTTP on uvloop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

from aiohttp import web

from imp.config import ServerConfig, replica_devices
from imp.engine.engine import Engine
from imp.http.app import create_app
from imp.http.params import ModelDefaults

log = logging.getLogger("imp")


def _progress(msg: str) -> None:
    print(f"imp: {msg}", file=sys.stderr, flush=True)


def load_engine(cfg: ServerConfig) -> Engine:
    """Everything that reads the disk or the environment happens here, once."""
    import torch

    from imp.text.chat_template import ChatTemplate
    from imp.fetch import resolve_model
    from imp.model.runner import ModelRunner
    from imp.text.tokenizer import Tokenizer

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    path = Path(resolve_model(cfg.model))
    t0 = time.monotonic()
    _progress(f"loading {path.name} ...")
    runners = []
    for device in replica_devices(cfg):  # data parallel: one full model copy per device
        if device.startswith("cuda"):
            from imp.gpu.runner import GpuModelRunner

            runners.append(GpuModelRunner.load(
                str(path), block_size=cfg.block_size, kv_tokens=cfg.kv_cache_tokens, device=device,
                max_graph_batch=cfg.max_batch_size,
            ))
        else:
            runners.append(ModelRunner.load(str(path), block_size=cfg.block_size, kv_tokens=cfg.kv_cache_tokens))
    runner = runners[0]
    template = ChatTemplate.from_metadata(runner.metadata, override_path=cfg.chat_template)
    if path.is_dir():  # HF directory: tokenizer.json; BOS/EOS texts for the template from it
        from imp.text.hf_tokenizer import HFTokenizer

        tokenizer = HFTokenizer.from_dir(path)
        template = ChatTemplate(template.source, tokenizer.token_text("bos"), tokenizer.token_text("eos"))
    else:
        tokenizer = Tokenizer.from_gguf_metadata(runner.metadata)
    name = path.stem if path.suffix == ".gguf" else path.name
    _progress(
        f"loaded {name} in {time.monotonic() - t0:.1f}s: {runner.config.n_layers} layers, "
        f"ctx {runner.config.context_length}, KV pool {runner.num_blocks} x {runner.block_size} tokens"
        + (f" on each of {len(runners)} replicas ({', '.join(replica_devices(cfg))})" if len(runners) > 1 else "")
    )
    engine = Engine(cfg, runners, tokenizer, template, name)
    engine.defaults = ModelDefaults.from_metadata(runner.metadata)
    engine.model_path = path
    return engine


async def _serve(cfg: ServerConfig, engine: Engine) -> None:
    app = create_app(engine, api_key=cfg.api_key)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True)
    await site.start()
    _progress(f"serving on http://{cfg.host}:{cfg.port}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except NotImplementedError:  # pragma: no cover - non-unix
            pass
    await stop.wait()
    engine.draining = True
    _progress("shutting down")
    await runner.cleanup()


def serve(cfg: ServerConfig) -> None:
    logging.basicConfig(
        level=getattr(logging, cfg.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    engine = load_engine(cfg)
    try:
        import uvloop

        uvloop.run(_serve(cfg, engine))
    except ImportError:  # pragma: no cover
        asyncio.run(_serve(cfg, engine))
