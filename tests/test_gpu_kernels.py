"""GPU kernels against their references: fresh random inputs (never zeros),
outputs poisoned with NaN first, several sizes. Marked `gpu`; the whole GPU
part skips cleanly without CUDA or CuPy. The repack/reference checks at the
top run on the CPU everywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from imp.kernels.cuda import gemv_fp32_act
from imp.formats.quants import dequantize
from tests.fixtures.synth_raw import random_blocks

FMT_T = {"Q4_0": T.Q4_0, "Q4_1": T.Q4_1, "Q8_0": T.Q8_0, "Q4_K": T.Q4_K, "Q6_K": T.Q6_K, "BF16": T.BF16}


def _weight(fmt: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, gemv_fp32_act.QWeight]:
    rng = np.random.default_rng(seed)
    be, _ = gemv_fp32_act.BLOCK[fmt]
    raw = random_blocks(FMT_T[fmt], rows * cols // be, cols ** -0.5, rng)
    return raw, gemv_fp32_act.repack(raw, fmt, rows, cols)


@pytest.mark.parametrize("fmt", gemv_fp32_act.FORMATS)
def test_repack_reference_matches_loader_dequant(fmt):
    raw, w = _weight(fmt, 8, 512, 1)
    want = dequantize(raw, FMT_T[fmt], (8, 512))
    assert np.array_equal(gemv_fp32_act.reference(w).numpy(), want)


def _gpu_ok() -> bool:
    from imp.kernels.cuda import runtime

    return runtime.available()


DEV = "cuda"


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output (unwritten or bad value)"
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def _poison(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", gemv_fp32_act.FORMATS)
@pytest.mark.parametrize("rows,cols", [(64, 256), (200, 512), (576, 1536)])
@pytest.mark.parametrize("B", [1, 3, 8, 13])
def test_gemv_fp32_act(fmt, rows, cols, B):
    _skip_without_gpu()
    _, w = _weight(fmt, rows, cols, rows + cols + B)
    w = w.to(DEV)
    x = torch.randn(B, cols, device=DEV)
    out = _poison(B, rows)
    gemv_fp32_act.gemv(w, x, out)
    assert _rel(out, gemv_fp32_act.gemv_reference(w, x)) < 1e-5


def _skip_without_gpu():
    if not _gpu_ok():
        pytest.skip("needs CUDA and CuPy")


@pytest.mark.gpu
def test_gemv_fp32_act_column_slice_and_strided_x():
    _skip_without_gpu()
    _, w = _weight("Q4_K", 96, 512, 7)
    w = w.to(DEV)
    xb = torch.randn(5, 600, device=DEV)
    x = xb[:, 8:520]  # row stride 600, 16-byte aligned start
    big = _poison(5, 300)
    gemv_fp32_act.gemv(w, x, big[:, 100:196])
    assert _rel(big[:, 100:196], gemv_fp32_act.gemv_reference(w, x)) < 1e-5
    assert torch.isnan(big[:, :100]).all() and torch.isnan(big[:, 196:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("N,d", [(1, 576), (7, 576), (33, 4096), (4, 64)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rmsnorm(N, d, with_delta):
    _skip_without_gpu()
    from imp.kernels.cuda import add_rmsnorm

    x = torch.randn(N, d, device=DEV) * 3
    delta = torch.randn(N, d, device=DEV) if with_delta else None
    w = torch.rand(d, device=DEV) + 0.5
    want_x, want = add_rmsnorm.reference(x, delta, w, 1e-5)
    out = _poison(N, d)
    add_rmsnorm.add_rmsnorm(x, delta, w, 1e-5, out=out)
    assert _rel(out, want) < 1e-5
    assert _rel(x, want_x) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("N,H,D", [(1, 12, 64), (9, 40, 128), (70, 3, 32)])
def test_rope(N, H, D):
    _skip_without_gpu()
    from imp.kernels.cuda import rope
    from imp.formats.gguf_loader import ModelConfig
    from imp.model.llama import rope_tables

    cfg = ModelConfig("llama", 1, H * D, H, H, D, 4, 10, 4096, 10000.0, 1e-5, True, {})
    cos, sin = (t.to(DEV) for t in rope_tables(cfg, 4096))
    qk = torch.randn(N, H * D + 17 * 2, device=DEV)[:, : H * D]  # row-strided view
    pos = torch.randint(0, 4096, (N,), dtype=torch.int32, device=DEV)
    want = rope.reference(qk, pos, cos, sin, H)
    rope.rope(qk, pos, cos, sin, H)
    assert _rel(qk.reshape(N, H, D), want) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,H,Hkv,D", [(1, 9, 3, 64), (13, 32, 8, 128)])
def test_rope_kv_is_rope_then_kv_write(dtype, N, H, Hkv, D):
    """The fused kernel: the same bits as rope() then kv_write_cupy(), slot -1 rows not written."""
    _skip_without_gpu()
    from imp.formats.gguf_loader import ModelConfig
    from imp.kernels.cuda import kv_write, rope
    from imp.model.llama import rope_tables

    cfg = ModelConfig("llama", 1, H * D, H, Hkv, D, 4, 10, 4096, 10000.0, 1e-5, True, {})
    cos, sin = (t.to(DEV) for t in rope_tables(cfg, 4096))
    W, S = Hkv * D, 64
    qkv = torch.randn(N, (H + 2 * Hkv) * D + 6, device=DEV)[:, :(H + 2 * Hkv) * D]  # row-strided view
    pos = torch.randint(0, 4096, (N,), dtype=torch.int32, device=DEV)
    slots = torch.randperm(S, device=DEV)[:N].to(torch.int32)
    slots[::4] = -1
    kc, vc = torch.randn(S, W, device=DEV).to(dtype), torch.randn(S, W, device=DEV).to(dtype)
    q1, kc1, vc1 = qkv.clone(), kc.clone(), vc.clone()
    rope.rope(q1, pos, cos, sin, H + Hkv)
    kv_write.kv_write_cupy(q1[:, H * D:(H + Hkv) * D], q1[:, (H + Hkv) * D:], kc1, vc1, slots)
    rope.rope_kv(qkv, pos, cos, sin, H, Hkv, kc, vc, slots)
    assert torch.equal(qkv, q1) and torch.equal(kc, kc1) and torch.equal(vc, vc1)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["silu", "gelu"])
@pytest.mark.parametrize("N,F", [(1, 1536), (5, 14336), (64, 96)])
def test_gated_act(kind, N, F):
    _skip_without_gpu()
    from imp.kernels.cuda import gated_act

    gu = torch.randn(N, 2 * F, device=DEV) * 4
    out = _poison(N, F)
    gated_act.gated_act(gu, kind, out=out)
    assert _rel(out, gated_act.reference(gu, kind)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,W,S", [(1, 192, 64), (37, 1024, 512), (200, 64, 4096)])
def test_kv_write_numba(dtype, N, W, S):
    _skip_without_gpu()
    from imp.kernels.cuda import kv_write

    qkv = torch.randn(N, 3 * W, device=DEV)
    k, v = qkv[:, W:2 * W], qkv[:, 2 * W:]
    kc = torch.randn(S, W, device=DEV).to(dtype)
    vc = torch.randn(S, W, device=DEV).to(dtype)
    slots = torch.randperm(S, device=DEV)[:N].to(torch.int32)
    slots[:: 5] = -1
    want_k, want_v = kv_write.reference(k, v, kc, vc, slots)
    kc2, vc2 = kc.clone(), vc.clone()
    kv_write.kv_write(k, v, kc, vc, slots)
    kv_write.kv_write_cupy(k, v, kc2, vc2, slots)
    torch.cuda.synchronize()
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)  # bf16: same rounding as torch's .to()
    assert torch.equal(kc2, want_k) and torch.equal(vc2, want_v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,Hkv,D,bs,lens", [
    (1, 9, 3, 64, 16, [1]),
    (3, 9, 3, 64, 16, [17, 300, 64]),
    (5, 32, 8, 128, 16, [130, 1, 513, 0, 1000]),
    (2, 8, 8, 128, 32, [2000, 33]),
])
def test_paged_decode(dtype, B, H, Hkv, D, bs, lens):
    _skip_without_gpu()
    from imp.kernels.cuda import paged_decode_attention as pa

    nblocks = 200
    kc = torch.randn(nblocks, bs, Hkv, D, device=DEV).to(dtype)
    vc = torch.randn(nblocks, bs, Hkv, D, device=DEV).to(dtype)
    maxb = max((L + bs - 1) // bs for L in lens) + 2
    bt = torch.stack([torch.randperm(nblocks, device=DEV)[:maxb] for _ in range(B)]).to(torch.int32)
    ln = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(B, (H + 2 * Hkv) * D, device=DEV) * 2
    out = _poison(B, H * D)
    pa.paged_decode(q, kc, vc, bt, ln, H, out=out)
    ref = pa.reference(q, kc, vc, bt, ln, H)
    if 0 in lens:
        assert (out[lens.index(0)] == 0).all()
    assert _rel(out, ref) < 1e-5
    from imp.kernels.cuda import quantize_act_int8  # the int8 output for an int8 O projection: the output, quantized

    xa, want = pa.paged_decode(q, kc, vc, bt, ln, H, q8=True), quantize_act_int8.quantize(out)
    assert torch.equal(xa.xq, want.xq) and torch.equal(xa.xds, want.xds)


@pytest.mark.gpu
@pytest.mark.parametrize("T_,H,Hkv,D", [(7, 9, 3, 64), (300, 32, 8, 128)])
def test_prefill_attention_fp32(T_, H, Hkv, D):
    _skip_without_gpu()
    from imp.kernels.cuda import prefill_attention_sdpa as pf

    q = torch.randn(T_, H * D, device=DEV)
    k = torch.randn(T_, Hkv * D, device=DEV)
    v = torch.randn(T_, Hkv * D, device=DEV)
    kc = torch.zeros(1, 16, Hkv, D, device=DEV)
    out = _poison(T_, H * D)
    pf.prefill_attention(q, k, v, kc, kc, None, 0, H, out)
    assert _rel(out, pf.reference(q, k, v, H)) < 1e-4  # TF32-free fp32 path; loose for backend choice


@pytest.mark.gpu
def test_penalize_segments_kernel_is_the_numpy_rule_bitwise():
    """The one-launch penalty kernel against its numpy twin (which tests/test_pending_penalty.py holds to the
    CPU reference): random penalties, histories with repeats and ids outside V, in-flight ids that the history
    has or lacks, read from other slots of a device buffer."""
    _skip_without_gpu()
    import random

    from imp.messages import SamplingParams, SeqWork
    from imp.sampling.gpu import bias_and_penalties

    rng = random.Random(3)
    for R, V in ((1, 49152), (37, 1000), (256, 4096)):
        works, rows, slots = [], [], []
        for r in range(R):
            p = SamplingParams(max_tokens=8, repetition_penalty=rng.choice([1.0, 1.05, 1.3, 0.8]),
                               presence_penalty=rng.choice([0.0, 0.5]), frequency_penalty=rng.choice([0.0, 0.2, -0.1]))
            h = tuple(rng.randrange(-2, V + 2) if rng.random() < 0.05 else rng.randrange(min(V, 60))
                      for _ in range(rng.randrange(0, 300)))
            works.append(SeqWork(seq_id=str(r), token_ids=(0,), start_pos=5, block_table=(0,), sample=True,
                                 params=p, history=h))
            if rng.random() < 0.7:
                rows.append(r)
                slots.append(rng.randrange(512))
        src = torch.tensor([rng.randrange(min(V, 80)) for _ in range(512)], dtype=torch.int32)
        logits = torch.randn(R, V) * 4
        cpu = logits.clone()
        bias_and_penalties(cpu, works, pending=(rows, src, slots))
        gpu = logits.to(DEV)
        bias_and_penalties(gpu, works, pending=(rows, src.to(DEV), slots))
        assert torch.equal(gpu.cpu(), cpu), (R, V)
        assert not torch.equal(cpu, logits)


@pytest.mark.gpu
def test_sampling_filters_and_penalties_match_cpu():
    _skip_without_gpu()
    from imp.kernels.cuda import sampling as kernels
    from imp.messages import SamplingParams, SeqWork
    from imp.sampling import gpu as sampling

    V = 1000
    logits = torch.randn(4, V, device=DEV) * 3
    ps = [
        SamplingParams(max_tokens=1, temperature=0.7, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
                       presence_penalty=0.5, frequency_penalty=0.2, logit_bias=((3, 5.0), (999, -2.0), (5000, 1.0))),
        SamplingParams(max_tokens=1, temperature=1.3, top_p=0.5),
        SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((7, 100.0),)),
        SamplingParams(max_tokens=1, temperature=0.9, top_k=1),
    ]
    works = [SeqWork(seq_id=str(i), token_ids=[1], start_pos=0, block_table=[0], sample=True, params=p,
                     history=[3, 3, 10, 11, 999] if i == 0 else []) for i, p in enumerate(ps)]
    x = logits.clone()
    sampling.bias_and_penalties(x, works, use_numba=True)
    x_t = logits.clone()
    sampling.bias_and_penalties(x_t, works, use_numba=False)
    assert torch.allclose(x, x_t)
    ref = sampling.reference_processed(logits, works)  # CPU reference, rows processed fully
    for r in (0, 1, 3):
        p = ps[r]
        f = kernels.filter_logits(x[r:r + 1], torch.tensor([p.temperature], device=DEV),
                                   torch.tensor([p.top_k], device=DEV), torch.tensor([p.top_p], device=DEV),
                                   torch.tensor([p.min_p], device=DEV))[0].cpu()
        assert torch.equal(torch.isinf(f), torch.isinf(ref[r])), r
        fin = ~torch.isinf(f)
        assert torch.allclose(f[fin], ref[r][fin], rtol=1e-5, atol=1e-5)
    toks = sampling.sample(logits, works)
    assert toks[2].token_id == 7
    assert toks[3].token_id == int(torch.argmax(ref[3]))
    for r in (0, 1):
        assert not torch.isinf(ref[r][toks[r].token_id])
    again = sampling.sample(logits, works)
    assert [t.token_id for t in again] == [t.token_id for t in toks]  # (seed, gen_index) fixes the draw


@pytest.mark.gpu
def test_gumbel_draw_follows_distribution():
    _skip_without_gpu()
    from imp.kernels.cuda import sampling

    V, R = 8, 20000
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02], device=DEV)
    g = sampling.gumbel_noise(torch.arange(R, device=DEV), torch.full((R,), 3, device=DEV), V)
    draws = torch.argmax(probs.log()[None, :] + g, -1)
    freq = torch.bincount(draws, minlength=V).float() / R
    assert (freq - probs).abs().max() < 0.015


@pytest.mark.gpu
def test_gumbel_noise_is_always_finite():
    """The noise must never be +inf: -inf (a filtered or grammar-masked logit) + inf is NaN, and
    argmax picks a NaN, so a masked token came out about once in 2^24 / V draws (found through
    HTTP: forced tool calls on the GPU broke their grammar ~5 % of the time). 2^26 draws would
    have hit the old kernel's u == 1 with probability 98 %."""
    _skip_without_gpu()
    from imp.kernels.cuda import sampling

    R, V = 256, 1 << 18
    g = sampling.gumbel_noise(torch.arange(R, device=DEV), torch.full((R,), 7, device=DEV), V)
    assert torch.isfinite(g).all(), int((~torch.isfinite(g)).sum())
    masked = torch.full((R, V), float("-inf"), device=DEV)
    masked[:, 5] = 0.0  # one allowed token per row: the draw must be it, every row
    assert (torch.argmax(masked + g, -1) == 5).all()


