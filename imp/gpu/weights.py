"""A GGUF's weights on one device, as the GPU forward wants them.

Read through the fast header parser (`imp.formats.gguf_file`: one mmap, no
per-element numpy views) rather than `gguf.GGUFReader`. Matrices are uploaded
in their GGUF quantization, repacked for aligned loads (`gemv_fp32_act.repack`);
per-layer QKV and gate/up are fused into one `Linear` each; vectors (norms)
are dequantized to fp32. A dense fp16 copy of each quantized matrix is kept
only when it fits comfortably (`dense=None`: at most 30 % of free memory),
for the batch sizes where cuBLAS beats the quantized GEMV. `int8_act`: the
quantized matrices' GEMVs take int8 activations (`gemv_int8_act`, as llama.cpp and
the CPU kernels) rather than fp32 ones (`gemv_fp32_act.gemv`). `invariant`: every
matmul on the int8 GEMM (`Linear`), no dense copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from imp.formats.gguf_file import GGUFHeader, TensorInfo, read_header
from imp.formats.gguf_loader import ModelConfig, config_from_metadata, fingerprint
from imp.formats.quants import dequantize
from imp.formats.requant import Requant
from imp.gpu.linear import Linear
from imp.kernels.cuda import gemv_fp32_act


@dataclass
class Layer:
    attn_norm: torch.Tensor  # [d] fp32
    wqkv: Linear  # [(H + 2 Hkv) D, d]
    wo: Linear  # [d, H D]
    ffn_norm: torch.Tensor  # [d] fp32
    w13: Linear  # [2 d_ff, d]: gate rows, then up rows
    w2: Linear  # [d, d_ff]


@dataclass
class Weights:
    layers: list[Layer]
    out_norm: torch.Tensor  # [d] fp32
    head: Linear  # [vocab, d]
    tok_embd: torch.Tensor  # [vocab, d] fp32
    dense: bool  # dense fp16 copies kept for the GEMM batch sizes
    weight_bytes: int  # bytes the matrices occupy on the device (quantized forms)
    tuner: dict = field(default_factory=dict)  # (Linear.key, N) -> chosen mode, shared by all layers
    tune_stats: dict = field(default_factory=lambda: {"times": {}, "failed": []})


class GGUFSource:
    """A GGUF file's header and its tensors' bytes (views of one read-only memory map)."""

    def __init__(self, path: str, requant: str = "native"):
        self.path = str(path)
        self.header: GGUFHeader = read_header(self.path)
        self.config: ModelConfig = config_from_metadata(self.header.metadata, set(self.header.tensors))
        self.fingerprint = fingerprint(self.path, self.header)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.requant = Requant(self.header, self._mm, requant)  # --weights q8_0: a BF16 model's matrices as Q8_0

    @property
    def metadata(self) -> dict:
        return self.header.metadata

    def info(self, name: str) -> TensorInfo:
        return self.requant.infos[name]

    def raw(self, name: str) -> np.ndarray:
        return self.requant.raw(name)


def _upload(src: GGUFSource, name: str, device: torch.device) -> gemv_fp32_act.QWeight:
    info = src.info(name)
    fmt = info.qtype.name
    rows, cols = (int(np.prod(info.shape[:-1])), int(info.shape[-1])) if len(info.shape) > 1 else (1, int(info.shape[0]))
    if fmt in ("F32", "F16"):  # small plain tensors: store as a bf16 GEMV weight
        arr = dequantize(src.raw(name), info.qtype, (rows, cols), name=name)
        w = torch.from_numpy(np.ascontiguousarray(arr)).to(device).to(torch.bfloat16)
        return gemv_fp32_act.QWeight("BF16", rows, cols, {"w": w})
    if fmt not in gemv_fp32_act.FORMATS:
        raise ValueError(f"tensor {name}: GGML type {fmt} not supported on the GPU (have {gemv_fp32_act.FORMATS})")
    w = gemv_fp32_act.repack(src.raw(name), fmt, rows, cols).to(device)
    src.requant.release(name)  # a converted matrix's host bytes: on the device now
    return w


def _vec(src: GGUFSource, name: str, device: torch.device) -> torch.Tensor:
    info = src.info(name)
    arr = dequantize(src.raw(name), info.qtype, (int(np.prod(info.shape)),), name=name)
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(device)


def _merge(ws: list[gemv_fp32_act.QWeight]) -> list[gemv_fp32_act.QWeight]:
    """Adjacent parts of one format become one (fused QKV of a single quant type)."""
    out = [ws[0]]
    for w in ws[1:]:
        if w.fmt == out[-1].fmt:
            out[-1] = gemv_fp32_act.cat_rows([out[-1], w])
        else:
            out.append(w)
    return out


def load_weights(src: GGUFSource, device: torch.device, dense: bool | None = None, int8_act: bool = False,
                 invariant: bool = False, tuner: dict | None = None) -> Weights:
    """tuner: an earlier load's choices ((Linear.key, N) -> mode) to run again instead of timing (a reload)."""
    cfg = src.config
    tuner = {} if tuner is None else tuner
    stats: dict = {"times": {}, "failed": []}
    up = lambda name: _upload(src, name, device)  # noqa: E731
    raw: dict[str, list[gemv_fp32_act.QWeight]] = {}
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        raw[p + "qkv"] = [up(p + n) for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")]
        raw[p + "o"] = [up(p + "attn_output.weight")]
        raw[p + "13"] = [up(p + n) for n in ("ffn_gate.weight", "ffn_up.weight")]
        raw[p + "2"] = [up(p + "ffn_down.weight")]
    head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
    raw["head"] = [up(head_name)]
    total_dense = sum(w.rows * w.cols * 2 for v in raw.values() for w in v if w.fmt != "BF16")
    if invariant:  # every row on the int8 GEMM (Linear): no cuBLAS, so no copy for it
        dense = False
    if dense is None:  # dense fp16 copies for GEMM batches, when they fit comfortably
        free, _ = torch.cuda.mem_get_info(device)
        dense = total_dense <= 0.3 * free

    def lin(ws: list[gemv_fp32_act.QWeight]) -> Linear:
        parts = _merge(ws)
        d = None
        if len(parts) == 1 and parts[0].fmt == "BF16":
            d = parts[0].parts["w"]
        elif dense:
            d = torch.cat([gemv_fp32_act.reference(p).to(torch.float16) for p in parts])
        return Linear(parts, d, tuner, stats, int8_act=int8_act, invariant=invariant)

    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        layers.append(Layer(
            attn_norm=_vec(src, p + "attn_norm.weight", device), wqkv=lin(raw.pop(p + "qkv")),
            wo=lin(raw.pop(p + "o")), ffn_norm=_vec(src, p + "ffn_norm.weight", device),
            w13=lin(raw.pop(p + "13")), w2=lin(raw.pop(p + "2")),
        ))
    head = lin(raw.pop("head"))
    tok_embd = None
    if cfg.tied_embeddings and len(head.parts) == 1:
        tok_embd = gemv_fp32_act.reference(head.parts[0])
    if tok_embd is None:
        tok_embd = gemv_fp32_act.reference(up("token_embd.weight"))
    weight_bytes = sum(m.nbytes for L in layers for m in (L.wqkv, L.wo, L.w13, L.w2)) + head.nbytes
    w = Weights(layers, _vec(src, "output_norm.weight", device), head, tok_embd.float().contiguous(), dense,
                weight_bytes, tuner, stats)
    torch.cuda.synchronize(device)
    return w
