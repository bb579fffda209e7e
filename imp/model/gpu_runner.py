"""GpuModelRunner: the CPU ModelRunner's interface on one CUDA device.

Weights are uploaded once, kept in their GGUF quantization (repacked for
aligned loads, `imp.kernels.qgemv`); the KV cache is paged in device memory
([n_layers, num_blocks, block_size, Hkv, D], bf16 by default). The same
`SeqWork` list goes in, the same `SampledToken` list comes out.

A step takes one of two paths:
  decode graph: every sequence feeds one token and samples it, and the batch
      fits a captured bucket (1, 2, 4, ... max_graph_batch). Inputs go into
      static device buffers in ONE host->device copy; the whole forward
      (embedding, 9 kernels a layer, head) replays as one CUDA graph.
  eager: anything else (prefill chunks, mixed steps, prompt logprobs): the
      same kernels launched one by one; prefill attention through torch SDPA.

Per layer (decode): add+RMSNorm -> QKV GEMV -> RoPE -> KV write (Numba) ->
paged attention -> O GEMV -> add+RMSNorm -> gate/up GEMV -> SiLU*up -> down
GEMV. Each matmul picks, per batch size, the quantized GEMV or a dense
cuBLAS GEMM over a dequantized fp16 copy (bf16 weights: the weights
themselves), whichever times faster at load (`Linear.choose`, graph-replayed
over the layers' copies of the matrix so that none is timed from L2). BF16
weights also have `qgemv.gemv_bf16x` (two rows a warp, variants x4/x8/a4/k4);
where it wins, the QKV GEMV also applies RoPE and writes k/v into the cache,
and the gate/up GEMV writes SiLU(gate)*up: 7 kernels a layer instead of 10.
Outside graphs the KV write is the CuPy kernel (a Numba launch costs ~0.45 ms
of host time: 14 ms of a 512-token 8B prefill).

Pipelining: `launch(seqs)` enqueues a whole step (inputs, forward, sampling,
the sampled ids' copy to pinned host memory) and returns a handle without
waiting; `collect(handle)` waits for that step and returns its tokens
(`step` = both). The sampled ids also stay in a device buffer, so the next
step, launched before this one finishes, feeds them where its SeqWork says
PENDING_TOKEN (`imp.kernels.pending`, inside the decode graph). Host input
buffers alternate so that writing step N+1's inputs never races step N's
copy still queued on the stream.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
from gguf import GGUFReader

from imp.kernels import _cuda
from imp.kernels import act as k_act
from imp.kernels import pending as k_pending
from imp.kernels import kv_write as k_kv
from imp.kernels import paged_attention as k_attn
from imp.kernels import prefill_attention as k_prefill
from imp.kernels import qgemv
from imp.kernels import rmsnorm as k_norm
from imp.kernels import rope as k_rope
from imp.kernels import sampling as k_sample
from imp.messages import PENDING_TOKEN, SampledToken, SeqWork
from imp.model.gguf_loader import ModelConfig, config_from_metadata, fingerprint, read_metadata
from imp.model.llama import default_num_blocks, rope_tables
from imp.model.quants import dequantize
from imp.model.runner import DEFAULT_KV_TOKENS, SUPPORTED_ARCHS, head_rows, with_prompt_logprobs
from imp.model.sampling import sample_one

log = logging.getLogger("imp.gpu")

GEMV_MAX_ROWS = 8  # without timing: GEMV up to this many rows, dense GEMM above
X_DEFAULT = "x4"  # untimed choice for BF16 weights at <= GEMV_MAX_ROWS rows (qgemv.gemv_bf16x variant)
FUSED_CREDIT_US = 2.0  # tuner: graph cost of one small kernel that a fused gemv_bf16x epilogue saves
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_SAMPLED = 4096  # sequences sampled in one step (the device buffer of sampled ids)
RING = 4  # pinned buffers for sampled ids: a step's slot is reused 4 launches later (<= 2 are in flight)


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream for graph capture on `device`. torch.cuda.graph's default one is
    created once, on whichever device captured first: a second device must bring its own."""
    idx = device.index or 0
    if idx not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[idx] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[idx]


