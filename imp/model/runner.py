"""ModelRunner: one model, one paged KV cache, one step at a time.

The executor calls `step()` from a worker thread; the step itself runs on the
process's one OpenMP-team thread (`imp.model.team`: two threads starting parallel
regions halve the CPU forward's speed), and a lock makes concurrent calls queue
rather than interleave (the cache is shared state). Torch and the Numba kernels
(nogil) release the GIL while they compute, so the event loop keeps running.

Weights: `"gguf"` (the default for a GGUF file) runs `fused.FusedModel`, the
Numba kernels over the file's own blocks with an fp16 KV cache; a file with a
matrix type those kernels lack, and an HF directory, fall back to the torch
forward with `"int8"` weights. `"f32"` / `"bf16"` / `"int8"` / `"hybrid"` pick
the torch forward explicitly (llama.py explains them; "f32" is the reference).

Threads: `num_threads` (default: torch's count, which `--threads` sets at
boot) for torch and for Numba. Numba's count is per calling thread, so it is
set again on the thread that runs each step (the team's).
"""

from __future__ import annotations

import threading
from pathlib import Path
from imp.messages import SampledToken, SeqWork
from imp.model.fused import FusedModel, Unsupported
from imp.model.gemma3 import Gemma3
from imp.formats.gguf_loader import ModelConfig, open_gguf
from imp.model.llama import KVCache, Llama, default_num_blocks, make_plan
from imp.model.qwen2 import Qwen2
from imp.model.qwen3 import Qwen3
from imp.model import team
from imp.model.rows import head_rows, with_prompt_logprobs
from imp.sampling.cpu import sample

import numba
import torch

DEFAULT_KV_TOKENS = 16384
# `general.architecture` (or config.json's model_type, see hf_dir.py) -> forward.
# Each has Llama's interface: (cfg, tensors, weights, compile), .cfg, .forward(tokens, plan, cache).
ARCHS = {"llama": Llama, "qwen2": Qwen2, "qwen3": Qwen3, "gemma3": Gemma3}


