"""GpuModelRunner: the CPU ModelRunner's interface on one CUDA device.

Weights are uploaded once, kept in their GGUF quantization (repacked for
aligned loads, `imp.kernels.cuda.gemv_fp32_act`); the KV cache is paged in device memory
([n_layers, num_blocks, block_size, Hkv, D], bf16 by default). The same
`SeqWork` list goes in, the same `SampledToken` list comes out.

A step takes one of three paths:
  decode graph: every sequence feeds one token and samples it, and the batch
      fits a captured bucket (1, 2, 4, ... max_graph_batch). Inputs go into
      static device buffers in ONE host->device copy; the whole forward
      (embedding, 9 kernels a layer, head) replays as one CUDA graph.
  mixed graph: prompt chunks, alone or beside one-token rows, within the
      captured (prompt rows, decode rows) buckets (`imp.gpu.mixed`): the
      same, one graph per bucket pair (bf16 cache).
  eager: anything else (prompt logprobs, LoRA adapter rows, past the
      buckets, a few prompt tiles over a long context): the same kernels
      launched one by one; the prompt rows' attention in one
      `paged_prefill_attention` launch a layer, its key segments side by side
      where the tiles are few (torch SDPA per chunk for an fp32 cache).
A verify share (speculation) runs its drafted positions as one-token rows of
one of these (`_verify_step`).

Per layer (decode): add+RMSNorm -> QKV GEMV -> RoPE -> KV write (Numba) ->
paged attention -> O GEMV -> add+RMSNorm -> gate/up GEMV -> SiLU*up -> down
GEMV. Each matmul picks, per batch size, the quantized GEMV or a dense
cuBLAS GEMM over a dequantized fp16 copy (bf16 weights: the weights
themselves), whichever times faster at load (`Linear.choose`, graph-replayed
over the layers' copies of the matrix so that none is timed from L2). BF16
weights also have `gemv_bf16_fused.gemv_bf16x` (two rows a warp, variants x4/x8/a4/k4);
where it wins, the QKV GEMV also applies RoPE and writes k/v into the cache,
and the gate/up GEMV writes SiLU(gate)*up: 7 kernels a layer instead of 10.
Outside graphs the KV write is the CuPy kernel (a Numba launch costs ~0.45 ms
of host time: 14 ms of a 512-token 8B prefill).

Pipelining: `launch(seqs)` enqueues a whole step (inputs, forward, sampling,
the sampled ids' copy to pinned host memory) and returns a handle without
waiting; `collect(handle)` waits for that step and returns its tokens
(`step` = both). The sampled ids also stay in a device buffer, so the next
step, launched before this one finishes, feeds them where its SeqWork says
PENDING_TOKEN (`imp.kernels.cuda.fill_pending_tokens`, inside the decode graph). Host input
buffers alternate so that writing step N+1's inputs never races step N's
copy still queued on the stream.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import numpy as np
import torch

from imp.formats.gguf_loader import ModelConfig
from imp.gpu.forward import Forward
from imp.gpu.graphs import DecodeGraphs
from imp.gpu.lora import DeviceLoras
from imp.gpu.inputs import Landing, StaticInputs, VerifyLanding, eager_meta
from imp.gpu.tables import Rows, Tables
from imp.gpu.kvcopy import DeviceBlocks
from imp.gpu.mixed import MixedGraphs, prompt_buckets
from imp.gpu.linear import FUSED_CREDIT_US, GEMV_MAX_ROWS
from imp.gpu.weights import GGUFSource, Weights, load_weights
from imp.kernels.cuda import runtime as cuda_rt
from imp.kernels.cuda import kv_write as k_kv
from imp.kernels.cuda import paged_decode_mma as k_mma
from imp.kernels.cuda import paged_decode_split as k_split
from imp.kernels.cuda.gemm_int8_act_tiles import sm_count
from imp.messages import PENDING_TOKEN, LensLayer, SampledToken, SeqWork
from imp.model.llama import default_num_blocks, rope_tables
from imp.model.rows import head_rows, with_prompt_logprobs
from imp.model.runner import DEFAULT_KV_TOKENS
from imp.sampling import gpu as sampler
from imp.sampling import pending
from imp.sampling.counts import DraftCounts, HistoryCounts
from imp.sampling.devcounts import DeviceCounts
from imp.sampling.rowparams import RowParams, Step
from imp.sampling.cpu import apply_bans, apply_guidance
from imp.sampling.mirostat import MirostatState
from imp.sampling.verify import drafts, kept, verify
from imp.sampling.works import Works, seq_ids_of

log = logging.getLogger("imp.gpu")

SUPPORTED_ARCHS = ("llama",)  # the forward of imp.gpu.forward; the CPU runner runs more (imp.model.runner.ARCHS)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_SAMPLED = 4096  # sequences sampled in one step (the device buffer of sampled ids)
RING = 4  # pinned buffers for sampled ids: a step's slot is reused 4 launches later (<= 2 are in flight)


def decode_kernel(choice: str, n_heads: int, n_kv_heads: int, head_dim: int, kv_dtype) -> str:
    """--gpu-decode-attention resolved for a model: "auto" is mma at head dim 128 (the 8B shape: as fast or faster in
    every cell measured, shared prompts read once) where the kernel takes the shape, else split (SmolLM2's D 64:
    mma measured 4-7 % slower at short contexts; imp.config's comment has the figures); the others as named."""
    if choice != "auto":
        return choice
    return "mma" if head_dim == 128 and k_mma.supports(n_heads, n_kv_heads, head_dim, kv_dtype) else "split"


class GpuModelRunner:
    def __init__(self, src: GGUFSource, num_blocks: int, block_size: int, device: str = "cuda:0",
                 kv_dtype=torch.bfloat16, dense: bool | None = None, graphs: bool = True, max_graph_batch: int = 64,
                 tune: bool = True, int8_act: bool = False, batch_invariant: bool = False,
                 max_prompt_rows: int | None = 512, decided: dict | None = None, decode_attention: str = "auto"):
        """decided: what an earlier load of this model decided (dense copies or not, each matmul's kernel), to be
        decided the same again, else filled in here: a model reloaded after a suspend or a swap runs the same
        kernels, so it gives the same tokens and takes the same memory as before, whatever else the card holds
        now (the dense copies are sized against the card's free memory), and skips the timing."""
        cfg: ModelConfig = src.config
        decided = {} if decided is None else decided
        self.config = cfg
        self.metadata = src.metadata
        self.fingerprint = src.fingerprint
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_dtype = kv_dtype
        self.notes: list[str] = []  # what fell back, for the bench/logs
        self.weights_note = src.requant.summary()  # what --weights did, for the server's load line
        self.layout_tag = src.requant.layout_tag()  # a converted model's KV is not the native one's (the disk tier)
        self._lock = threading.Lock()
        if cfg.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"architecture {cfg.arch!r} not supported (have {SUPPORTED_ARCHS})")
        if cfg.extras.get("rope.scaling.type", "none") not in ("none", None):
            raise NotImplementedError("rope scaling not supported yet")
        cuda_rt.use_device(self.device.index or 0)
        self._sampled = torch.zeros(MAX_SAMPLED, dtype=torch.int32, device=self.device)  # last step's ids
        self._prev_sids: list[str] = []  # the last step's sampled seq ids, in _sampled's order (`_prev_rows`)
        self._prev_map: dict[str, int] | None = None
        self._prev_at = np.full(0, -1, np.int64)  # the same by RowParams slot (`_landed`)
        self._start_ev = None  # the step being launched: its start event on the device (`_mark`)
        # the sequences' block tables by slot, the plan's check (imp.gpu.tables)
        self._tables = Tables(cfg.context_length, block_size, num_blocks, -(-cfg.context_length // block_size))
        self._counts = DeviceCounts(cfg.vocab_size, self.device)  # penalty counts kept on the device (imp.sampling.devcounts)
        self._draft_hist = HistoryCounts()  # verify shares' histories counted across steps (`_draft_counts`)
        self._params = RowParams(self.device)  # the sequences' sampling params as columns (imp.sampling.rowparams)
        self._mirostat = MirostatState()  # mirostat's mu by sequence (its rows are sampled on the host)
        self._prev: Landing | None = None
        self._dev_loras = None  # imp.gpu.lora.DeviceLoras, made at the first adapter step
        self._ring = [torch.zeros(MAX_SAMPLED, dtype=torch.int32).pin_memory() for _ in range(RING)]
        self._ring_i = 0
        self.batch_invariant = batch_invariant  # Linear refuses it without int8 activations
        self.w: Weights = load_weights(src, self.device, decided.get("dense", dense), int8_act, batch_invariant,
                                       tuner=decided.get("tuner"))
        decided.update(dense=self.w.dense, tuner=self.w.tuner)  # the tuner's choices land in it as they are made
        Hkv, D = cfg.n_kv_heads, cfg.head_dim
        shape = (cfg.n_layers, num_blocks, block_size, Hkv, D)
        self.k_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        self.blocks = DeviceBlocks(self.k_cache, self.v_cache)  # blocks to host and back (tier, swap)
        cos, sin = rope_tables(cfg, cfg.context_length)
        self.use_numba_sampling = self._self_check_numba()
        self.fwd = Forward(cfg, self.w, self.k_cache, self.v_cache, cos.to(self.device), sin.to(self.device),
                           self._sampled, fuse=kv_dtype in (torch.float32, torch.bfloat16))
        buckets = tuple(b for i, b in enumerate(BUCKETS) if i == 0 or BUCKETS[i - 1] < max_graph_batch)
        decode_attention = decode_kernel(decode_attention, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, kv_dtype)
        if decode_attention == "mma" and not self._mma_decode(max(buckets) if buckets else max_graph_batch):
            decode_attention = "split"
        self.decode_attention = decode_attention  # the kernel every decode row takes (its bits: one a server)
        if decode_attention == "split":
            self._split_decode(max(buckets) if buckets else max_graph_batch)
        self.graphs = DecodeGraphs(buckets, (cfg.context_length + block_size - 1) // block_size, block_size,
                                   self.device)
        if tune:
            credit = {"wqkv": FUSED_CREDIT_US * 2, "w13": FUSED_CREDIT_US} if self.fwd.fuse else {}
            q8_credit = {"wqkv": FUSED_CREDIT_US, "w13": FUSED_CREDIT_US, "w2": FUSED_CREDIT_US}  # quantize fused
            for n in buckets:
                for attr in ("wqkv", "wo", "w13", "w2"):
                    getattr(self.w.layers[0], attr).choose(n, peers=[getattr(L, attr) for L in self.w.layers],
                                                           credit_us=credit.get(attr, 0.0),
                                                           q8_credit_us=q8_credit.get(attr, 0.0))
                self.w.head.choose(n, q8_credit_us=FUSED_CREDIT_US)
        # prompt rows dense (or on the int8 GEMM), decode rows on the int8 GEMV: a mixed eager step runs its
        # matmuls per row kind (_eager_logits); batch invariant: every row is on the GEMM already
        self._split_mixed = not batch_invariant and any(m.q8 and (self.w.dense or m.mm) for L in self.w.layers
                                                        for m in (L.wqkv, L.wo, L.w13, L.w2))
        # steps with prompt rows: graphs per (prompt rows, decode rows) bucket pair (imp.gpu.mixed), for the
        # bf16 cache's paged prefill kernel; None: such steps run eagerly
        self.mixed: MixedGraphs | None = None
        if graphs and buckets and max_prompt_rows and kv_dtype == torch.bfloat16 and cfg.head_dim in (64, 128):
            self.mixed = MixedGraphs(prompt_buckets(max_prompt_rows), buckets, self.graphs.max_blocks, block_size,
                                     cfg.vocab_size, self.device, self._split_mixed,
                                     cfg.n_heads)
        if graphs and buckets:
            self._capture_or_fall_back()

    def _mma_decode(self, rows: int) -> bool:
        """Decode rows' attention on paged_decode_mma (--gpu-decode-attention mma): its buffers for `rows` rows, made
        once here so every captured graph holds the same ones. False (a note, and the split kernel) for a shape it
        has no kernel for."""
        cfg = self.config
        if not k_mma.supports(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, self.kv_dtype) or rows > k_mma.MAX_ROWS:
            self.notes.append(f"mma decode attention: no kernel for H {cfg.n_heads} / Hkv {cfg.n_kv_heads} / D "
                              f"{cfg.head_dim} / {self.kv_dtype}; split")
            log.warning(self.notes[-1])
            return False
        shape = k_mma.Shape.of(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, self.fwd.max_ctx,
                               sm_count(self.device.index or 0))
        self.fwd.mma_work = k_mma.Work(shape, rows, self.device)
        return True

    def _split_decode(self, rows: int) -> None:
        """Decode rows' attention on paged_decode_split (--gpu-decode-attention split): its work buffers for `rows`
        rows, made once here so every captured graph holds the same ones (B x H x segments x (D + 2) floats, and a
        counter a row and KV head that each launch leaves at zero)."""
        cfg = self.config
        G = cfg.n_heads // max(1, cfg.n_kv_heads)
        if G not in k_split.GROUPS or cfg.head_dim not in k_split.DIMS or cfg.n_heads % cfg.n_kv_heads:
            self.notes.append(f"split decode attention: no kernel for H {cfg.n_heads} / Hkv {cfg.n_kv_heads} / D "
                              f"{cfg.head_dim}; paged")
            log.warning(self.notes[-1])
            return
        segs = -(-self.fwd.max_ctx // k_split.seg_keys_for(self.fwd.max_ctx))
        n = rows * cfg.n_heads * segs if segs > 1 else 1
        self.fwd.split_work = (torch.empty(n, 2, dtype=torch.float32, device=self.device),
                               torch.empty(n, cfg.head_dim, dtype=torch.float32, device=self.device),
                               torch.zeros(rows * cfg.n_kv_heads, dtype=torch.int32, device=self.device))
        self.fwd.split_rows = rows

    @classmethod
    def host_only(cls, vocab: int, block_size: int, num_blocks: int, context_length: int, max_batch: int
                  ) -> GpuModelRunner:
        """A runner without a device or a model, for the host's part of a step on CPU tensors (bench/executor_host.py,
        tests): its decode "graphs" lay the inputs out as on a GPU (`StaticInputs.write`) and hand back the logits
        in `host_logits` [max_batch, vocab] instead of replaying a forward; other steps are laid out eagerly
        (`eager_meta`) and get zero logits."""
        r = object.__new__(cls)
        r.config = ModelConfig(arch="llama", n_layers=0, d_model=0, n_heads=0, n_kv_heads=0, head_dim=0, d_ff=0,
                               vocab_size=vocab, context_length=context_length, rope_theta=0.0, rms_eps=0.0,
                               tied_embeddings=False)
        r.num_blocks, r.block_size, r.device = num_blocks, block_size, torch.device("cpu")
        r._lock, r.notes = threading.Lock(), []
        r._sampled = torch.zeros(MAX_SAMPLED, dtype=torch.int32)
        r._prev_sids, r._prev_map, r._start_ev, r._prev, r._dev_loras = [], None, None, None, None
        r._prev_at = np.full(0, -1, np.int64)
        r._tables = Tables(context_length, block_size, num_blocks, -(-context_length // block_size))
        r._counts, r._params, r._mirostat = DeviceCounts(vocab, r.device), RowParams(r.device), MirostatState()
        r._draft_hist = HistoryCounts()
        r._ring, r._ring_i = [torch.zeros(MAX_SAMPLED, dtype=torch.int32) for _ in range(RING)], 0
        r.use_numba_sampling, r.mixed = False, None
        buckets = tuple(b for i, b in enumerate(BUCKETS) if i == 0 or BUCKETS[i - 1] < max_batch)
        r.graphs = DecodeGraphs(buckets, (context_length + block_size - 1) // block_size, block_size, r.device)
        r.graphs.inputs = StaticInputs(max(buckets), r.graphs.max_blocks, block_size, r.device)
        r.host_logits = torch.zeros(max(buckets), vocab)
        r.graphs.graphs = {b: (_NoGraph(), r.host_logits[:b]) for b in buckets}
        r._split_mixed = False  # eager steps (prompts): zero logits for their head rows
        r.fwd = lambda meta, lora=None: torch.zeros(meta.out_rows.shape[0], vocab)
        return r

    # ------------------------------------------------------------------ load

    @classmethod
    def load(cls, path: str, num_blocks: int | None = None, block_size: int = 16, kv_tokens: int | None = None,
             device: str = "cuda:0", requant: str = "native", **kw) -> "GpuModelRunner":
        """requant: --weights (imp.formats.requant: "q8_0" uploads a BF16 / F16 / F32 model's matrices as Q8_0)."""
        src = GGUFSource(path, requant)
        if src.config.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"{path}: architecture {src.config.arch!r} not supported (have {SUPPORTED_ARCHS})")
        if num_blocks is None:
            num_blocks = default_num_blocks(kv_tokens or DEFAULT_KV_TOKENS, block_size)
        return cls(src, num_blocks, block_size, device, **kw)

    def _self_check_numba(self) -> bool:
        """Numba on a tiny case (its KV write kernel); torch penalties in the sampler (noted) if Numba CUDA is
        unusable. The forward's KV write is CuPy's (imp.kernels.cuda.rope.rope_kv)."""
        try:
            W = 8
            k = torch.randn(3, W, device=self.device)
            v = torch.randn(3, W, device=self.device)
            kc = torch.zeros(4, W, dtype=self.kv_dtype, device=self.device)
            vc = torch.zeros_like(kc)
            slots = torch.tensor([2, -1, 0], dtype=torch.int32, device=self.device)
            k_kv.kv_write(k, v, kc, vc, slots)
            rk, rv = k_kv.reference(k, v, torch.zeros_like(kc), torch.zeros_like(vc), slots)
            torch.cuda.synchronize(self.device)
            if not (torch.equal(kc, rk) and torch.equal(vc, rv)):
                raise RuntimeError("numba kv_write mismatch")
            return True
        except Exception as e:  # noqa: BLE001
            self.notes.append(f"numba unavailable, torch penalties: {type(e).__name__}: {str(e)[:200]}")
            log.warning(self.notes[-1])
            return False

    def _capture_or_fall_back(self) -> None:
        """Capture the decode graphs; on failure decode eagerly (noted)."""
        try:
            self.graphs.capture(self.fwd)
        except Exception as e:  # noqa: BLE001
            self.graphs.graphs.clear()
            self.notes.append(f"graph capture failed, eager decode: {type(e).__name__}: {str(e)[:200]}")
            log.warning(self.notes[-1])
            torch.cuda.synchronize(self.device)
        if self.mixed is None:
            return
        try:
            self.mixed.capture(self.fwd)
        except Exception as e:  # noqa: BLE001
            self.mixed = None
            self.notes.append(f"mixed-step graph capture failed, eager prompts: {type(e).__name__}: {str(e)[:200]}")
            log.warning(self.notes[-1])
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def prompt_costs(self) -> tuple[tuple[int, int, int], ...]:
        """What the mixed graphs' prompt-row buckets add to a decode-only step, per decode-row bucket
        ((Pb, Db, ns), imp.gpu.mixed `MixedGraphs.costs`); () without both kinds of graphs. Boot only."""
        if self.mixed is None or not self.mixed.graphs or not self.graphs.graphs:
            return ()
        torch.cuda.synchronize(self.device)  # nothing in flight reads the static inputs made inert below
        self.graphs.inputs.inert()
        out = self.mixed.costs({db: g.replay for db, (g, _) in self.graphs.graphs.items()})
        torch.cuda.synchronize(self.device)
        return out

    @torch.inference_mode()
    def prompt_ctx_ns(self) -> int:
        """What a prompt row's attention adds per 1,000 positions of context (`MixedGraphs.ctx_ns`), beside
        `prompt_costs`' table of inert rows; 0 without mixed graphs. Boot only (it reads the pool's blocks)."""
        if self.mixed is None or not self.mixed.graphs:
            return 0
        torch.cuda.synchronize(self.device)
        out = self.mixed.ctx_ns(self.num_blocks)
        torch.cuda.synchronize(self.device)
        return out

    # ------------------------------------------------------------------ interface

    @torch.inference_mode()
    def forward(self, seqs: list[SeqWork], lora=None) -> torch.Tensor:
        """fp32 logits [B, vocab] (on the device) at each sequence's last new token."""
        self._check(seqs)
        rows, base = [], 0
        for s in seqs:
            base += len(s.token_ids)
            rows.append(base - 1)
        with self._lock:
            cuda_rt.use_device(self.device.index or 0)
            la = self._lora_arg(seqs, lora)
            return self.fwd(eager_meta(seqs, rows, self.block_size, self.device), lora=la).clone()

    supports_lora = True  # adapter rows run eagerly and unfused (imp.gpu.lora)

    # the prefix cache's disk tier and the swap area: the pool's blocks to host and back (imp.gpu.kvcopy), queued
    # on the step stream, in order with the steps (a tier load's from its read thread: see kv_fill_anywhere)
    supports_kv_tier = supports_swap = True
    kv_block_bytes = property(lambda self: self.blocks.block_bytes)

    def kv_layout(self) -> str:
        """What a saved block's bytes mean: the pool's dtype and shape, and `:w=q8_0` under --weights q8_0."""
        return self.blocks.layout() + self.layout_tag

    def kv_block(self, b: int):
        with self._lock:
            return self.blocks.block(b)

    def kv_staging(self):
        return self.blocks.staging()

    def kv_unstage(self, buf) -> None:
        self.blocks.unstage(buf)

    kv_fill_anywhere = True  # a tier load's copies may be queued from a read thread (the block is held meanwhile)

    def set_kv_block(self, b: int, data) -> None:
        with self._lock:
            cuda_rt.use_device(self.device.index or 0)  # per thread: a read thread starts on device 0
            self.blocks.set_block(b, data)

    # tier loads a chunk at a time (imp.gpu.kvcopy.DeviceBlocks.set_blocks): read side by side into one pinned
    # buffer, one copy up and one launch to place them
    kv_chunk_blocks = property(lambda self: self.blocks.chunk_blocks)

    def kv_chunk_staging(self):
        return self.blocks.chunk_staging()

    def kv_chunk_unstage(self, chunk) -> None:
        self.blocks.chunk_unstage(chunk)

    def set_kv_blocks(self, chunk, placed: list[tuple[int, int]]) -> None:
        with self._lock:  # the chunk's copies and launch in one run on the stream (the device chunk is reused)
            cuda_rt.use_device(self.device.index or 0)
            self.blocks.set_blocks(chunk, placed)

    def make_swap(self, n_slots: int) -> None:
        self.blocks.make_swap(n_slots)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def swap_out(self, m) -> None:
        with self._lock:
            self.blocks.swap_out(m.blocks, m.slots)

    def swap_in(self, m) -> None:
        with self._lock:
            self.blocks.swap_in(m.slots, m.blocks)

    def forget(self, seq_ids) -> None:
        """Freed sequences (the executor passes each plan's `freed`): their penalty counts and mirostat state go."""
        self._counts.forget(seq_ids)
        self._draft_hist.forget(seq_ids)
        self._params.forget(seq_ids)
        self._mirostat.forget(seq_ids)
        self._tables.forget(seq_ids)

    def step(self, seqs: list[SeqWork], constraints=None, lora=None) -> list[SampledToken]:
        return self.collect(self.launch(seqs, constraints, lora))

    def collect(self, h: Landing) -> list[SampledToken]:
        """Wait for a launched step; its tokens, in the order of its sampled shares."""
        if h.tokens is not None:
            return h.tokens
        return [SampledToken(seq_id=sid, token_id=t) for sid, t in zip(h.seq_ids, h.ids())]

    # a plan's decode rows come as columns (`imp.sampling.works.Works`), and a step lands as ids (`collect_ids`)
    takes_rows = True

    def collect_ids(self, h: Landing) -> tuple[list[str] | None, np.ndarray | None, list[SampledToken] | None]:
        """Wait for a launched step: (its sampled shares' seq ids, their ids int64, None), or (None, None, its
        tokens) where the step made SampledTokens (a verify, the lens, host-sampled rows)."""
        if h.tokens is not None:
            return None, None, h.tokens
        return h.seq_ids, h.ids_array(), None

    @torch.inference_mode()
    def launch(self, seqs: list[SeqWork], constraints=None, lora=None) -> Landing:
        """Enqueue one step on the device and return without waiting for it.

        A share feeding PENDING_TOKEN whose sequence the previous step did not
        sample (that step failed: the scheduler has ended it) is left out.
        constraints (imp.constrain.book.ConstraintBook): masks the constrained
        rows' logits before sampling; such a row's history must be complete, so
        a constrained share feeding PENDING_TOKEN waits for the previous step's
        ids on the host (as a penalized one does) while this step's forward runs.
        lora (imp.model.lora.LoraTable): the adapters the seqs' params.lora name; a step with
        adapter rows runs eagerly (no graph), every projection getting its rows' deltas.
        """
        tr = self._check(seqs)
        step = self._params.take(seqs)  # the shares' flags and params as columns (imp.sampling.rowparams)
        with self._lock:
            if self.device.type == "cuda":  # (CPU tensors: `host_only`)
                cuda_rt.use_device(self.device.index or 0)  # per thread: the executor's thread starts on device 0
            self._start_ev = None  # recorded by `_mark` once the host has laid the step out
            try:
                h = self._launch(seqs, constraints, lora, tr, step)
            except BaseException:
                self._prev_sids, self._prev_map, self._prev = [], None, None  # nothing to feed the next step from
                self._prev_at[:] = -1
                raise
            h.start = self._start_ev
            return h

    def _mark(self) -> None:
        """The step's start on the device: recorded after the host's part (its inputs laid out), right before
        its first device work, so it runs once the step before it is done (pipelined) or at once (the device
        idle). Recorded before the host's part, a host-bound step's layout time counted as device time: small
        prompt chunks looked three times their cost and the ITL budget cut them smaller still (issue 33)."""
        if getattr(self, "_start_ev", None) is None and self.device.type == "cuda":  # (CPU tests: no events)
            self._start_ev = torch.cuda.Event(enable_timing=True)
            self._start_ev.record()

    @staticmethod
    def device_ns(h: Landing) -> int:
        """The device's own time for a collected step (its start event to its landing event), 0 where the
        step was finished on the host (verify, lens, prompt logprobs: their wall time is theirs). Pipelined, the wall
        from plan to tokens also holds the step before it; what a step costs (imp.core.itl) is this."""
        if h.start is None or h.event is None:
            return 0
        return int(h.start.elapsed_time(h.event) * 1e6)

    def graph_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self.graphs.graphs))

    def timing_probe(self, seqs: list[SeqWork], reps: int = 20) -> float:
        """Median device time (ms) of a graph replay for these decode seqs (no sampling)."""
        self.graphs.replay(seqs)
        torch.cuda.synchronize(self.device)
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            self.graphs.replay(seqs)
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        return float(np.median(ts))

    # ------------------------------------------------------------------ one step

    def _check(self, seqs: list[SeqWork]) -> Rows:
        return self._tables.check(seqs)

    def _lora_arg(self, seqs: list[SeqWork], lora, step: Step | None = None):
        if not lora or not (step.lora.any() if step is not None else
                            any(w.params is not None and w.params.lora for w in seqs)):
            return None
        if self._dev_loras is None:
            self._dev_loras = DeviceLoras(self.device)
        self._dev_loras.sync(lora, self.config)
        return self._dev_loras, self._dev_loras.rows(seqs, sum(len(w.token_ids) for w in seqs))

    def _launch(self, seqs: list[SeqWork], constraints=None, lora=None, tr: Rows | None = None,
                step: Step | None = None) -> Landing:
        if tr is not None and step is not None:
            seqs, src, tr, step = self._known(seqs, tr, step)
        else:
            seqs = pending.known(seqs, self._prev_rows)
            src = pending.pending_rows(seqs, self._prev_rows)
        if isinstance(seqs, Works):  # (decode rows have no mirostat: only the general shares are read)
            filled = self._mirostat.fill(seqs.general)
            if filled is not seqs.general:
                seqs = Works(seqs.rows, filled)
        else:
            seqs = self._mirostat.fill(seqs)
        if not len(seqs):
            return self._landed([], None, [])
        la = self._lora_arg(seqs, lora, step)
        if step.draft.any() if step is not None else any(s.draft for s in seqs):
            return self._verify_step(seqs, src, constraints, la)
        if (step.sample & step.lens).any() if step is not None else any(
                s.sample and s.params.logit_lens > 0 for s in seqs):
            return self._lens_step(seqs, src, constraints, la)
        one = None if step is None else bool((tr.ntok == 1).all() and step.sample.all() and not step.plp.any())
        if la is None and self.graphs.fits(seqs, one):  # every row samples: the graph's logits as they are
            cols = (tr, self._tables) if tr is not None else None
            return self._sample_and_land(self.graphs.replay(seqs, src, self._mark, cols), seqs, constraints, step)
        logits, sample_at, plp_at = self._head_logits(seqs, src, la, one, tr)  # a mixed graph, or eager
        order = sorted(sample_at)
        if not plp_at:
            if not order:
                return self._landed([], None, [])
            sel = logits.index_select(0, cuda_rt.to_device([sample_at[i] for i in order], torch.int64, self.device))
            return self._sample_and_land(sel, _subset(seqs, order), constraints,
                                         step.subset(order) if step is not None else None)
        # prompt logprobs: scored on the host now (not pipelined; such steps are prefill chunks)
        drawn: dict[int, SampledToken] = {}
        if order:
            sel = logits.index_select(0, cuda_rt.to_device([sample_at[i] for i in order], torch.int64, self.device))
            drawn = dict(zip(order, self.collect(self._sample_and_land(sel, [seqs[i] for i in order], constraints))))
        out = with_prompt_logprobs(seqs, drawn, plp_at, logits)
        return Landing([t.seq_id for t in out], None, None, out)

    # the logit lens: such a step runs eager and keeps its lens rows' residual after every layer (`_lens_step`)
    supports_logit_lens = True

    def _lens_step(self, seqs: list[SeqWork], src: dict[int, int], constraints, la) -> Landing:
        """A step with logit-lens rows: eager (no graph keeps per-layer residuals), sampled and waited for, then
        each lens row's layers through the final norm and head (`lens_of`). Not pipelined: it is a debugging
        view (the API reference: decode runs eager while on)."""
        rows, sample_at, plp_at = head_rows(seqs)
        lens = [i for i in sorted(sample_at) if seqs[i].params.logit_lens > 0]
        keep = cuda_rt.to_device([rows[sample_at[i]] for i in lens], torch.int64, self.device)
        meta = eager_meta(seqs, rows, self.block_size, self.device, src)
        self._mark()
        logits, resid = self.fwd(meta, lora=la, keep=keep)
        order = sorted(sample_at)
        sel = logits.index_select(0, cuda_rt.to_device([sample_at[i] for i in order], torch.int64, self.device))
        drawn = dict(zip(order, self.collect(self._sample_and_land(sel, [seqs[i] for i in order], constraints))))
        for k, i in enumerate(lens):
            t = drawn[i]
            drawn[i] = msgspec.structs.replace(t, lens=self.lens_of(resid[:, k], t.token_id, seqs[i].params.logit_lens))
        out = with_prompt_logprobs(seqs, drawn, plp_at, logits) if plp_at else [drawn[i] for i in order]
        return Landing([t.seq_id for t in out], None, None, out)

    def lens_of(self, resid: torch.Tensor, token: int, top_n: int) -> tuple[LensLayer, ...]:
        """resid [L, d]: each layer's raw distribution by the final norm and head -> (rank of token, its logprob,
        entropy in nats, top_n) per layer, as the CPU forward's `FusedModel.lens`."""
        z = self.fwd.head(resid.contiguous().clone(), torch.zeros_like(resid))  # [L, V] fp32
        logp = torch.log_softmax(z.float(), dim=-1)
        ent = -(logp.exp() * logp).sum(dim=-1)
        at = logp[:, token]
        rank = 1 + (logp > at[:, None]).sum(dim=-1)
        vals, ids = torch.topk(logp, top_n, dim=-1)
        rank, at, ent, vals, ids = (t.cpu().tolist() for t in (rank, at, ent, vals, ids))
        return tuple(LensLayer(int(r), float(a), float(e), tuple(zip(map(int, i), map(float, v))))
                     for r, a, e, v, i in zip(rank, at, ent, vals, ids))

    # a share may feed drafted tokens (SeqWork.draft): `_verify_step`; at most GEMV_MAX_ROWS - 1 of them, so
    # that alone a verify share's rows take the int8 GEMV a one-token decode takes (the same bits: the same
    # greedy tokens with speculation as without)
    verifies_drafts = True
    max_draft = GEMV_MAX_ROWS - 1
    # --speculative auto leaves it to the requests here: at 16 streams speculation measured 0.6-0.8x of without
    # on the H200 (forty-first session, before verify steps kept their penalty counts and their rows within the
    # largest decode graph, which no GPU has run yet)
    speculates_by_default = False

    @property
    def verify_rows(self) -> int:
        """The most decode and drafted rows a step runs as a captured graph (the scheduler's spec_max_rows: past
        it a verify step runs eager); 0 = no graphs."""
        return max(self.graphs.graphs, default=0)

    def _verify_step(self, seqs: list[SeqWork], src: dict[int, int], constraints, la) -> Landing:
        """A step with verify shares. Each one's last draft + 1 positions run as one-token rows (its tokens
        before them, if any, as a chunk that samples nothing), so the step takes the decode graph or a mixed
        graph like any other and each drafted position gets a decode row's numerics and attention (its
        own KV, written in the layer before attention reads it). The plain rows are sampled on the device
        as usual, and every drafted position of every share in one more draw, position j as a decode step
        there would draw it (`_draft_works`); each draft is kept up to the first position that samples
        otherwise when the step is collected (`VerifyLanding`), so the host does not wait for the step here
        and the rows beside the verify stay pipelined (the scheduler plans nothing more for a verifying
        sequence until it lands). Mirostat (mu chained through the draws) and prompt logprobs: drawn on the
        host at once (`_verify_now`)."""
        flat: list[SeqWork] = []
        fsrc: dict[int, int] = {}
        verifies: dict[int, tuple[SeqWork, int]] = {}  # flat index of a share's first drafted row -> (share, rows)
        for i, s in enumerate(seqs):
            if not s.draft:
                if i in src:
                    fsrc[len(flat)] = src[i]
                flat.append(s)
                continue
            n, d = len(s.token_ids), s.draft
            head = n - d - 1  # positions before the last known token: written, not sampled
            if head:
                flat.append(msgspec.structs.replace(s, token_ids=s.token_ids[:head], sample=False, draft=0,
                                                    prompt_logprobs=-1))
            verifies[len(flat)] = (s, d + 1)
            flat.extend(msgspec.structs.replace(s, seq_id=f"{s.seq_id}\x1fdraft{j}", token_ids=(s.token_ids[head + j],),
                                                start_pos=s.start_pos + head + j, sample=True, draft=0,
                                                prompt_logprobs=-1, pending=0)
                        for j in range(d + 1))
        drafted = {k + j for k, (_, c) in verifies.items() for j in range(c)}
        logits, row_of, plp_at = self._head_logits(flat, fsrc, la)
        plain = [k for k in sorted(row_of) if k not in drafted]
        keys = sorted(verifies)
        if plp_at or any(verifies[k][0].params.mirostat for k in keys):
            return self._verify_now(flat, plain, verifies, logits, row_of, plp_at, constraints)
        dev = self.device
        if plain:
            sel = logits.index_select(0, cuda_rt.to_device([row_of[k] for k in plain], torch.int64, dev))
            h = self._sample_and_land(sel, [flat[k] for k in plain], constraints)
            ring, plain_drawn = h.ring, h.tokens
        else:
            plain_drawn = None
            self._landed([], None, [])  # (nothing of this step feeds the next one's PENDING_TOKEN rows)
            ring = self._ring[self._ring_i]
            self._ring_i = (self._ring_i + 1) % RING
        B = len(plain)
        idx = [row_of[k + j] for k in keys for j in range(verifies[k][1])]
        if B + len(idx) > MAX_SAMPLED:
            raise ValueError(f"{B + len(idx)} rows sampled in one step (at most {MAX_SAMPLED})")
        works = [wj for k in keys for wj in self._draft_works(verifies[k][0])]
        rows = logits.index_select(0, cuda_rt.to_device(idx, torch.int64, dev))  # [D, V] a fresh tensor
        if constraints is not None:  # one position at a time: the book follows each matcher to that state
            for j, wj in enumerate(works):
                if wj.params.constrained:
                    constraints.apply(rows[j:j + 1], [wj])
        counts = self._draft_counts([verifies[k][0] for k in keys], rows.shape[1])
        ids, drawn = sampler.draw_ids(rows, works, self.use_numba_sampling, None, counts)
        ring[B:B + len(idx)].copy_(ids.to(torch.int32), non_blocking=True)
        ev = None
        if dev.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        order = [(verifies[k][0].seq_id, drafts(verifies[k][0])) if k in verifies else None
                 for k in sorted(set(plain) | set(keys))]
        return VerifyLanding([flat[k].seq_id for k in plain], ring, ev, order, plain_drawn, drawn)

    @staticmethod
    def _draft_works(w: SeqWork) -> list[SeqWork]:
        """A verify share's drafted positions as the shares a decode step there would sample: gen_index + j, the
        history with the draft's first j tokens (a seed gives the same tokens with drafts as without: the CPU
        verifier's inverse-CDF draw is not the device's Gumbel-max one, imp.sampling.gpu)."""
        d = drafts(w)
        hist = tuple(w.history) if w.params.needs_history else ()
        return [w if j == 0 else msgspec.structs.replace(w, gen_index=w.gen_index + j, history=hist + d[:j]
                                                         if w.params.needs_history else ())
                for j in range(len(d) + 1)]

    def _draft_counts(self, shares: list[SeqWork], V: int) -> DraftCounts:
        """The penalty counts of `_draft_works`' positions for these verify shares: each share's history counted
        once (and only what it gained since its last verify), a position's draft tokens added to it."""
        c = DraftCounts(self._draft_hist)
        for w in shares:
            if w.params.penalized:
                c.add(w.seq_id, w.history, drafts(w), V)
        return c

    def _verify_now(self, flat, plain, verifies, logits, row_of, plp_at, constraints) -> Landing:
        """`_verify_step`'s draws on the host, waited for here: a step with prompt logprobs or a mirostat verify."""
        drawn: dict[int, SampledToken] = {}
        if plain:
            sel = logits.index_select(0, cuda_rt.to_device([row_of[k] for k in plain], torch.int64, self.device))
            drawn = dict(zip(plain, self.collect(self._sample_and_land(sel, [flat[k] for k in plain], constraints))))
        else:
            self._landed([], None, [])
        for k, (s, c) in verifies.items():
            idx = cuda_rt.to_device([row_of[k + j] for j in range(c)], torch.int64, self.device)
            drawn[k] = self._verify(logits.index_select(0, idx), s, constraints)
        out = with_prompt_logprobs(flat, drawn, plp_at, logits) if plp_at else [drawn[k] for k in sorted(drawn)]
        return Landing([t.seq_id for t in out], None, None, out)

    def _verify(self, rows: torch.Tensor, w: SeqWork, constraints) -> SampledToken:
        """rows [draft+1, V] (a fresh tensor) of one verify share -> its last sampled token, the kept draft in
        `accepted`, drawn now (`_draft_works`)."""
        if w.params.mirostat:  # the host sampler's draws chained through mu (imp.sampling.verify)
            t = verify(rows.float().cpu().numpy(), w, constraints)
            self._mirostat.keep([t])
            return t
        works = self._draft_works(w)
        if constraints is not None and w.params.constrained:
            for j, wj in enumerate(works):  # one at a time: the book follows the sequence's matcher to each state
                constraints.apply(rows[j:j + 1], [wj])
        counts = self._draft_counts([w], rows.shape[1])
        ids, tokens = sampler.draw_ids(rows, works, self.use_numba_sampling, None, counts)
        return kept(tokens or [SampledToken(seq_id=w.seq_id, token_id=t) for t in ids.tolist()], drafts(w))

    def _head_logits(self, seqs: list[SeqWork], src: dict[int, int], la, one: bool | None = None,
                     tr: Rows | None = None):
        """(logits, share index -> its sample row in logits, plp_at) by the decode graph, a mixed graph or
        eagerly, as `_launch` picks. one, tr: the shares' columns where `_launch` has them (a `Works`' decode rows
        are then laid out from them, no SeqWork made)."""
        if la is None and self.graphs.fits(seqs, one):
            cols = (tr, self._tables) if tr is not None else None
            return self.graphs.replay(seqs, src, self._mark, cols), {i: i for i in range(len(seqs))}, {}
        pair = self.mixed.fits(seqs) if la is None and self.mixed is not None else None
        if pair is not None:
            cols = (tr, self._tables) if tr is not None and isinstance(seqs, Works) else None
            logits, head_at = self.mixed.replay(seqs, pair, src, self._mark, cols)
            return logits, head_at, {}
        rows, sample_at, plp_at = head_rows(seqs)
        return self._eager_logits(seqs, rows, src, la), sample_at, plp_at

    def _eager_logits(self, seqs: list[SeqWork], rows: list[int], src: dict[int, int], la) -> torch.Tensor:
        """The head's rows of an eager step. With int8 decode and prompts dense or on the int8 GEMM
        (`Linear.mode`), a step that mixes prompt chunks and one-token shares runs its prompt shares first
        and its matmuls per row kind (`Forward.mixed`), so that each row gets the numerics of its kind
        whoever shares the step (a request's tokens then do not depend on the traffic beside it): one
        forward's launches, not two forwards' (bench/eager_step.py figures in PERFORMANCE.md)."""
        bs, dev = self.block_size, self.device
        one = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        if la is not None or not self._split_mixed or not one or len(one) == len(seqs):
            meta = eager_meta(seqs, rows, bs, dev, src)
            self._mark()
            return self.fwd(meta, lora=la)
        one_set = set(one)
        order = [i for i in range(len(seqs)) if i not in one_set] + one
        sub = [seqs[i] for i in order]
        r, _, _ = head_rows(sub)
        starts = _head_row_counts(sub)
        m = eager_meta(sub, r, bs, dev, {j: src[i] for j, i in enumerate(order) if src and i in src})
        k = len(seqs) - len(one)
        m.split = (sum(len(s.token_ids) for s in sub[:k]), sum(c for _, c in starts[:k]))
        m.dec_from = m.split[0]  # the one-token shares come last
        self._mark()
        out = self.fwd(m)
        at = {i: starts[j] for j, i in enumerate(order)}
        pieces = [out[a:a + c] for i in range(len(seqs)) for a, c in [at[i]] if c]
        return torch.cat(pieces) if pieces else out[:0]

    def _known(self, seqs: list[SeqWork], tr: Rows, step: Step):
        """`pending.known` and `pending.pending_rows` over the columns: (the shares whose pending token the last
        step sampled, share index -> its slot there, their Rows and Step)."""
        pend = step.pending > 0
        if not pend.any():
            return seqs, {}, tr, step
        bad = pend & ((step.pending != 1) | (tr.ntok != 1) | (tr.tok0 != PENDING_TOKEN) | ~step.sample)
        if bad.any():
            pending.check(seqs[int(np.flatnonzero(bad)[0])])  # raises: the scheduler's bug, named
        at = self._prev_of(step.slots)
        keep = ~pend | (at >= 0)
        if not keep.all():  # a failed step's sequences (the scheduler has ended them)
            idx = np.flatnonzero(keep)
            seqs, step, tr, pend, at = _subset(seqs, idx.tolist()), step.subset(idx), tr.subset(idx), pend[idx], at[idx]
        rows = np.flatnonzero(pend)
        return seqs, dict(zip(rows.tolist(), at[rows].tolist())), tr, step

    @property
    def _prev_rows(self) -> dict[str, int]:
        """seq id -> its index in _sampled, for the next step's PENDING_TOKEN (the shares' path; made on first use:
        the columns' path reads `_prev_at`)."""
        if self._prev_map is None:
            self._prev_map = {sid: j for j, sid in enumerate(self._prev_sids)}
        return self._prev_map

    def _prev_of(self, slots: np.ndarray) -> np.ndarray:
        """Each slot's row in the last landed step's sampled ids, -1 where it sampled none."""
        if len(self._prev_at) < self._params.cap:
            self._prev_at = np.concatenate([self._prev_at, np.full(self._params.cap - len(self._prev_at), -1)])
        return self._prev_at[slots]

    def _sample_and_land(self, logits: torch.Tensor, seqs: list[SeqWork], constraints=None, step: Step | None = None
                         ) -> Landing:
        """Sample rows of logits for seqs; keep the ids on the device for the next
        step's PENDING_TOKEN and start their copy to the host. step: seqs' columns (else taken here)."""
        if len(seqs) > MAX_SAMPLED:
            raise ValueError(f"{len(seqs)} sequences sampled in one step (at most {MAX_SAMPLED})")
        if step is None:
            step = self._params.take(seqs)
        dev_pending = None
        hist = np.flatnonzero((step.pending > 0) & step.hist)
        if len(hist) and not step.host.any() and not step.grammar[hist].any():
            # penalties count the token in flight: it is on the device (last step's ids), counted there
            dev_pending = (hist.tolist(), self._sampled, self._prev_of(step.slots[hist]).tolist())
        elif len(hist):
            # a grammar's state follows the token in flight (and a host-sampled row reads it): on the host
            prev = dict(zip(self._prev.seq_ids, self._prev.ids()))
            seqs = [pending.fill(s, prev[s.seq_id]) if s.pending and s.params.needs_history else s for s in seqs]
        if step.guide.any():
            apply_guidance(logits, seqs)  # l_b + s (l_a - l_b) on the device, before the masks
        if constraints is not None and step.grammar.any():
            constraints.apply(logits, seqs)  # in place: masked tokens -inf, before bias and the rest
        if step.banned.any():
            apply_bans(logits, seqs)  # a banned phrase's first token at the index it started: -inf
        self._counts.drop_taken()
        ids, tokens = sampler.draw_ids(logits, seqs, self.use_numba_sampling, dev_pending, self._counts, step)
        self._counts.record(ids)  # the penalized rows' ids counted on the device for the next step
        if tokens is not None:
            self._mirostat.keep(tokens)
        B = len(seqs)
        self._sampled[:B].copy_(ids)
        ring = self._ring[self._ring_i]
        self._ring_i = (self._ring_i + 1) % RING
        ring[:B].copy_(self._sampled[:B], non_blocking=True)
        ev = None
        if self.device.type == "cuda":
            ev = torch.cuda.Event(enable_timing=True)  # (device_ns: timed from the launch's start event)
            ev.record()
        return self._landed(seq_ids_of(seqs) if step is None else step.sids, ring, tokens, ev, step)

    def _landed(self, seq_ids: list[str], ring, tokens, event=None, step: Step | None = None) -> Landing:
        """The step's landing, and where each sequence's sampled id sits for the next step's PENDING_TOKEN: by
        seq id (`_prev_rows`) and by params slot (`_prev_at`, the columns' path)."""
        h = Landing(seq_ids, ring, event, tokens)
        self._prev_sids, self._prev_map = (seq_ids if ring is not None else []), None
        self._prev_at[:] = -1
        if ring is not None:  # (a ring comes from `_sample_and_land` alone, with its step)
            self._prev_of(step.slots[:0])  # (sized to the slots)
            self._prev_at[step.slots] = np.arange(len(seq_ids))
        self._prev = h
        return h


class _NoGraph:
    """`host_only`'s stand-in for a captured graph: nothing to replay."""

    def replay(self) -> None:
        pass


def _subset(seqs, idx: list[int]):
    """The shares at these indices (ascending), columns kept where they were (`Works.subset`)."""
    return seqs.subset(idx) if isinstance(seqs, Works) else [seqs[i] for i in idx]


def _head_row_counts(seqs: list[SeqWork]) -> list[tuple[int, int]]:
    """Per share, (first index in head_rows' rows, how many): its prompt-logprob rows, then its sample row."""
    out, n = [], 0
    for s in seqs:
        c = (len(s.token_ids) if s.prompt_next >= 0 else len(s.token_ids) - 1) if s.prompt_logprobs >= 0 else 0
        c += 1 if s.sample else 0
        out.append((n, c))
        n += c
    return out
