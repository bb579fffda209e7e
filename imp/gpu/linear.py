"""y = x @ W.T on the device, and the per-shape tuner that picks how.

A `Linear` holds one logical weight (a row-concatenation of GGUF tensors:
fused QKV, gate+up) in its quantized form (`imp.kernels.cuda.gemv_fp32_act.QWeight`
parts), plus optionally a dense fp16 copy (BF16 weights: the weight itself).
Each call picks, per batch size, the quantized GEMV (fp32 activations), the
int8-activation dp4a GEMV (`gemv_int8_act`, R rows a warp), the int8 tensor-core
GEMM (`gemm_int8_act`: prompt rows and batches past GEMV_MAX_ROWS when there is no
dense copy), a `gemv_bf16_fused.gemv_bf16x` variant (BF16, two rows a warp) or a dense cuBLAS
GEMM: whichever `choose` timed
fastest at load, replayed in a CUDA graph over every layer's copy of the
matrix so that none is timed from L2.

Batch invariance (a row's bits independent of what shares its step): the int8 GEMV
gives the same bits at any batch size for a given K split, so one split per matrix
serves every decode count up to GEMV_MAX_ROWS (`choose`); cuBLAS picks its kernel by
M, so dense prompt rows and decode batches past 8 are not invariant. With
`invariant` (`--batch-invariant`) every row, prompt or decode, takes the int8 GEMM,
whose bits do not depend on its tile.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from imp.kernels.cuda import gemv_fp32_act
from imp.kernels.cuda import gemm_int8_act, gemv_int8_act, quantize_act_int8

log = logging.getLogger("imp.gpu")

GEMV_MAX_ROWS = 8  # without timing: GEMV up to this many rows, dense GEMM above
Q8_DEFAULT = "q8r2"  # untimed choice for int8-activation weights (gemv_int8_act.VARIANTS)
Q8_MAX_ROWS = 64  # the int8-activation GEMV is a candidate up to this many rows (its batch tiles re-read W from L2)
X_DEFAULT = "x4"  # untimed choice for BF16 weights at <= GEMV_MAX_ROWS rows (gemv_fp32_act.gemv_bf16x variant)
FUSED_CREDIT_US = 2.0  # tuner: graph cost of one small kernel that a fused gemv_bf16x epilogue saves


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream for graph capture on `device`. torch.cuda.graph's default one is
    created once, on whichever device captured first: a second device must bring its own."""
    idx = device.index or 0
    if idx not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[idx] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[idx]


