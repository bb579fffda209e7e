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

Threads: `num_threads` (default: one per physical core, `team.default_threads`)
for Numba and, where a torch forward runs, torch. Numba's count is per calling
thread, so it is set again on the thread that runs each step (the team's).

torch: only the fallback and reference forwards import it (imp/model/paged.py
says why). The fused forward gets numpy tokens, a `paged.RowsPlan` and a
`paged.HostKV` pool; every forward's logits reach the sampler as numpy.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from imp.messages import LensLayer, SampledToken, SeqWork
from imp.model.fused import FusedModel, Unsupported
from imp.formats.gguf_loader import ModelConfig, open_gguf
from imp.model import paged, team
from imp.model.governor import Governor, GovernorConfig
from imp.model.paged import default_num_blocks
from imp.model.rows import head_rows, host, with_prompt_logprobs
from imp.sampling.cpu import apply_bans, apply_guidance, sample
from imp.sampling.mirostat import MirostatState
from imp.sampling.verify import verify

import msgspec
import numba
import numpy as np

DEFAULT_KV_TOKENS = 16384
# `general.architecture` (or config.json's model_type, see hf_dir.py) -> the torch forward's
# module and class. Each has Llama's interface: (cfg, tensors, weights, compile), .cfg,
# .forward(tokens, plan, cache).
ARCHS = {"llama": ("llama", "Llama"), "qwen2": ("qwen2", "Qwen2"), "qwen3": ("qwen3", "Qwen3"),
         "gemma3": ("gemma3", "Gemma3")}


def _need_torch(why: str) -> None:
    """torch is an extra (`pip install 'imp[torch]'`): the default CPU server never needs it."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise RuntimeError(f"{why}; torch is not installed: pip install 'imp[torch]' (or 'imp[gpu]')")


def torch_forward(arch: str):
    import importlib

    module, name = ARCHS[arch]
    return getattr(importlib.import_module(f"imp.model.{module}"), name)


class ModelRunner:
    def __init__(
        self,
        model,
        metadata: dict,
        fingerprint: str,
        num_blocks: int,
        block_size: int,
        kv_dtype="float32",
        num_threads: int | None = None,
        adaptive_threads: bool = False,
    ):
        self.model = model
        self.config: ModelConfig = model.cfg
        self.metadata = metadata
        self.fingerprint = fingerprint
        self.layout_tag = ""  # ":w=q8_0" where --weights converted the matrices: their KV is another model's
        self.weights_note = ""  # what --weights did, for the server's load line
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.fused = isinstance(model, FusedModel)
        if self.fused:
            self.cache = paged.HostKV.allocate(self.config, num_blocks, block_size, kv_dtype)
        else:
            import torch

            from imp.model.llama import KVCache

            dt = kv_dtype if isinstance(kv_dtype, torch.dtype) else getattr(torch, paged.dtype_name(kv_dtype))
            self.cache = KVCache.allocate(self.config, num_blocks, block_size, dt)
        self._lock = threading.Lock()
        self._mirostat = MirostatState()  # mirostat's mu by sequence, from step to step
        self.num_threads = min(num_threads or team.default_threads(), numba.config.NUMBA_NUM_THREADS)
        self.governor = Governor(GovernorConfig(self.num_threads, len(os.sched_getaffinity(0))),
                                 enabled=adaptive_threads and self.fused)

    @property
    def step_pool(self):
        """Where steps run (imp.model.team): the executor actor submits them here directly."""
        return team.pool()

    def _threads(self) -> None:
        n = self.governor.threads()  # all num_threads, or one while a neighbour has the cores
        if numba.get_num_threads() != n:
            numba.set_num_threads(n)

    @classmethod
    def load(
        cls,
        path: str,
        num_blocks: int | None = None,
        block_size: int = 16,
        kv_tokens: int | None = None,
        weights: str = "gguf",
        kv_dtype=None,
        num_threads: int | None = None,
        compile: bool = False,
        adaptive_threads: bool = False,
        requant: str = "native",
    ) -> ModelRunner:
        """Open the file and build the model, on the team's thread: torch ops on large
        tensors here (RoPE tables, dequantized fallbacks) start parallel regions too.
        kv_dtype: "float16" / "float32" (or the torch dtype); None: fp16 for the fused
        forward, fp32 for the torch ones."""
        return team.run(cls._load, path, num_blocks, block_size, kv_tokens, weights, kv_dtype, num_threads, compile,
                        adaptive_threads, requant)

    @classmethod
    def _load(cls, path, num_blocks, block_size, kv_tokens, weights, kv_dtype, num_threads, compile,
              adaptive_threads=False, requant="native") -> ModelRunner:
        if Path(path).is_dir():  # HF layout: config.json + *.safetensors, same tensor names as a GGUF
            if requant != "native":
                raise ValueError(f"--weights {requant} converts a GGUF's matrices; {path} is an HF folder")
            _need_torch(f"{path} is an HF model folder: its weights load through torch")
            from imp.formats.hf_dir import open_hf_dir

            g = open_hf_dir(path)
        else:
            g = open_gguf(path, requant=requant)  # tensors dequantized lazily, one at a time, as the model asks
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
            _need_torch(f"{path}: the fused CPU kernels do not cover this model's matrix types (or "
                        f"--weights {weights} was asked for), so it runs on the torch forward")
            import torch

            if num_threads is not None:
                torch.set_num_threads(num_threads)
            model = torch_forward(g.arch)(g.config, g.tensors, weights=weights, compile=compile)
        if kv_dtype is None:
            kv_dtype = "float16" if isinstance(model, FusedModel) else "float32"
        rq = getattr(g.tensors, "requant", None)
        del g.tensors  # the torch models hold their own copies; the fused one its own view of the map
        runner = cls(model, g.metadata, g.fingerprint, num_blocks, block_size, kv_dtype, num_threads, adaptive_threads)
        if rq is not None:
            runner.layout_tag, runner.weights_note = rq.layout_tag(), rq.summary()
        return runner

    def _prepare(self, seqs: list[SeqWork]):
        assert seqs, "empty step"
        ctx = self.config.context_length
        for s in seqs:
            end = s.start_pos + len(s.token_ids)
            if end > ctx:
                raise ValueError(f"{s.seq_id}: position {end - 1} beyond context length {ctx}")
            if max(s.block_table[: (end - 1) // self.block_size + 1], default=0) >= self.num_blocks:
                raise ValueError(f"{s.seq_id}: block id out of range (num_blocks={self.num_blocks})")
        args = ([s.start_pos for s in seqs], [len(s.token_ids) for s in seqs], [s.block_table for s in seqs],
                self.block_size)
        tokens = np.fromiter((t for s in seqs for t in s.token_ids), np.int64)
        if self.fused:
            return tokens, paged.rows_plan(*args)
        import torch

        from imp.model.llama import make_plan

        return torch.from_numpy(tokens), make_plan(*args)

    def _lora_args(self, seqs: list[SeqWork], lora) -> dict:
        """The forward's lora argument for the seqs' adapters (none: no argument at all)."""
        if not lora or not any(w.params is not None and w.params.lora for w in seqs):
            return {}
        if not self.supports_lora:
            raise ValueError("LoRA needs the fused GGUF forward")
        return {"lora": (*lora.packed()[:4], lora.row_slots(seqs))}

    def forward(self, seqs: list[SeqWork], lora=None) -> np.ndarray:
        """All new tokens of all seqs in one forward -> fp32 logits [B, vocab] at each last position."""
        tokens, plan = self._prepare(seqs)
        kw = self._lora_args(seqs, lora)
        return team.run(self._forward, tokens, plan, kw)

    def _forward(self, tokens, plan, kw):
        with self._lock:
            self._threads()
            out = self.model.forward(tokens, plan, self.cache, **kw)
            if "keep_rows" in kw:  # (logits, residuals): the logit lens (fused only)
                return out
            return host(out)  # torch forwards: to numpy

    # the logit lens reads each layer's residual (FusedModel.forward keep_rows): the fused GGUF forward only
    supports_logit_lens = property(lambda self: self.fused)

    # the prefix cache's disk tier (imp.actors.kvtier) copies whole blocks of the host pool: the fused forward's
    supports_kv_tier = property(lambda self: self.fused)

    def kv_layout(self) -> str:
        """What a saved block's bytes mean: the pool's dtype and a block's [layers, positions, kv heads, dim]."""
        c = self.cache
        dt = str(getattr(c, "dtype", c.k.dtype)).removeprefix("torch.")  # the torch forward's KVCache: its tensors'
        return f"{dt}:{'x'.join(str(n) for n in (c.k.shape[0], *c.k.shape[2:]))}{self.layout_tag}"

    def kv_block_bytes(self) -> int:
        c = self.cache
        return 2 * c.k[:, 0].nbytes

    def kv_block(self, b: int) -> bytes:
        """Block b's K then V, every layer (a copy)."""
        with self._lock:
            c = self.cache
            return np.ascontiguousarray(c.k[:, b]).tobytes() + np.ascontiguousarray(c.v[:, b]).tobytes()

    def set_kv_block(self, b: int, data: bytes) -> None:
        c = self.cache
        half = len(data) // 2
        shape = c.k[:, b].shape
        with self._lock:
            c.k[:, b] = np.frombuffer(data, dtype=c.k.dtype, count=half // c.k.itemsize).reshape(shape)
            c.v[:, b] = np.frombuffer(data, dtype=c.v.dtype, offset=half).reshape(shape)

    # swap instead of recompute (imp.core.kv "swap_out" / "swap_in"): whole blocks of the host pool, as the tier
    supports_swap = property(lambda self: self.fused)

    def make_swap(self, n_slots: int) -> None:
        """The swap area: n_slots blocks' K and V beside the pool, in lazy zero pages (only what preempted
        sequences park is ever touched)."""
        c = self.cache
        shape = (c.k.shape[0], n_slots, *c.k.shape[2:])
        self._swap = (paged.lazy_zeros(shape, c.k.dtype), paged.lazy_zeros(shape, c.v.dtype))

    def swap_out(self, m) -> None:
        """KvSwapOut: blocks -> swap slots."""
        (sk, sv), c, b, s = self._swap, self.cache, list(m.blocks), list(m.slots)
        with self._lock:
            sk[:, s] = c.k[:, b]
            sv[:, s] = c.v[:, b]

    def swap_in(self, m) -> None:
        """KvSwapIn: swap slots -> blocks."""
        (sk, sv), c, b, s = self._swap, self.cache, list(m.blocks), list(m.slots)
        with self._lock:
            c.k[:, b] = sk[:, s]
            c.v[:, b] = sv[:, s]

    supports_lora = property(lambda self: isinstance(self.model, FusedModel))
    # a share may feed drafted tokens (SeqWork.draft): every forward here scores any rows asked for
    verifies_drafts = True

    def step(self, seqs: list[SeqWork], constraints=None, lora=None) -> list[SampledToken]:
        """forward + sampling, one SampledToken per seq with sample=True or prompt_logprobs >= 0.

        A seq with prompt_logprobs >= 0 also gets its chunk's prompt tokens scored
        (SampledToken.prompt); if it samples nothing this step, token_id is -1.
        constraints (imp.constrain.book.ConstraintBook): masks constrained rows' logits
        right before sampling. lora (imp.model.lora.LoraTable): the adapters that seqs'
        params.lora name.
        """
        return team.run(self._step, seqs, constraints, lora)

    def forget(self, seq_ids) -> None:
        """Freed sequences (the executor passes each plan's `freed`): their mirostat state goes."""
        self._mirostat.forget(seq_ids)

    def _step(self, seqs: list[SeqWork], constraints, lora) -> list[SampledToken]:
        seqs = self._mirostat.fill(seqs)
        out = self._sampled(seqs, constraints, lora)
        self._mirostat.keep(out)
        return out

    def _sampled(self, seqs: list[SeqWork], constraints, lora) -> list[SampledToken]:
        tokens, plan = self._prepare(seqs)
        rows, sample_at, plp_at = head_rows(seqs)
        plan.last_rows = np.asarray(rows, dtype=np.int64)
        if not self.fused:
            import torch

            plan.last_rows = torch.from_numpy(plan.last_rows)
        kw = self._lora_args(seqs, lora)
        lens = [i for i in sample_at if seqs[i].params.logit_lens > 0 and not seqs[i].draft]
        if lens:
            if not self.supports_logit_lens:
                raise ValueError("the logit lens needs the fused GGUF forward")
            kw["keep_rows"] = [rows[sample_at[i]] for i in lens]
            logits, resid = self._forward(tokens, plan, kw)
        else:
            logits = self._forward(tokens, plan, kw)  # [len(rows), vocab]
        drawn = {}
        for i in [i for i in sample_at if seqs[i].draft]:  # verify shares: each its draft + 1 rows
            w, first = seqs[i], sample_at.pop(i)
            drawn[i] = verify(logits[first:first + w.draft + 1], w, constraints)
        order = sorted(sample_at)
        if order:
            idx, works = [sample_at[i] for i in order], [seqs[i] for i in order]
            # the forward's logits are a fresh tensor: when every row is sampled in order and none is
            # scored for prompt logprobs (read below), sample from it as it is instead of a copy
            whole = not plp_at and idx == list(range(logits.shape[0]))
            sel = logits if whole else logits[idx]
            if any(w.guide for w in works):
                apply_guidance(sel, works)
            if constraints is not None:
                constraints.apply(sel, works)
            if any(w.banned for w in works):  # sel is its own rows (a copy, or logits no plp row reads)
                apply_bans(sel, works)
            drawn.update(zip(order, sample(sel, works, own=True)))
        for k, i in enumerate(lens):  # the sampled token's rank and logprob at every layer
            t = drawn[i]
            layers = self.model.lens(resid[:, k], t.token_id, seqs[i].params.logit_lens)
            drawn[i] = msgspec.structs.replace(t, lens=tuple(LensLayer(r, lp, e, tuple(top))
                                                             for r, lp, e, top in layers))
        return with_prompt_logprobs(seqs, drawn, plp_at, logits)
