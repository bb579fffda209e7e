"""The llama forward on the device, over one step's rows (`imp.gpu.inputs.Meta`).

Per layer: add+RMSNorm -> QKV GEMV -> RoPE + KV write (one kernel) -> paged
attention (decode rows: the server's kernel, `paged_decode_mma` / `paged_decode_split` / `paged_decode_attention`; prompt rows, cached prefix or not: `paged_prefill_attention`) -> O GEMV -> add+RMSNorm -> gate/up GEMV -> SiLU*up -> down GEMV; where the
tuner picks a `gemv_bf16x` variant the QKV GEMV also applies RoPE and writes
k/v into the cache, and the gate/up GEMV writes SiLU(gate)*up (7 kernels a
layer instead of 10). The residual add is fused into the next RMSNorm
(`delta` carries the pending add). Where the tuner picks the int8-activation
GEMV (`gemv_int8_act`), the norm before QKV and gate/up, the SiLU*up before down and
the final norm write the quantized x directly (`quantize_act_int8`), and so does decode
attention for the O projection. Shapes: N rows (new tokens), d model
width, H query heads, Hkv KV heads, D head dim, V vocabulary, R head rows.
"""

from __future__ import annotations

import torch

from imp.formats.gguf_loader import ModelConfig
from imp.gpu.inputs import Meta
from imp.gpu.weights import Weights
from imp.kernels.cuda import add_rmsnorm as k_norm
from imp.kernels.cuda import fill_pending_tokens as k_pending
from imp.kernels.cuda import gated_act as k_act
from imp.kernels.cuda import gemv_fp32_act
from imp.kernels.cuda import paged_decode_attention as k_attn
from imp.kernels.cuda import paged_decode_mma as k_mma
from imp.kernels.cuda import paged_decode_split as k_split
from imp.kernels.cuda import paged_prefill_attention as k_pf
from imp.kernels.cuda import prefill_attention_sdpa as k_prefill
from imp.kernels.cuda import quantize_act_int8
from imp.kernels.cuda import rope as k_rope


# False: prompt rows through torch SDPA per chunk, as before paged_prefill_attention (bench/eager_step.py --sdpa compares)
PAGED_PREFILL = True