# ------------------------------------------------------------------ gemv_bf16x (two rows a warp, fused epilogues)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(gemv_fp32_act.XVARIANTS))
@pytest.mark.parametrize("rows,cols", [(64, 256), (201, 520), (576, 1536), (96, 4096)])
@pytest.mark.parametrize("B", [1, 3, 8, 13])
def test_gemv_bf16x_plain(variant, rows, cols, B):
    _skip_without_gpu()
    _, w = _weight("BF16", rows, cols, rows + cols + B)
    w = w.to(DEV)
    xb = torch.randn(B, cols + 4, device=DEV)
    x = xb[:, 4:]  # row-strided, 16-byte aligned
    out = _poison(B, rows)
    gemv_fp32_act.gemv_bf16x(w, x, out, variant=variant)
    assert _rel(out, gemv_fp32_act.gemv_reference(w, x)) < 1e-5
    if gemv_fp32_act.XVARIANTS[variant][2] == 1:  # no K split: same per-lane chunk order and reduction as gemv_bf16
        assert torch.equal(out, gemv_fp32_act.gemv(w, x))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(gemv_fp32_act.XVARIANTS))
@pytest.mark.parametrize("kind", ["silu", "gelu"])
@pytest.mark.parametrize("F,cols,B", [(96, 512, 1), (700, 264, 5), (64, 4096, 8)])
def test_gemv_bf16x_gated(variant, kind, F, cols, B):
    _skip_without_gpu()
    from imp.kernels.cuda import gated_act

    _, w = _weight("BF16", 2 * F, cols, F + cols + B)
    w = w.to(DEV)
    x = torch.randn(B, cols, device=DEV)
    out = _poison(B, F)
    gemv_fp32_act.gemv_bf16x(w, x, out, variant=variant, mode="gated", act=kind)
    assert _rel(out, gated_act.reference(gemv_fp32_act.gemv_reference(w, x), kind)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(gemv_fp32_act.XVARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,H,Hkv,D,cols", [(1, 4, 2, 64, 256), (6, 8, 2, 128, 512), (9, 6, 6, 32, 200)])
def test_gemv_bf16x_qkv_rope_kv(variant, dtype, B, H, Hkv, D, cols):
    _skip_without_gpu()
    from imp.kernels.cuda import kv_write, rope
    from imp.formats.gguf_loader import ModelConfig
    from imp.model.llama import rope_tables

    cfg = ModelConfig("llama", 1, H * D, H, Hkv, D, 4, 10, 4096, 10000.0, 1e-5, True, {})
    cos, sin = (t.to(DEV) for t in rope_tables(cfg, 4096))
    N, W, S = (H + 2 * Hkv) * D, Hkv * D, 64
    _, w = _weight("BF16", N, cols, N + cols + B)
    w = w.to(DEV)
    x = torch.randn(B, cols, device=DEV)
    pos = torch.randint(0, 4096, (B,), dtype=torch.int32, device=DEV)
    slots = torch.randperm(S, device=DEV)[:B].to(torch.int32)
    slots[1::3] = -1
    kc = torch.randn(S, W, device=DEV).to(dtype)
    vc = torch.randn(S, W, device=DEV).to(dtype)
    ref = gemv_fp32_act.gemv(w, x)
    rope.rope(ref, pos, cos, sin, H + Hkv)
    want_k, want_v = kv_write.reference(ref[:, H * D:(H + Hkv) * D], ref[:, (H + Hkv) * D:], kc, vc, slots)
    out = _poison(B, N)
    gemv_fp32_act.gemv_bf16x(w, x, out, variant=variant, mode="qkv", rope=(pos, cos, sin, (H + Hkv) * D),
                     kv=(kc, vc, slots, H * D))
    torch.cuda.synchronize()
    assert _rel(out, ref) < 1e-6
    assert _rel(out, gemv_fp32_act.gemv_reference(w, x)) > 1e-3  # RoPE was applied (positions are random)
    tol = 1e-6 if dtype == torch.float32 else 5e-3
    written = slots[slots >= 0].long()
    untouched = torch.ones(S, dtype=torch.bool, device=DEV)
    untouched[written] = False
    assert torch.equal(kc[untouched], want_k[untouched]) and torch.equal(vc[untouched], want_v[untouched])
    assert _rel(kc[written].float(), want_k[written].float()) < tol
    assert _rel(vc[written].float(), want_v[written].float()) < tol


def test_gemv_bf16x_rejects_bad_layouts():
    w = gemv_fp32_act.QWeight("Q4_0", 4, 64, {})
    with pytest.raises(ValueError):
        gemv_fp32_act.gemv_bf16x(w, torch.zeros(1, 64))
    assert not gemv_fp32_act.x_ok(gemv_fp32_act.QWeight("BF16", 4, 60, {}))
    assert gemv_fp32_act.x_ok(gemv_fp32_act.QWeight("BF16", 4, 64, {}))