def _mm_f32(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K] (w's dtype) @ w.T -> fp32, accumulating and writing in fp32 when torch can; out: an [N, rows]
    fp32 row range to write (a graph then has no copy node a matmul)."""
    if _MM_OUT_DTYPE[0]:
        try:
            if out is not None and _MM_INTO[0] and out.is_contiguous():
                try:
                    return torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
                except (TypeError, RuntimeError, NotImplementedError):  # the out= overload missing: copy
                    _MM_INTO[0] = False
            y = torch.mm(x, w.t(), out_dtype=torch.float32)
            return y if out is None else out.copy_(y)
        except (TypeError, RuntimeError):
            _MM_OUT_DTYPE[0] = False
    y = torch.mm(x, w.t()).float()
    return y if out is None else out.copy_(y)


_MM_OUT_DTYPE = [True]
_MM_INTO = [True]


class Linear:
    """y = x @ W.T for W the row-concatenation of `parts` (fused QKV, gate+up)."""

    def __init__(self, parts: list[gemv_fp32_act.QWeight], dense: torch.Tensor | None, tuner: dict, stats: dict | None = None,
                 int8_act: bool = False, invariant: bool = False):
        self.parts = parts
        self.rows = sum(p.rows for p in parts)
        self.cols = parts[0].cols
        self.offsets = list(np.cumsum([0] + [p.rows for p in parts])[:-1])
        self.dense = dense
        self.key = (tuple((p.fmt, p.rows) for p in parts), self.cols)
        self.tuner = tuner  # shared by all layers: (key, N) -> "gemv" | "dense" | a gemv_fp32_act.XVARIANTS name
        # shared too: "times" (key, N) -> {candidate: µs}, "failed": candidates that raised
        self.stats = stats if stats is not None else {"times": {}, "failed": []}
        # BF16 weight in one piece: the two-rows-a-warp GEMV (with fused epilogues for QKV and gate/up)
        self.xw = parts[0] if len(parts) == 1 and gemv_fp32_act.x_ok(parts[0]) else None
        # int8 activations (llama.cpp's Q8_1, as the CPU kernels): then every GEMV of this weight is the dp4a one,
        # not the fp32-activation one as well, so the GEMV path has one numerics at every batch size (the CPU
        # runner's); the fp32 GEMV stays for BF16 and for int8_act=False
        self.q8 = int8_act and all(gemv_int8_act.supports(p) for p in parts)
        # without a dense copy, int8 rows past the GEMV's range (and prompt rows) go to the int8 GEMM
        self.mm = self.q8 and dense is None and all(p.fmt in gemm_int8_act.FORMATS for p in parts)
        # batch invariant (--batch-invariant): every row, prompt or decode, at any count, on the int8 GEMM, whose
        # bits do not depend on its tile (so not on M): a row's numbers depend on the row alone
        if invariant and not self.mm:
            raise ValueError(f"batch-invariant matmuls need int8 activations, no dense copy and formats in "
                             f"{gemm_int8_act.FORMATS}; this weight is {[p.fmt for p in parts]}")
        self.invariant = invariant

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def candidates(self, n: int) -> list[str]:
        if self.invariant:
            return ["qmm"]
        if self.q8:  # one numerics per row kind: int8 decode batches up to GEMV_MAX_ROWS, dense (or qmm) above
            if self.mm and n > GEMV_MAX_ROWS:
                return ["qmm"]
            if n <= GEMV_MAX_ROWS or self.dense is None:
                return list(gemv_int8_act.VARIANTS) if n <= Q8_MAX_ROWS or self.dense is None else []
            return ["dense"]
        c = ["gemv"]
        if self.xw is not None and n <= GEMV_MAX_ROWS:
            c += list(gemv_fp32_act.XVARIANTS)
        if self.dense is not None:
            c.append("dense")
        return c

    def mode(self, n: int, prompt: bool = False) -> str:
        """How n rows run. prompt: the rows are prompt tokens (a prefill forward), which take the dense
        copy where there is one whatever n is (else the int8 GEMM), so that a prompt's numerics do not
        depend on how many other prompts share its step (decode rows: int8 GEMV up to GEMV_MAX_ROWS, the
        dense copy or the int8 GEMM above)."""
        if self.invariant:
            return "qmm"
        if self.q8 and (prompt or n > GEMV_MAX_ROWS):
            if self.dense is not None:
                return "dense"
            if self.mm:
                return "qmm"
        m = self.tuner.get((self.key, n))
        if m is not None:
            return m
        if self.q8:  # untimed count: the one-row choice (its K split, so its bits: see `choose`)
            return self.tuner.get((self.key, 1), Q8_DEFAULT)
        if n <= GEMV_MAX_ROWS:
            return X_DEFAULT if self.xw is not None else "gemv"
        return "gemv" if self.dense is None else "dense"

    def gemv(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.rows, dtype=torch.float32, device=x.device) if out is None else out
        for p, r0 in zip(self.parts, self.offsets):
            gemv_fp32_act.gemv(p, x, out[:, r0:r0 + p.rows])
        return out

    def gemv_q8(self, x: torch.Tensor | None, name: str, xa: quantize_act_int8.Q8Act | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The int8-activation GEMV `name` (gemv_int8_act.VARIANTS); xa: x already quantized (by the norm or
        activation kernel that produced it), else x is quantized here, once for every part."""
        rows, split = gemv_int8_act.VARIANTS[name]
        return self._on_q8(x, xa, lambda p, a, o: gemv_int8_act.gemv(p, a, o, rows=rows, split=split), out)

    def qmm(self, x: torch.Tensor | None, xa: quantize_act_int8.Q8Act | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The int8 tensor-core GEMM on every part (x quantized once, unless the producer did)."""
        return self._on_q8(x, xa, gemm_int8_act.qmm, out)

    def _on_q8(self, x, xa, kernel, out: torch.Tensor | None = None) -> torch.Tensor:
        """out [N, rows] fp32: kernel(part, xa, out's column slice) for each part, on x quantized once."""
        xa = xa if xa is not None else quantize_act_int8.quantize(x)
        if out is None:
            out = torch.empty(xa.shape[0], self.rows, dtype=torch.float32, device=xa.xq.device)
        for p, r0 in zip(self.parts, self.offsets):
            kernel(p, xa, out[:, r0:r0 + p.rows])
        return out

    def dense_mm(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return _mm_f32(x.to(self.dense.dtype), self.dense, out)

    def takes_q8(self, n: int, prompt: bool = False) -> bool:
        """Whether the call for n rows runs on int8 activations (the producer of x may then quantize it)."""
        m = self.mode(n, prompt)
        return m in gemv_int8_act.VARIANTS or m == "qmm"

    def run(self, name: str, x: torch.Tensor | None, xa: quantize_act_int8.Q8Act | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """y for x (or xa) by kernel `name`; out: an [N, rows] fp32 view to write (a row range of a wider
        step's output), else a new tensor."""
        if name in gemv_int8_act.VARIANTS:
            return self.gemv_q8(x, name, xa, out)
        if name == "qmm":
            return self.qmm(x, xa, out)
        if name == "gemv":
            return self.gemv(x, out)
        if name == "dense":
            return self.dense_mm(x, out)
        y = gemv_fp32_act.gemv_bf16x(self.xw, x, variant=name)
        return y if out is None else out.copy_(y)

    def by_kind(self, P: int, x: torch.Tensor) -> torch.Tensor:
        """y [N, rows] fp32 for x [N, cols] fp32 whose rows [0, P) are prompt rows and [P, N) one-token
        decode rows: each part on the kernel its kind gets in a step of its own (`mode(P, prompt=True)`,
        `mode(N - P)`), quantized per part where that kernel takes int8. A step that mixes the kinds
        then gives every row the bits it gets without the other kind beside it, in one forward.
        Where both kinds take the same kernel (decode rows past GEMV_MAX_ROWS: the dense copy or the int8 GEMM,
        as prompt rows) it runs once over all N rows: the weight read once, half the launches (a mixed step's
        fixed cost on a small model is mostly launches, on an 8B a second read of 16 GB). The int8 kernels give
        a row the same bits at any M; cuBLAS picks its kernel by M, so dense rows were never batch invariant
        (their M was already the step's bucket): no row loses a guarantee it had."""
        N = x.shape[0]
        kinds = ((0, P, self.mode(P, prompt=True)), (P, N, self.mode(N - P)))
        if P and N > P and kinds[0][2] == kinds[1][2]:
            return self.run(kinds[0][2], x)
        out = torch.empty(N, self.rows, dtype=torch.float32, device=x.device)
        for r0, r1, name in kinds:
            if r1 > r0:
                self.run(name, x[r0:r1], out=out[r0:r1])
        return out

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

    def choose(self, n: int, reps: int = 12, peers: list[Linear] | None = None, credit_us: float = 0.0,
               q8_credit_us: float = 0.0) -> str:
        """Time every candidate for n rows once per shape; remember the fastest. `credit_us` is taken off
        the gemv_fp32_act.gemv_bf16x variants' times where the forward fuses a small kernel into them (RoPE +
        KV write after QKV, SiLU*up after gate/up), `q8_credit_us` off the int8 variants' where the
        forward quantizes x in the kernel that makes it (timed here as a kernel of its own)."""
        if (self.key, n) in self.tuner:
            return self.tuner[(self.key, n)]
        cands = self.candidates(n)
        if n > 64 and "dense" in cands:
            cands = ["dense"]
        one = self.tuner.get((self.key, 1))
        if n > 1 and one in gemv_int8_act.VARIANTS:
            # the int8 GEMV's bits depend on its K split, not on its rows a warp nor the batch: keep the one-row
            # choice's split at every decode count it serves, so a request's tokens do not change with how many
            # others decode beside it (up to GEMV_MAX_ROWS; the GEMM above)
            split = gemv_int8_act.VARIANTS[one][1]
            cands = [c for c in cands if c not in gemv_int8_act.VARIANTS or gemv_int8_act.VARIANTS[c][1] == split]
        if not cands:
            cands = [self.mode(n)]
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
            times[name] = t - (credit_us if name in gemv_fp32_act.XVARIANTS else q8_credit_us if name in gemv_int8_act.VARIANTS
                               else 0.0)
        best = min(times, key=times.get)
        self.tuner[(self.key, n)] = best
        self.stats["times"][(self.key, n)] = times
        log.info("linear %s n=%d: %s -> %s", self.key, n, {k: round(v, 1) for k, v in times.items()}, best)
        return best