class Forward:
    def __init__(self, cfg: ModelConfig, w: Weights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, sampled: torch.Tensor, fuse: bool):
        self.cfg, self.w = cfg, w
        self.k_cache, self.v_cache = k_cache, v_cache  # [n_layers, num_blocks, block_size, Hkv, D]
        self.cos, self.sin = cos, sin  # [context, D/2] fp32
        self.sampled = sampled  # [MAX_SAMPLED] int32: the previous step's ids, for PENDING_TOKEN rows
        self.fuse = fuse  # fused QKV(+RoPE+KV write) and gate/up(+SiLU*up) where gemv_bf16x is chosen
        # decode rows' attention: None = paged_decode; (part_ml, part_acc, counters) = paged_decode_split with these work
        # buffers for up to split_rows rows (the graphs' largest batch; an eager step past it makes its own)
        self.split_work: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.split_rows = 0
        self.max_ctx = cos.shape[0]  # the context the rope tables cover: the split kernel's segment length follows it
        # decode rows on tensor cores, rows sharing a prefix reading it once (paged_decode_mma): its buffers for up to
        # mma_work.rows rows; the plan is made once a forward (`decode_plan`)
        self.mma_work: k_mma.Work | None = None

    def __call__(self, m: Meta, lora=None, keep: torch.Tensor | None = None):
        """logits [R, V] fp32 for m.out_rows (every row when None). lora: (imp.gpu.lora.DeviceLoras,
        row slots [N]) for a step with adapter rows: unfused, each projection gets its delta. keep (the logit
        lens): rows [K] int64 whose residual after each layer is kept; then (logits, residuals [L, K, d])."""
        if m.split is not None and lora is None and keep is None:
            return self.mixed(m)
        cfg, w = self.cfg, self.w
        H, Hkv, D, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_eps
        N = m.tokens.shape[0]
        if m.pending is not None:  # the previous step's samples, where this one feeds PENDING_TOKEN
            k_pending.fill_pending(m.tokens, m.pending[0], m.pending[1], self.sampled, m.pending[2])
        x = w.tok_embd.index_select(0, m.tokens)  # [N, d] residual stream
        delta = None  # [N, d] the residual add still pending (fused into the next norm)
        h = torch.empty_like(x)  # [N, d] normed input of the next matmul
        pr = bool(m.prefill)  # prompt rows here: the matmuls take their prompt numerics (Linear.mode)
        plan = self.decode_plan(m)
        resid = None if keep is None else x.new_empty(len(w.layers), keep.shape[0], x.shape[1])
        for i, L in enumerate(w.layers):
            qm = L.wqkv.mode(N, pr)
            hq = self.norm(x, delta, L.attn_norm, h, L.wqkv.takes_q8(N, pr) and lora is None)
            kc, vc = self.k_cache[i], self.v_cache[i]  # [num_blocks, bs, Hkv, D]
            kf, vf = kc.view(-1, Hkv * D), vc.view(-1, Hkv * D)  # [slots, Hkv D]
            fused = self.fuse and qm in gemv_fp32_act.XVARIANTS and lora is None
            if fused:  # one kernel: QKV GEMV, RoPE on q/k, k/v into the cache
                qkv = gemv_fp32_act.gemv_bf16x(L.wqkv.xw, h, variant=qm, mode="qkv",
                                       rope=(m.positions, self.cos, self.sin, (H + Hkv) * D), kv=(kf, vf, m.slots, H * D))
            else:
                qkv = L.wqkv.run(qm, h, hq)  # [N, (H + 2 Hkv) D]
                if lora is not None:
                    dl, idx = lora
                    dl.add(qkv[:, :H * D], h, i, 0, idx)
                    dl.add(qkv[:, H * D:(H + Hkv) * D], h, i, 1, idx)
                    dl.add(qkv[:, (H + Hkv) * D:], h, i, 2, idx)
                k_rope.rope_kv(qkv, m.positions, self.cos, self.sin, H, Hkv, kf, vf, m.slots)  # RoPE + KV write
            kn, vn = qkv[:, H * D:(H + Hkv) * D], qkv[:, (H + Hkv) * D:]  # [N, Hkv D] each
            om = L.wo.mode(N, pr)
            if m.all_decode and lora is None and L.wo.takes_q8(N, pr):  # attention writes O's int8 input directly
                delta = L.wo.run(om, None, self.decode_attn(qkv, kc, vc, m.dec_bt, m.dec_lens, q8=True, plan=plan))
            else:
                a = self.attention(qkv, kn, vn, kc, vc, m, N, plan)  # [N, H D]
                delta = L.wo.run(om, a)  # [N, d]
                if lora is not None:
                    lora[0].add(delta, a, i, 3, lora[1])
            gm = L.w13.mode(N, pr)
            hq = self.norm(x, delta, L.ffn_norm, h, L.w13.takes_q8(N, pr) and lora is None)
            actq = None  # SiLU(gate) * up already quantized for an int8 down GEMV
            if self.fuse and gm in gemv_fp32_act.XVARIANTS and lora is None:  # one kernel: gate/up GEMV, SiLU(gate) * up
                act = gemv_fp32_act.gemv_bf16x(L.w13.xw, h, variant=gm, mode="gated", act="silu")
            else:
                gu = L.w13.run(gm, h, hq)  # [N, 2 d_ff]: gate columns, then up
                if lora is not None:
                    F = gu.shape[1] // 2
                    lora[0].add(gu[:, :F], h, i, 4, lora[1])
                    lora[0].add(gu[:, F:], h, i, 5, lora[1])
                if L.w2.takes_q8(N, pr) and lora is None:
                    act, actq = None, quantize_act_int8.gated_act_q8(gu, "silu")
                else:
                    act = k_act.gated_act(gu, "silu")  # [N, d_ff]
            delta = L.w2.run(L.w2.mode(N, pr), act, actq)  # [N, d]
            if lora is not None:
                lora[0].add(delta, act, i, 6, lora[1])
            if resid is not None:  # the residual after layer i: x plus the add still pending
                resid[i] = x.index_select(0, keep) + delta.index_select(0, keep)
        if m.out_rows is not None:
            x, delta = x.index_select(0, m.out_rows), delta.index_select(0, m.out_rows)  # [R, d]
        logits = self.head(x, delta, pr)
        return logits if resid is None else (logits, resid)

    def head(self, x: torch.Tensor, delta: torch.Tensor, pr: bool = False) -> torch.Tensor:
        """The final norm (of x + delta) and the LM head: [R, V] fp32."""
        w, eps = self.w, self.cfg.rms_eps
        R = x.shape[0]
        if w.head.takes_q8(R, pr):
            return w.head.run(w.head.mode(R, pr), None, quantize_act_int8.add_rmsnorm_q8(x, delta, w.out_norm, eps))
        hf = k_norm.add_rmsnorm(x, delta, w.out_norm, eps)
        return w.head.run(w.head.mode(R, pr), hf)  # [R, V] fp32

    def mixed(self, m: Meta) -> torch.Tensor:
        """logits [R, V] of a step whose rows [0, P) are prompt rows and [P, N) one-token decodes
        (m.split = (P, Rp), the first Rp head rows the prompts'), when the two kinds take different
        matmul kernels (int8 decode GEMVs, prompts dense or on the int8 GEMM): every matmul runs per
        kind (`Linear.by_kind`), everything else once for all rows. Unfused: the norms and SiLU*up
        write fp32 and each int8 part is quantized from it, the same bits as the fused kernels
        (tests/test_gpu_q8.py), so a row gets exactly what it gets in a step of its kind alone, for
        one forward's launches instead of two."""
        cfg, w = self.cfg, self.w
        H, Hkv, D, eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rms_eps
        P, Rp = m.split
        N = m.tokens.shape[0]
        if m.pending is not None:
            k_pending.fill_pending(m.tokens, m.pending[0], m.pending[1], self.sampled, m.pending[2])
        x = w.tok_embd.index_select(0, m.tokens)  # [N, d]
        delta = None
        h = torch.empty_like(x)
        plan = self.decode_plan(m)
        for i, L in enumerate(w.layers):
            k_norm.add_rmsnorm(x, delta, L.attn_norm, eps, out=h)
            qkv = L.wqkv.by_kind(P, h)  # [N, (H + 2 Hkv) D]
            kc, vc = self.k_cache[i], self.v_cache[i]
            kf, vf = kc.view(-1, Hkv * D), vc.view(-1, Hkv * D)
            k_rope.rope_kv(qkv, m.positions, self.cos, self.sin, H, Hkv, kf, vf, m.slots)
            kn, vn = qkv[:, H * D:(H + Hkv) * D], qkv[:, (H + Hkv) * D:]
            delta = L.wo.by_kind(P, self.attention(qkv, kn, vn, kc, vc, m, N, plan))
            k_norm.add_rmsnorm(x, delta, L.ffn_norm, eps, out=h)
            delta = L.w2.by_kind(P, k_act.gated_act(L.w13.by_kind(P, h), "silu"))
        x, delta = x.index_select(0, m.out_rows), delta.index_select(0, m.out_rows)  # [R, d]
        return w.head.by_kind(Rp, k_norm.add_rmsnorm(x, delta, w.out_norm, eps))  # [R, V]

    def norm(self, x, delta, weight, h, q8: bool) -> quantize_act_int8.Q8Act | None:
        """x += delta; the normed x into h (fp32), or only quantized (returned) when the next GEMV is an
        int8 one: then h is not written."""
        if q8:
            return quantize_act_int8.add_rmsnorm_q8(x, delta, weight, self.cfg.rms_eps)
        k_norm.add_rmsnorm(x, delta, weight, self.cfg.rms_eps, out=h)
        return None

    def decode_plan(self, m: Meta):
        """paged_decode_mma's items for the step's decode rows (one small launch a forward, read by every layer), or
        None (another decode kernel, no decode rows, or more rows than the buffers: each launch plans its own)."""
        wk = self.mma_work
        if wk is None or m.dec_bt is None or m.dec_bt.shape[0] > wk.rows:
            return None
        return k_mma.decode_plan(m.dec_bt, m.dec_lens, self.k_cache.shape[2], wk)

    def decode_attn(self, q, kc, vc, bt, lens, out=None, q8: bool = False, plan=None):
        """The decode rows' attention (paged_decode's contract) by the server's kernel (`mma_work`, `split_work`)."""
        H = self.cfg.n_heads
        if self.mma_work is not None:
            return k_mma.paged_decode_mma(q, kc, vc, bt, lens, self.mma_work, out=out, q8=q8, plan=plan)
        if self.split_work is None:
            return k_attn.paged_decode(q, kc, vc, bt, lens, H, out=out, q8=q8)
        work = self.split_work if q.shape[0] <= self.split_rows else None
        return k_split.paged_decode_split(q, kc, vc, bt, lens, H, self.max_ctx, out=out, q8=q8, work=work)

    def attention(self, qkv, kn, vn, kc, vc, m: Meta, N: int, plan=None) -> torch.Tensor:
        """[N, H D] fp32: paged decode for one-token rows, paged prefill for the prompt rows."""
        H, D = self.cfg.n_heads, self.cfg.head_dim
        if m.all_decode:
            return self.decode_attn(qkv, kc, vc, m.dec_bt, m.dec_lens, plan=plan)
        out = torch.empty(N, H * D, dtype=torch.float32, device=qkv.device)
        if m.dec_bt is not None and m.dec_from is not None:
            self.decode_attn(qkv[m.dec_from:], kc, vc, m.dec_bt, m.dec_lens, out=out[m.dec_from:], plan=plan)
        elif m.dec_bt is not None:
            qd = qkv.index_select(0, m.dec_rows)
            out.index_copy_(0, m.dec_rows, self.decode_attn(qd, kc, vc, m.dec_bt, m.dec_lens, plan=plan))
        if m.pf_tiles is not None and PAGED_PREFILL and k_pf.supports(kc, H):  # every chunk in one launch, cached or not
            k_pf.paged_prefill(qkv, kc, vc, m.pf_tiles, m.pf_bt, H, out, last=m.pf_last)
            return out
        for r0, r1, ctx, start in m.prefill:  # fp32 caches: torch SDPA per chunk
            k_prefill.prefill_attention(qkv[r0:r1, :H * D], kn[r0:r1], vn[r0:r1], kc, vc, ctx, start, H, out[r0:r1])
        return out