class ModelRunner:
    def __init__(
        self,
        model: Llama,
        metadata: dict,
        fingerprint: str,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype = torch.float32,
        num_threads: int | None = None,
    ):
        self.model = model
        self.config: ModelConfig = model.cfg
        self.metadata = metadata
        self.fingerprint = fingerprint
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.cache = KVCache.allocate(self.config, num_blocks, block_size, kv_dtype)
        self._lock = threading.Lock()
        self.num_threads = min(num_threads or torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)

    @property
    def step_pool(self):
        """Where steps run (imp.model.team): the executor actor submits them here directly."""
        return team.pool()

    def _threads(self) -> None:
        if numba.get_num_threads() != self.num_threads:
            numba.set_num_threads(self.num_threads)

    @classmethod
    def load(
        cls,
        path: str,
        num_blocks: int | None = None,
        block_size: int = 16,
        kv_tokens: int | None = None,
        weights: str = "gguf",
        kv_dtype: torch.dtype | None = None,
        num_threads: int | None = None,
        compile: bool = False,
    ) -> ModelRunner:
        """Open the file and build the model, on the team's thread: torch ops on large
        tensors here (RoPE tables, dequantized fallbacks) start parallel regions too."""
        return team.run(cls._load, path, num_blocks, block_size, kv_tokens, weights, kv_dtype, num_threads, compile)

    @classmethod
    def _load(cls, path, num_blocks, block_size, kv_tokens, weights, kv_dtype, num_threads, compile) -> ModelRunner:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if Path(path).is_dir():  # HF layout: config.json + *.safetensors, same tensor names as a GGUF
            from imp.formats.hf_dir import open_hf_dir

            g = open_hf_dir(path)
        else:
            g = open_gguf(path)  # tensors are dequantized lazily, one at a time, as the model asks
        if g.arch not in ARCHS:
            raise ValueError(f"{path}: architecture {g.arch!r} not supported (have {tuple(ARCHS)})")
        if num_blocks is None:
            num_blocks = default_num_blocks(kv_tokens or DEFAULT_KV_TOKENS, block_size)
        model = None
        if weights == "gguf":
            try:
                model = FusedModel(g.config, g.tensors)
            except Unsupported:
                weights = "int8"
        if model is None:
            model = ARCHS[g.arch](g.config, g.tensors, weights=weights, compile=compile)
        if kv_dtype is None:
            kv_dtype = torch.float16 if isinstance(model, FusedModel) else torch.float32
        del g.tensors  # the torch models hold their own copies; the fused one its own view of the map
        return cls(model, g.metadata, g.fingerprint, num_blocks, block_size, kv_dtype, num_threads)

    def _prepare(self, seqs: list[SeqWork]):
        assert seqs, "empty step"
        ctx = self.config.context_length
        for s in seqs:
            end = s.start_pos + len(s.token_ids)
            if end > ctx:
                raise ValueError(f"{s.seq_id}: position {end - 1} beyond context length {ctx}")
            if max(s.block_table[: (end - 1) // self.block_size + 1], default=0) >= self.num_blocks:
                raise ValueError(f"{s.seq_id}: block id out of range (num_blocks={self.num_blocks})")
        plan = make_plan(
            [s.start_pos for s in seqs],
            [len(s.token_ids) for s in seqs],
            [s.block_table for s in seqs],
            self.block_size,
        )
        tokens = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.int64)
        return tokens, plan

    def _lora_args(self, seqs: list[SeqWork], lora) -> dict:
        """The forward's lora argument for the seqs' adapters (none: no argument at all)."""
        if not lora or not any(w.params is not None and w.params.lora for w in seqs):
            return {}
        if not self.supports_lora:
            raise ValueError("LoRA needs the fused GGUF forward")
        return {"lora": (*lora.packed()[:4], lora.row_slots(seqs))}

    def forward(self, seqs: list[SeqWork], lora=None) -> torch.Tensor:
        """All new tokens of all seqs in one forward -> fp32 logits [B, vocab] at each last position."""
        tokens, plan = self._prepare(seqs)
        kw = self._lora_args(seqs, lora)
        return team.run(self._forward, tokens, plan, kw)

    def _forward(self, tokens, plan, kw):
        with self._lock:
            self._threads()
            return self.model.forward(tokens, plan, self.cache, **kw)

    supports_lora = property(lambda self: isinstance(self.model, FusedModel))

    def step(self, seqs: list[SeqWork], constraints=None, lora=None) -> list[SampledToken]:
        """forward + sampling, one SampledToken per seq with sample=True or prompt_logprobs >= 0.

        A seq with prompt_logprobs >= 0 also gets its chunk's prompt tokens scored
        (SampledToken.prompt); if it samples nothing this step, token_id is -1.
        constraints (imp.constrain.book.ConstraintBook): masks constrained rows' logits
        right before sampling. lora (imp.model.lora.LoraTable): the adapters that seqs'
        params.lora name.
        """
        return team.run(self._step, seqs, constraints, lora)

    def _step(self, seqs: list[SeqWork], constraints, lora) -> list[SampledToken]:
        tokens, plan = self._prepare(seqs)
        rows, sample_at, plp_at = head_rows(seqs)
        plan.last_rows = torch.tensor(rows, dtype=torch.int64)
        kw = self._lora_args(seqs, lora)
        logits = self._forward(tokens, plan, kw)  # [len(rows), vocab]
        order = sorted(sample_at)
        drawn = {}
        if order:
            idx, works = [sample_at[i] for i in order], [seqs[i] for i in order]
            # the forward's logits are a fresh tensor: when every row is sampled in order and none is
            # scored for prompt logprobs (read below), sample from it as it is instead of a copy
            whole = not plp_at and idx == list(range(logits.shape[0]))
            sel = logits if whole else logits[idx]
            if constraints is not None:
                constraints.apply(sel, works)
            drawn = dict(zip(order, sample(sel, works, own=True)))
        return with_prompt_logprobs(seqs, drawn, plp_at, logits)