def _mm_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, K] (w's dtype) @ w.T -> fp32, accumulating and writing in fp32 when torch can."""
    if _MM_OUT_DTYPE[0]:
        try:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            _MM_OUT_DTYPE[0] = False
    return torch.mm(x, w.t()).float()


_MM_OUT_DTYPE = [True]


class Linear:
    """y = x @ W.T for W the row-concatenation of `parts` (fused QKV, gate+up)."""

    def __init__(self, parts: list[qgemv.QWeight], dense: torch.Tensor | None, tuner: dict, stats: dict | None = None):
        self.parts = parts
        self.rows = sum(p.rows for p in parts)
        self.cols = parts[0].cols
        self.offsets = list(np.cumsum([0] + [p.rows for p in parts])[:-1])
        self.dense = dense
        self.key = (tuple((p.fmt, p.rows) for p in parts), self.cols)
        self.tuner = tuner  # shared by all layers: (key, N) -> "gemv" | "dense" | a qgemv.XVARIANTS name
        # shared too: "times" (key, N) -> {candidate: µs}, "failed": candidates that raised
        self.stats = stats if stats is not None else {"times": {}, "failed": []}
        # BF16 weight in one piece: the two-rows-a-warp GEMV (with fused epilogues for QKV and gate/up)
        self.xw = parts[0] if len(parts) == 1 and qgemv.x_ok(parts[0]) else None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def candidates(self, n: int) -> list[str]:
        c = ["gemv"]
        if self.xw is not None and n <= GEMV_MAX_ROWS:
            c += list(qgemv.XVARIANTS)
        if self.dense is not None:
            c.append("dense")
        return c

    def mode(self, n: int) -> str:
        m = self.tuner.get((self.key, n))
        if m is not None:
            return m
        if n <= GEMV_MAX_ROWS:
            return X_DEFAULT if self.xw is not None else "gemv"
        return "gemv" if self.dense is None else "dense"

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.rows, dtype=torch.float32, device=x.device)
        for p, r0 in zip(self.parts, self.offsets):
            qgemv.gemv(p, x, out[:, r0:r0 + p.rows])
        return out

    def dense_mm(self, x: torch.Tensor) -> torch.Tensor:
        return _mm_f32(x.to(self.dense.dtype), self.dense)

    def run(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name == "dense":
            return self.dense_mm(x)
        if name == "gemv":
            return self.gemv(x)
        return qgemv.gemv_bf16x(self.xw, x, variant=name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(self.mode(x.shape[0]), x)

    def time_us(self, name: str, x: torch.Tensor, peers: list[Linear], reps: int = 12) -> float:
        """Device µs of one call, replayed in a CUDA graph (as decode runs: Python launch cost must not
        decide) over `peers` in turn (the same matrix of other layers), so that a matrix smaller than
        L2 (the 8B O projection, 34 MB) is not timed from L2."""
        peers = peers or [self]
        for i in range(3):
            peers[i % len(peers)].run(name, x)
        torch.cuda.synchronize()
        g = None
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=capture_stream(x.device), capture_error_mode="thread_local"):
                for i in range(reps):
                    peers[i % len(peers)].run(name, x)
            g.replay()
        except Exception:  # noqa: BLE001 - eager timing then
            g = None
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        if g is not None:
            g.replay()
        else:
            for i in range(reps):
                peers[i % len(peers)].run(name, x)
        e.record()
        e.synchronize()
        del g
        return s.elapsed_time(e) / reps * 1e3

    def choose(self, n: int, reps: int = 12, peers: list[Linear] | None = None, credit_us: float = 0.0) -> str:
        """Time every candidate for n rows once per shape; remember the fastest. `credit_us` is taken off
        the qgemv.gemv_bf16x variants' times where the forward fuses a small kernel into them (RoPE +
        KV write after QKV, SiLU*up after gate/up), which this plain timing does not see."""
        if (self.key, n) in self.tuner:
            return self.tuner[(self.key, n)]
        cands = self.candidates(n)
        if n > 64 and "dense" in cands:
            cands = ["dense"]
        if len(cands) == 1:
            self.tuner[(self.key, n)] = cands[0]
            return cands[0]
        dev = self.parts[0].parts[next(iter(self.parts[0].parts))].device
        x = torch.randn(n, self.cols).to(dev)  # CPU RNG: the CUDA one is capture-sensitive
        times = {}
        for name in cands:
            try:
                t = self.time_us(name, x, peers or [self], reps)
            except Exception as e:  # noqa: BLE001 - a variant that fails to build or run is not chosen
                torch.cuda.synchronize()
                log.warning("linear %s n=%d: %s failed: %s: %s", self.key, n, name, type(e).__name__, str(e)[:200])
                self.stats["failed"].append(f"{self.key} n={n} {name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            times[name] = t - (credit_us if name in qgemv.XVARIANTS else 0.0)
        best = min(times, key=times.get)
        self.tuner[(self.key, n)] = best
        self.stats["times"][(self.key, n)] = times
        log.info("linear %s n=%d: %s -> %s", self.key, n, {k: round(v, 1) for k, v in times.items()}, best)
        return best


@dataclass
class Layer:
    attn_norm: torch.Tensor
    wqkv: Linear
    wo: Linear
    ffn_norm: torch.Tensor
    w13: Linear
    w2: Linear


@dataclass
class Meta:
    """One forward's device-side inputs (see `_forward`)."""

    tokens: torch.Tensor  # [N] int32
    positions: torch.Tensor  # [N] int32
    slots: torch.Tensor  # [N] int32, -1 = skip
    dec_rows: torch.Tensor | None  # [Bd] int64 rows of decode queries; None = rows 0..Bd-1
    dec_bt: torch.Tensor | None  # [Bd, max_blocks] int32
    dec_lens: torch.Tensor | None  # [Bd] int32
    prefill: list  # (row0, row1, ctx_blocks int64 | None, start)
    out_rows: torch.Tensor | None  # [R] int64 rows to compute logits for; None = all rows
    all_decode: bool = False
    pending: tuple | None = None  # (rows [k] int32, src [k] int32, k): tokens[rows] = previous step's sampled[src]


class Landing:
    """A launched step: its sampled ids land in a pinned buffer when `event` completes."""

    def __init__(self, seq_ids: list[str], ring: torch.Tensor | None, event, tokens: list[SampledToken] | None):
        self.seq_ids, self.ring, self.event, self.tokens = seq_ids, ring, event, tokens
        self._ids: list[int] | None = None

    def ids(self) -> list[int]:
        """The sampled ids (waits for the step); safe from any thread, idempotent."""
        if self._ids is None:
            if self.tokens is not None:
                self._ids = [t.token_id for t in self.tokens]
            else:
                self.event.synchronize()
                self._ids = self.ring[:len(self.seq_ids)].tolist()
        return self._ids


def _penalized(w: SeqWork) -> bool:
    p = w.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


class GpuModelRunner:
    def __init__(self, cfg: ModelConfig, metadata: dict, fp: str, tensors: dict, qtypes: dict,
                 num_blocks: int, block_size: int, device: str = "cuda:0", kv_dtype=torch.bfloat16,
                 dense: bool | None = None, graphs: bool = True, max_graph_batch: int = 64, tune: bool = True):
        self.config = cfg
        self.metadata = metadata
        self.fingerprint = fp
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv_dtype = kv_dtype
        self.notes: list[str] = []  # what fell back, for the bench/logs
        self._lock = threading.Lock()
        _cuda.use_device(self.device.index or 0)
        self._sampled = torch.zeros(MAX_SAMPLED, dtype=torch.int32, device=self.device)  # last step's ids
        self._prev_rows: dict[str, int] = {}  # seq id -> index in _sampled, for the next step's PENDING_TOKEN
        self._prev: Landing | None = None
        self._ring = [torch.zeros(MAX_SAMPLED, dtype=torch.int32).pin_memory() for _ in range(RING)]
        self._ring_i = 0
        if cfg.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"architecture {cfg.arch!r} not supported (have {SUPPORTED_ARCHS})")
        if cfg.extras.get("rope.scaling.type", "none") not in ("none", None):
            raise NotImplementedError("rope scaling not supported yet")
        self._load_weights(tensors, qtypes, dense)
        Hkv, D = cfg.n_kv_heads, cfg.head_dim
        shape = (cfg.n_layers, num_blocks, block_size, Hkv, D)
        self.k_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        cos, sin = rope_tables(cfg, cfg.context_length)
        self.cos, self.sin = cos.to(self.device), sin.to(self.device)
        self.max_blocks = (cfg.context_length + block_size - 1) // block_size
        self.kv_impl = "numba" if self._self_check_numba() else "cupy"
        self.use_numba_sampling = self.kv_impl == "numba"
        self._graphs: dict[int, tuple] = {}
        self.buckets = tuple(b for i, b in enumerate(BUCKETS) if i == 0 or BUCKETS[i - 1] < max_graph_batch)
        # fused QKV (+RoPE +KV write) and gate/up (+SiLU*up) GEMVs where the tuner picks a gemv_bf16x variant
        self.fuse = kv_dtype in (torch.float32, torch.bfloat16)
        self.eager_kv_impl = "cupy"  # outside graphs: the CuPy launch costs far less host time than Numba's
        if tune:
            credit = {"wqkv": FUSED_CREDIT_US * 2, "w13": FUSED_CREDIT_US} if self.fuse else {}
            for n in self.buckets:
                for attr in ("wqkv", "wo", "w13", "w2"):
                    getattr(self.layers[0], attr).choose(n, peers=[getattr(L, attr) for L in self.layers],
                                                         credit_us=credit.get(attr, 0.0))
                self.head.choose(n)
        if graphs and self.buckets:
            try:
                self._capture()
            except Exception as e:  # noqa: BLE001 - retry with the CuPy KV write, then eager
                self._graphs.clear()
                self.notes.append(f"graph capture failed with {self.kv_impl} KV write: {type(e).__name__}: {str(e)[:200]}")
                log.warning(self.notes[-1])
                torch.cuda.synchronize(self.device)
                if self.kv_impl == "numba":
                    self.kv_impl = "cupy"
                    try:
                        self._capture()
                    except Exception as e2:  # noqa: BLE001
                        self._graphs.clear()
                        self.notes.append(f"graph capture failed, eager decode: {type(e2).__name__}: {str(e2)[:200]}")
                        log.warning(self.notes[-1])

    # ------------------------------------------------------------------ load

    @classmethod
    def load(cls, path: str, num_blocks: int | None = None, block_size: int = 16, kv_tokens: int | None = None,
             device: str = "cuda:0", **kw) -> "GpuModelRunner":
        reader = GGUFReader(path, "r")
        md = read_metadata(reader)
        names = {t.name for t in reader.tensors}
        cfg = config_from_metadata(md, names)
        if cfg.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"{path}: architecture {cfg.arch!r} not supported (have {SUPPORTED_ARCHS})")
        if num_blocks is None:
            num_blocks = default_num_blocks(kv_tokens or DEFAULT_KV_TOKENS, block_size)
        tensors = {t.name: t for t in reader.tensors}
        qtypes = {t.name: t.tensor_type.name for t in reader.tensors}
        return cls(cfg, md, fingerprint(path, reader), tensors, qtypes, num_blocks, block_size, device, **kw)

    def _upload(self, t, name: str) -> qgemv.QWeight:
        fmt = t.tensor_type.name
        rows, cols = (int(s) for s in reversed(t.shape.tolist()))
        if fmt in ("F32", "F16"):  # small plain tensors: store as bf16 GEMV weight
            arr = dequantize(t.data, t.tensor_type, (rows, cols), name=name)
            w = torch.from_numpy(np.ascontiguousarray(arr)).to(self.device).to(torch.bfloat16)
            return qgemv.QWeight("BF16", rows, cols, {"w": w})
        if fmt not in qgemv.FORMATS:
            raise ValueError(f"tensor {name}: GGML type {fmt} not supported on the GPU (have {qgemv.FORMATS})")
        return qgemv.repack(np.asarray(t.data), fmt, rows, cols).to(self.device)

    def _vec(self, t, name) -> torch.Tensor:
        arr = dequantize(t.data, t.tensor_type, (int(np.prod(t.shape)),), name=name)
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(self.device)

    def _load_weights(self, t: dict, qtypes: dict, dense: bool | None) -> None:
        cfg = self.config
        tuner: dict = {}
        self._tuner = tuner
        self._tune_stats: dict = {"times": {}, "failed": []}
        raw: dict[str, list] = {}
        total_dense = 0
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            raw[p + "qkv"] = [self._upload(t[p + n], p + n) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")]
            raw[p + "o"] = [self._upload(t[p + "attn_output.weight"], p + "o")]
            raw[p + "13"] = [self._upload(t[p + n], p + n) for n in ("ffn_gate.weight", "ffn_up.weight")]
            raw[p + "2"] = [self._upload(t[p + "ffn_down.weight"], p + "2")]
        head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        raw["head"] = [self._upload(t[head_name], head_name)]
        for v in raw.values():
            total_dense += sum(w.rows * w.cols * 2 for w in v if w.fmt != "BF16")
        if dense is None:  # dense fp16 copies for GEMM batches, when they fit comfortably
            free, total = torch.cuda.mem_get_info(self.device)
            dense = total_dense <= 0.3 * free
        self.dense = dense

        def merge(ws: list[qgemv.QWeight]) -> list[qgemv.QWeight]:
            out = [ws[0]]
            for w in ws[1:]:
                if w.fmt == out[-1].fmt:
                    out[-1] = qgemv.cat_rows([out[-1], w])
                else:
                    out.append(w)
            return out

        def lin(ws):
            parts = merge(ws)
            d = None
            if all(p.fmt == "BF16" for p in parts) and len(parts) == 1:
                d = parts[0].parts["w"]
            elif dense:
                d = torch.cat([qgemv.reference(p).to(torch.float16) for p in parts])
            return Linear(parts, d, tuner, self._tune_stats)

        self.layers = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            self.layers.append(Layer(
                attn_norm=self._vec(t[p + "attn_norm.weight"], p + "attn_norm"),
                wqkv=lin(raw.pop(p + "qkv")), wo=lin(raw.pop(p + "o")),
                ffn_norm=self._vec(t[p + "ffn_norm.weight"], p + "ffn_norm"),
                w13=lin(raw.pop(p + "13")), w2=lin(raw.pop(p + "2")),
            ))
        self.out_norm = self._vec(t["output_norm.weight"], "output_norm")
        head_parts = raw.pop("head")
        self.head = lin(head_parts)
        emb = t["token_embd.weight"]
        if cfg.tied_embeddings:
            self.tok_embd = qgemv.reference(self.head.parts[0]) if len(self.head.parts) == 1 else None
        else:
            self.tok_embd = None
        if self.tok_embd is None:
            self.tok_embd = qgemv.reference(self._upload(emb, "token_embd.weight"))
        self.tok_embd = self.tok_embd.float().contiguous()  # [vocab, d] fp32
        self.weight_bytes = sum(lin.nbytes for L in self.layers for lin in (L.wqkv, L.wo, L.w13, L.w2)) + self.head.nbytes
        torch.cuda.synchronize(self.device)

    def _self_check_numba(self) -> bool:
        """Numba KV write on a tiny case; torch fallback (noted) if Numba CUDA is unusable here."""
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
            self.notes.append(f"numba unavailable, CuPy KV write / torch penalties: {type(e).__name__}: {str(e)[:200]}")
            log.warning(self.notes[-1])
            return False

    # ------------------------------------------------------------------ model

    def _forward(self, m: Meta) -> torch.Tensor:
        cfg = self.config
        H, Hkv, D, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_eps
        N = m.tokens.shape[0]
        if m.pending is not None:  # the previous step's samples, where this one feeds PENDING_TOKEN
            k_pending.fill_pending(m.tokens, m.pending[0], m.pending[1], self._sampled, m.pending[2])
        x = self.tok_embd.index_select(0, m.tokens)  # [N, d]
        delta = None
        h = torch.empty_like(x)
        capturing = torch.cuda.is_current_stream_capturing()
        for i, L in enumerate(self.layers):
            k_norm.add_rmsnorm(x, delta, L.attn_norm, eps, out=h)
            kc, vc = self.k_cache[i], self.v_cache[i]  # [num_blocks, bs, Hkv, D]
            kf, vf = kc.view(-1, Hkv * D), vc.view(-1, Hkv * D)
            qm = L.wqkv.mode(N)
            if self.fuse and qm in qgemv.XVARIANTS:  # one kernel: QKV GEMV, RoPE on q/k, k/v into the cache
                qkv = qgemv.gemv_bf16x(L.wqkv.xw, h, variant=qm, mode="qkv",
                                       rope=(m.positions, self.cos, self.sin, (H + Hkv) * D), kv=(kf, vf, m.slots, H * D))
                kn, vn = qkv[:, H * D:(H + Hkv) * D], qkv[:, (H + Hkv) * D:]
            else:
                qkv = L.wqkv.run(qm, h)  # [N, (H + 2 Hkv) D]
                k_rope.rope(qkv, m.positions, self.cos, self.sin, H + Hkv)
                kn, vn = qkv[:, H * D:(H + Hkv) * D], qkv[:, (H + Hkv) * D:]
                if self.kv_impl == "numba" and (capturing or self.eager_kv_impl == "numba"):
                    k_kv.kv_write(kn, vn, kf, vf, m.slots)
                else:
                    k_kv.kv_write_cupy(kn, vn, kf, vf, m.slots)
            a = self._attention(qkv, kn, vn, kc, vc, m, N)
            delta = L.wo(a)
            k_norm.add_rmsnorm(x, delta, L.ffn_norm, eps, out=h)
            gm = L.w13.mode(N)
            if self.fuse and gm in qgemv.XVARIANTS:  # one kernel: gate/up GEMV and SiLU(gate) * up
                act = qgemv.gemv_bf16x(L.w13.xw, h, variant=gm, mode="gated", act="silu")
            else:
                act = k_act.gated_act(L.w13.run(gm, h), "silu")
            delta = L.w2(act)
        if m.out_rows is not None:
            x, delta = x.index_select(0, m.out_rows), delta.index_select(0, m.out_rows)
        hf = k_norm.add_rmsnorm(x, delta, self.out_norm, eps)
        return self.head(hf)  # [R, vocab] fp32

    def _attention(self, qkv, kn, vn, kc, vc, m: Meta, N: int) -> torch.Tensor:
        H, D = self.config.n_heads, self.config.head_dim
        if m.all_decode:
            return k_attn.paged_decode(qkv, kc, vc, m.dec_bt, m.dec_lens, H)
        out = torch.empty(N, H * D, dtype=torch.float32, device=qkv.device)
        if m.dec_bt is not None:
            qd = qkv.index_select(0, m.dec_rows)
            out.index_copy_(0, m.dec_rows, k_attn.paged_decode(qd, kc, vc, m.dec_bt, m.dec_lens, H))
        for r0, r1, ctx, start in m.prefill:
            k_prefill.prefill_attention(qkv[r0:r1, :H * D], kn[r0:r1], vn[r0:r1], kc, vc, ctx, start, H, out[r0:r1])
        return out

    # ------------------------------------------------------------------ inputs

    def _check(self, seqs: list[SeqWork]) -> None:
        assert seqs, "empty step"
        ctx = self.config.context_length
        for s in seqs:
            end = s.start_pos + len(s.token_ids)
            if not s.token_ids:
                raise ValueError(f"{s.seq_id}: no tokens")
            if end > ctx:
                raise ValueError(f"{s.seq_id}: position {end - 1} beyond context length {ctx}")
            nb = (end - 1) // self.block_size + 1
            if len(s.block_table) < nb:
                raise ValueError(f"{s.seq_id}: block table too short for position {end - 1}")
            tbl = s.block_table[:nb]
            if max(tbl) >= self.num_blocks or min(tbl) < 0:
                raise ValueError(f"{s.seq_id}: block id out of range (num_blocks={self.num_blocks})")

    def _eager_meta(self, seqs: list[SeqWork], rows: list[int], src: dict[int, int] | None = None) -> Meta:
        bs = self.block_size
        toks, pos, slots = [], [], []
        dec, pre = [], []
        ph_rows, ph_src = [], []
        r = 0
        for i, s in enumerate(seqs):
            n = len(s.token_ids)
            table = np.asarray(s.block_table, dtype=np.int64)
            p = np.arange(s.start_pos, s.start_pos + n, dtype=np.int64)
            if src and i in src:  # PENDING_TOKEN: filled in on the device (a one-token share)
                ph_rows.append(r)
                ph_src.append(src[i])
                toks.append(np.zeros(n, dtype=np.int64))
            else:
                toks.append(np.asarray(s.token_ids, dtype=np.int64))
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            (dec if n == 1 else pre).append((r, s, n, table))
            r += n
        dev = self.device
        i32 = lambda a: torch.from_numpy(np.concatenate(a).astype(np.int32)).to(dev)  # noqa: E731
        m = Meta(tokens=i32(toks), positions=i32(pos), slots=i32(slots), dec_rows=None, dec_bt=None,
                 dec_lens=None, prefill=[], out_rows=torch.tensor(rows, dtype=torch.int64, device=dev))
        if ph_rows:
            m.pending = (i32([np.asarray(ph_rows)]), i32([np.asarray(ph_src)]), len(ph_rows))
        if dec:
            nbmax = max((s.start_pos // bs) + 1 for _, s, _, _ in dec)
            bt = np.zeros((len(dec), nbmax), np.int32)
            lens = np.zeros(len(dec), np.int32)
            for j, (_, s, _, table) in enumerate(dec):
                nb = s.start_pos // bs + 1
                bt[j, :nb] = table[:nb]
                lens[j] = s.start_pos + 1
            m.dec_bt = torch.from_numpy(bt).to(dev)
            m.dec_lens = torch.from_numpy(lens).to(dev)
            m.dec_rows = torch.tensor([rr for rr, _, _, _ in dec], dtype=torch.int64, device=dev)
        for rr, s, n, table in pre:
            ctx = None
            if s.start_pos > 0:
                nb = (s.start_pos + n - 1) // bs + 1
                ctx = torch.from_numpy(np.ascontiguousarray(table[:nb])).to(dev)
            m.prefill.append((rr, rr + n, ctx, s.start_pos))
        return m

    # ------------------------------------------------------------------ CUDA graphs

    def _capture(self) -> None:
        """One graph per bucket over static input buffers (largest first, one memory pool)."""
        M, MB = max(self.buckets), self.max_blocks
        # [tokens | positions | slots | lens | pending rows | pending src | block tables]
        self._in = torch.zeros(6 * M + M * MB, dtype=torch.int32, device=self.device)
        # two host copies, alternating: step N+1 is written while step N's copy may still be queued
        self._hosts = [torch.zeros_like(self._in, device="cpu").pin_memory() for _ in range(2)]
        self._host_events = [None, None]
        self._host_i = 0
        gi = self._in
        self._static = dict(tokens=gi[0:M], positions=gi[M:2 * M], slots=gi[2 * M:3 * M], lens=gi[3 * M:4 * M],
                            ph_rows=gi[4 * M:5 * M], ph_src=gi[5 * M:6 * M], bt=gi[6 * M:].view(M, MB))
        for h in self._hosts:
            h.numpy()[2 * M:3 * M] = -1  # no KV writes from padding rows
            h.numpy()[4 * M:5 * M] = -1  # no pending tokens
        self._in.copy_(self._hosts[0])
        st = self._static
        pool = None
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for b in self.buckets:  # warm-up: compiles every kernel, picks tuned paths
                self._forward(self._graph_meta(b))
        torch.cuda.current_stream(self.device).wait_stream(s)
        torch.cuda.synchronize(self.device)
        for b in sorted(self.buckets, reverse=True):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=capture_stream(self.device), capture_error_mode="thread_local"):
                out = self._forward(self._graph_meta(b))
            pool = g.pool()
            self._graphs[b] = (g, out)
        torch.cuda.synchronize(self.device)
        del st

    def _graph_meta(self, b: int) -> Meta:
        st = self._static
        return Meta(tokens=st["tokens"][:b], positions=st["positions"][:b], slots=st["slots"][:b], dec_rows=None,
                    dec_bt=st["bt"][:b], dec_lens=st["lens"][:b], prefill=[], out_rows=None, all_decode=True,
                    pending=(st["ph_rows"][:b], st["ph_src"][:b], b))

    def _replay(self, seqs: list[SeqWork], src: dict[int, int] | None = None) -> torch.Tensor:
        """Graph-replayed decode; src: row -> index in _sampled for PENDING_TOKEN rows."""
        B = len(seqs)
        b = next(x for x in self.buckets if x >= B)
        M, MB, bs = max(self.buckets), self.max_blocks, self.block_size
        i_host = self._host_i
        self._host_i ^= 1
        if self._host_events[i_host] is not None:
            self._host_events[i_host].synchronize()  # its last copy has left (long ago: two steps back)
        host = self._hosts[i_host]
        h = host.numpy()
        bt = h[6 * M:6 * M + b * MB].reshape(b, MB)
        src = src or {}
        for i, s in enumerate(seqs):
            p = s.start_pos
            nb = p // bs + 1
            bt[i, :nb] = s.block_table[:nb]
            j = src.get(i, -1)
            h[i] = 0 if j >= 0 else s.token_ids[0]
            h[M + i] = p
            h[2 * M + i] = s.block_table[p // bs] * bs + p % bs
            h[3 * M + i] = p + 1
            h[4 * M + i] = i if j >= 0 else -1
            h[5 * M + i] = max(j, 0)
        h[B:b] = 0
        h[M + B:M + b] = 0
        h[2 * M + B:2 * M + b] = -1
        h[3 * M + B:3 * M + b] = 0
        h[4 * M + B:4 * M + b] = -1
        self._in[: 6 * M + b * MB].copy_(host[: 6 * M + b * MB], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._host_events[i_host] = ev
        g, out = self._graphs[b]
        g.replay()
        return out[:B]

    def _decode_only(self, seqs: list[SeqWork]) -> bool:
        return bool(self._graphs) and len(seqs) <= max(self._graphs) and all(
            len(s.token_ids) == 1 and s.sample and s.prompt_logprobs < 0 for s in seqs)

    # ------------------------------------------------------------------ interface

    @torch.inference_mode()
    def forward(self, seqs: list[SeqWork]) -> torch.Tensor:
        """fp32 logits [B, vocab] (on the device) at each sequence's last new token."""
        self._check(seqs)
        rows, base = [], 0
        for s in seqs:
            base += len(s.token_ids)
            rows.append(base - 1)
        with self._lock:
            _cuda.use_device(self.device.index or 0)
            return self._forward(self._eager_meta(seqs, rows)).clone()

    def step(self, seqs: list[SeqWork]) -> list[SampledToken]:
        return self.collect(self.launch(seqs))

    def collect(self, h: Landing) -> list[SampledToken]:
        """Wait for a launched step; its tokens, in the order of its sampled shares."""
        if h.tokens is not None:
            return h.tokens
        return [SampledToken(seq_id=sid, token_id=t) for sid, t in zip(h.seq_ids, h.ids())]

    @torch.inference_mode()
    def launch(self, seqs: list[SeqWork]) -> Landing:
        """Enqueue one step on the device and return without waiting for it.

        A share feeding PENDING_TOKEN whose sequence the previous step did not
        sample (that step failed: the scheduler has ended it) is left out.
        """
        self._check(seqs)
        with self._lock:
            _cuda.use_device(self.device.index or 0)  # per thread: the executor's thread starts on device 0
            try:
                return self._launch(seqs)
            except BaseException:
                self._prev_rows, self._prev = {}, None  # nothing to feed the next step from
                raise

    def _launch(self, seqs: list[SeqWork]) -> Landing:
        seqs = [s for s in seqs if not s.pending or s.seq_id in self._prev_rows]
        src: dict[int, int] = {}
        for i, s in enumerate(seqs):
            if s.pending:
                if s.pending != 1 or list(s.token_ids) != [PENDING_TOKEN]:
                    raise ValueError(f"{s.seq_id}: pending {s.pending} with tokens {list(s.token_ids)[:4]}")
                src[i] = self._prev_rows[s.seq_id]
        if not seqs:
            return self._landed([], None, [])
        if self._decode_only(seqs):
            logits = self._replay(seqs, src)
            return self._sample_and_land(logits, seqs)
        rows, sample_at, plp_at = head_rows(seqs)
        logits = self._forward(self._eager_meta(seqs, rows, src))  # rows == []: KV writes only
        order = sorted(sample_at)
        if not plp_at:
            if not order:
                return self._landed([], None, [])
            sel = logits.index_select(0, torch.tensor([sample_at[i] for i in order], device=self.device))
            return self._sample_and_land(sel, [seqs[i] for i in order])
        # prompt logprobs: scored on the host now (not pipelined; such steps are prefill chunks)
        drawn: dict[int, SampledToken] = {}
        if order:
            sel = logits.index_select(0, torch.tensor([sample_at[i] for i in order], device=self.device))
            drawn = dict(zip(order, self.collect(self._sample_and_land(sel, [seqs[i] for i in order]))))
        out = with_prompt_logprobs(seqs, drawn, plp_at, logits)
        return Landing([t.seq_id for t in out], None, None, out)

    def _sample_and_land(self, logits: torch.Tensor, seqs: list[SeqWork]) -> Landing:
        """Sample rows of logits for seqs; keep the ids on the device for the next
        step's PENDING_TOKEN and start their copy to the host."""
        if len(seqs) > MAX_SAMPLED:
            raise ValueError(f"{len(seqs)} sequences sampled in one step (at most {MAX_SAMPLED})")
        if any(s.pending and _penalized(s) for s in seqs):  # penalties count the token in flight: need it here
            prev = dict(zip(self._prev.seq_ids, self._prev.ids()))
            seqs = [msgspec.structs.replace(s, history=s.history + [prev[s.seq_id]]) if s.pending and _penalized(s)
                    else s for s in seqs]
        ps = [s.params for s in seqs]
        tokens = None
        if all(p.temperature <= 0.0 and p.logprobs < 0 and not p.logit_bias and p.repetition_penalty == 1.0
               and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 for p in ps):
            ids = torch.argmax(logits, dim=-1)
        elif any(p.logprobs >= 0 or (p.typical_p < 1.0 and p.temperature > 0.0) for p in ps):
            tokens = self._sample(logits, seqs)  # logprobs / typical_p: on the host now
            ids = torch.tensor([t.token_id for t in tokens], dtype=torch.int32).to(self.device, non_blocking=False)
        else:
            ids = k_sample.sample_ids(logits, seqs, self.use_numba_sampling)[0]
        B = len(seqs)
        self._sampled[:B].copy_(ids)
        ring = self._ring[self._ring_i]
        self._ring_i = (self._ring_i + 1) % RING
        ring[:B].copy_(self._sampled[:B], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return self._landed([s.seq_id for s in seqs], ring, tokens, ev)

    def _landed(self, seq_ids: list[str], ring, tokens, event=None) -> Landing:
        h = Landing(seq_ids, ring, event, tokens)
        self._prev_rows = {sid: j for j, sid in enumerate(seq_ids)} if ring is not None else {}
        self._prev = h
        return h

    def _sample(self, logits: torch.Tensor, seqs: list[SeqWork]) -> list[SampledToken]:
        ps = [s.params for s in seqs]
        if all(p.temperature <= 0.0 and p.logprobs < 0 and not p.logit_bias and p.repetition_penalty == 1.0
               and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 for p in ps):
            ids = torch.argmax(logits, dim=-1).tolist()
            return [SampledToken(seq_id=s.seq_id, token_id=t) for s, t in zip(seqs, ids)]
        cpu = [i for i, p in enumerate(ps) if p.typical_p < 1.0 and p.temperature > 0.0]
        dev = [i for i in range(len(seqs)) if i not in set(cpu)]
        out: dict[int, SampledToken] = {}
        if dev:
            sel = logits if len(dev) == len(seqs) else logits.index_select(0, torch.tensor(dev, device=self.device))
            for i, t in zip(dev, k_sample.sample(sel, [seqs[i] for i in dev], self.use_numba_sampling)):
                out[i] = t
        for i in cpu:  # typical_p: the CPU sampler, row by row
            out[i] = sample_one(logits[i].float().cpu(), seqs[i])
        return [out[i] for i in range(len(seqs))]

    def graph_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._graphs))

    def timing_probe(self, seqs: list[SeqWork], reps: int = 20) -> float:
        """Median device time (ms) of a graph replay for these decode seqs (no sampling)."""
        self._replay(seqs)
        torch.cuda.synchronize(self.device)
        ts = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            self._replay(seqs)
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        return float(np.median(ts))


def wall(fn, *a):
    t0 = time.perf_counter()
    r = fn(*a)
    return r, time.perf_counter() - t0
