"""The int8-activation GEMV (`imp.kernels.cuda.gemv_int8_act`) against its references.

On the CPU everywhere: the torch reference quantization equals the CPU kernels'
(`imp.kernels.cpu.gemm_int8_act.quantize_rows`) bit for bit, so the GPU and CPU runners quantize
activations identically. On the GPU (marked `gpu`): the quantize kernel equals
the reference bit for bit; every format, odd shapes, batch 1..64 and every rows-
a-warp variant against the float64 product of the dequantized weight and the
dequantized activations; batch invariance (a row's output is the same bits alone
or in any batch, with any variant); the runner on int8 activations matches the
CPU runner's GGUF-block path (which quantizes the same way)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from imp.kernels.cpu import gemm_int8_act as cpu_gemm
from imp.kernels.cuda import gemv_int8_act, quantize_act_int8
from imp.kernels.cuda.quant_weight import gemv_reference, repack
from tests.fixtures.synth_raw import random_blocks

FMT_T = {"Q4_0": T.Q4_0, "Q4_1": T.Q4_1, "Q8_0": T.Q8_0, "Q4_K": T.Q4_K, "Q6_K": T.Q6_K}
BLOCK_ELEMS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256}


def _weight(fmt: str, rows: int, cols: int, seed: int):
    rng = np.random.default_rng(seed)
    raw = random_blocks(FMT_T[fmt], rows * cols // BLOCK_ELEMS[fmt], cols ** -0.5, rng)
    return repack(raw, fmt, rows, cols)


def _x(B: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, K, generator=g)
    x[:, :32] *= 30.0  # one block with a large range, one all zero (the xd = 0 branch)
    if K >= 64:
        x[0, 32:64] = 0.0
    return x


def test_reference_quantize_is_the_cpu_kernels_quantization():
    x = _x(5, 512, 1)
    xq, xds = quantize_act_int8.reference(x)
    N, K = x.shape
    q = np.zeros((N, K), np.int8)
    d = np.zeros((N, K // 32), np.float32)
    s = np.zeros((N, K // 32), np.float32)
    cpu_gemm.quantize_rows(x.numpy(), q, d, s)
    assert np.array_equal(xq.numpy(), q)
    assert np.array_equal(xds[..., 0].numpy(), d) and np.array_equal(xds[..., 1].numpy(), s)
    assert (xds[0, 1] == 0).all()  # the zero block


def test_q8_reference_is_close_to_the_float_product():
    """The int8 activations' error itself: small against the unquantized product (what llama.cpp accepts)."""
    w = _weight("Q4_K", 64, 512, 3)
    x = _x(3, 512, 4)
    got = gemv_int8_act.reference(w, x)
    want = gemv_reference(w, x)
    assert float((got - want).norm() / want.norm()) < 2e-2


# ------------------------------------------------------------------ GPU


def _gpu_ok() -> bool:
    from imp.kernels.cuda import runtime

    return runtime.available()


gpu = pytest.mark.skipif(not _gpu_ok(), reason="needs CUDA and CuPy")
DEV = "cuda"


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output (unwritten or bad value)"
    return float((out.double().cpu() - ref.double().cpu()).norm() / ref.double().norm().clamp(min=1e-30))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("B,K", [(1, 256), (3, 512), (13, 1536), (64, 4096)])
def test_quantize_kernel_matches_reference_bitwise(B, K):
    x = _x(B, K, B + K)
    xa = gemv_int8_act.quantize(x.to(DEV))
    xq, xds = gemv_int8_act.reference_quantize(x)
    assert torch.equal(xa.xq.cpu(), xq)
    assert torch.equal(xa.xds.cpu(), xds)
    # a strided x (a column slice of a wider buffer) gives the same
    big = torch.zeros(B, K + 64, device=DEV)
    big[:, 32:32 + K] = x.to(DEV)
    xa2 = gemv_int8_act.quantize(big[:, 32:32 + K])
    assert torch.equal(xa2.xq, xa.xq) and torch.equal(xa2.xds, xa.xds)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", gemv_int8_act.FORMATS)
@pytest.mark.parametrize("rows,cols", [(64, 256), (203, 512), (576, 1536)])
@pytest.mark.parametrize("B", [1, 2, 5, 8, 13, 64])
def test_q8_gemv_matches_reference(fmt, rows, cols, B):
    w = _weight(fmt, rows, cols, rows + cols + B)
    x = _x(B, cols, 7 * B + rows)
    ref = gemv_int8_act.reference(w, x)
    wd = w.to(DEV)
    xa = gemv_int8_act.quantize(x.to(DEV))
    for name, (r, ks) in gemv_int8_act.VARIANTS.items():
        out = torch.full((B, rows), float("nan"), device=DEV)
        gemv_int8_act.gemv(wd, xa, out, rows=r, split=ks)
        assert _rel(out, ref) < 1e-5, (name, _rel(out, ref))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", gemv_int8_act.FORMATS)
def test_q8_gemv_batch_invariant_and_column_slice(fmt):
    rows, cols, B = 203, 1024, 21
    wd = _weight(fmt, rows, cols, 11).to(DEV)
    xa = gemv_int8_act.quantize(_x(B, cols, 12).to(DEV))
    for ks in gemv_int8_act.SPLITS:
        full = {r: gemv_int8_act.gemv(wd, xa, rows=r, split=ks) for r in gemv_int8_act.ROWS}
        for r in gemv_int8_act.ROWS:  # rows a group: the same per-row chain
            assert torch.equal(full[r], full[1]), (ks, r)
        for i in (0, 7, 20):  # a row alone = the same row in a batch of 21 (tiles of 8, last tile partial)
            one = gemv_int8_act.Q8Act(xa.xq[i:i + 1].contiguous(), xa.xds[i:i + 1].contiguous())
            assert torch.equal(gemv_int8_act.gemv(wd, one, rows=2, split=ks)[0], full[1][i]), (ks, i)
        big = torch.full((B, rows + 40), float("nan"), device=DEV)
        gemv_int8_act.gemv(wd, xa, big[:, 20:20 + rows], rows=4, split=ks)
        assert torch.equal(big[:, 20:20 + rows], full[1])
    assert torch.isnan(big[:, :20]).all() and torch.isnan(big[:, 20 + rows:]).all()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,d", [(1, 576), (5, 4096), (3, 96)])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rmsnorm_q8_is_the_norm_then_quantize(N, d, with_delta):
    from imp.kernels.cuda import add_rmsnorm, quantize_act_int8

    g = torch.Generator().manual_seed(N * d)
    x0 = (torch.randn(N, d, generator=g) * 3).to(DEV)
    dl = torch.randn(N, d, generator=g).to(DEV) if with_delta else None
    w = (torch.rand(d, generator=g) + 0.5).to(DEV)
    x1, x2 = x0.clone(), x0.clone()
    h = add_rmsnorm.add_rmsnorm(x1, dl, w, 1e-5)
    xa = quantize_act_int8.add_rmsnorm_q8(x2, dl, w, 1e-5)
    assert torch.equal(x1, x2)  # the residual add in place, the same
    xq, xds = quantize_act_int8.reference(h.cpu())
    assert torch.equal(xa.xq.cpu(), xq) and torch.equal(xa.xds.cpu(), xds)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("N,F", [(1, 1536), (7, 14336), (2, 32)])
def test_gated_act_q8_is_the_activation_then_quantize(N, F):
    from imp.kernels.cuda import gated_act, quantize_act_int8

    gu = (torch.randn(N, 2 * F, generator=torch.Generator().manual_seed(F)) * 2).to(DEV)
    xa = quantize_act_int8.gated_act_q8(gu, "silu")
    xq, xds = quantize_act_int8.reference(gated_act.gated_act(gu, "silu").cpu())
    assert torch.equal(xa.xq.cpu(), xq) and torch.equal(xa.xds.cpu(), xds)
    ga = quantize_act_int8.gated_act_q8(gu, "gelu")
    want = gated_act.reference(gu, "gelu").cpu()
    got = quantize_act_int8.dequant(ga.xq.cpu(), ga.xds.cpu())
    assert float((got - want).norm() / want.norm()) < 2e-2


@pytest.mark.gpu
@gpu
def test_q8_gemv_rejects_what_it_cannot_do():
    from imp.kernels.cuda.quant_weight import QWeight

    xa = gemv_int8_act.quantize(torch.randn(2, 256, device=DEV))
    with pytest.raises(ValueError, match="BF16"):
        gemv_int8_act.gemv(QWeight("BF16", 4, 256, {}), xa)
    with pytest.raises(ValueError, match="columns"):
        gemv_int8_act.gemv(_weight("Q8_0", 8, 512, 1).to(DEV), xa)
    with pytest.raises(ValueError, match="multiple of 32"):
        gemv_int8_act.quantize(torch.randn(2, 100, device=DEV))
    with pytest.raises(ValueError, match="split"):
        gemv_int8_act.gemv(_weight("Q8_0", 8, 256, 1).to(DEV), xa, split=2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K])
def test_runner_on_int8_activations_matches_the_cpu_block_path(tmp_path_factory, qtype):
    """Every quantized matmul on int8 activations (no dense copy: decode rows on the dp4a GEMV, prompt rows and
    batches past 8 on the int8 tensor-core GEMM): logits with the CPU runner's
    GGUF-block path (the same activation quantization), not with its fp32 weights; graph replay = eager.
    Greedy equality with the CPU is SmolLM2's test (test_gpu_runner): these random models flip tokens on
    near-ties between any two numerics."""
    from imp.gpu import linear as gpu_linear
    from imp.gpu.runner import GpuModelRunner
    from imp.messages import SamplingParams, SeqWork
    from imp.model.runner import ModelRunner
    from tests.test_gpu_runner import BS, PROMPTS, _model, greedy_run

    path = _model(tmp_path_factory, qtype)
    cpu = ModelRunner.load(path, num_blocks=64, block_size=BS, kv_dtype=torch.float32)  # "gguf": q8 activations
    gpu_ = GpuModelRunner.load(path, num_blocks=64, block_size=BS, kv_dtype=torch.float32, dense=False,
                               max_graph_batch=8, int8_act=True)
    assert not gpu_.notes, gpu_.notes
    w = gpu_.w.layers[0]
    for lin in (w.wqkv, w.wo, w.w13, w.w2):
        assert lin.q8 and all(lin.mode(n) in gemv_int8_act.VARIANTS for n in (1, 8)), lin.key
        assert lin.mode(9) == lin.mode(300) == lin.mode(1, prompt=True) == "qmm", lin.key
    g = SamplingParams(max_tokens=64)
    seqs = [SeqWork(seq_id=str(i), token_ids=p, start_pos=0, block_table=list(range(4 * i, 4 * i + 4)),
                    sample=True, params=g) for i, p in enumerate(PROMPTS)]
    ref = torch.from_numpy(cpu.forward(seqs)).double()
    f32 = torch.from_numpy(ModelRunner.load(path, num_blocks=64, block_size=BS, weights="f32").forward(seqs)).double()
    got = gpu_.forward(seqs).double().cpu()
    rel = float((got - ref).norm() / ref.norm())
    rel_f32 = float((got - f32).norm() / f32.norm())
    # int8 activations move these random 2-layer models' logits ~1e-2 (CPU block path vs fp32 weights: 1.1e-2);
    # the GPU's int8 path must sit with the CPU's int8 path, well inside that
    assert rel < 6e-3 and rel < 0.6 * rel_f32, (rel, rel_f32)
    # and the graphs replay the eager numerics: greedy tokens equal with and without graphs
    eager = GpuModelRunner.load(path, num_blocks=64, block_size=BS, kv_dtype=torch.float32, dense=False,
                                graphs=False, max_graph_batch=8, int8_act=True)
    assert greedy_run(gpu_, PROMPTS, 12) == greedy_run(eager, PROMPTS, 12)
    assert gpu_linear.Q8_DEFAULT in gemv_int8_act.VARIANTS


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dense", [True, False])
def test_numerics_follow_the_row_kind_not_the_traffic(tmp_path_factory, dense):
    """Prompt rows on the dense copy (without one: the int8 GEMM) at any count, decode rows on the int8 GEMV
    up to 8 rows. A step that mixes a prompt with decodes runs as two forwards, so its tokens equal the
    prompt's alone and the decodes' alone."""
    from imp.gpu.runner import GpuModelRunner
    from imp.messages import SamplingParams, SeqWork
    from tests.test_gpu_runner import BS, _model

    path = _model(tmp_path_factory, T.Q4_K)
    gpu_ = GpuModelRunner.load(path, num_blocks=64, block_size=BS, kv_dtype=torch.float32, dense=dense,
                               max_graph_batch=8, int8_act=True)
    L = gpu_.w.layers[0]
    assert gpu_._split_mixed
    big = "dense" if dense else "qmm"
    assert L.wqkv.mode(3, prompt=True) == big and L.wqkv.mode(300) == big
    assert L.wqkv.mode(1) in gemv_int8_act.VARIANTS and L.w2.mode(8) in gemv_int8_act.VARIANTS
    g = SamplingParams(max_tokens=64)
    A, B, C = [5, 9, 200, 3, 17], list(range(40, 77)), list(range(100, 120))

    def share(sid, toks, start, table):
        return SeqWork(seq_id=sid, token_ids=toks, start_pos=start, block_table=table, sample=True, params=g)

    ta, tb = [0, 1, 2, 3], [10, 11, 12, 13]
    a0, b0 = (t.token_id for t in gpu_.step([share("a", A, 0, ta), share("b", B, 0, tb)]))
    dec = [share("a", [a0], len(A), ta), share("b", [b0], len(B), tb)]
    alone_dec = [t.token_id for t in gpu_.step(dec)]  # a graph replay (decode only)
    alone_c = gpu_.step([share("c", C, 0, [20, 21])])[0].token_id
    mixed = [t.token_id for t in gpu_.step([share("c", C, 0, [20, 21])] + dec)]
    assert mixed == [alone_c] + alone_dec


def test_launcher_checks_shared_by_the_gemv_and_gemm_launchers():
    from imp.kernels.cuda.quant_weight import QWeight, check_parts, out_for

    w = QWeight("Q4_K", 4, 256, {"blocks": torch.zeros(8, 144, dtype=torch.uint8)[::2]})  # not contiguous
    with pytest.raises(ValueError, match="weight part blocks must be contiguous"):
        check_parts(w, ("blocks", None), torch.device("cpu"))
    check_parts(QWeight("Q4_K", 4, 256, {"blocks": torch.zeros(4, 144, dtype=torch.uint8)}), ("blocks",), torch.device("cpu"))
    assert tuple(out_for(w, 3, None, "cpu").shape) == (3, 4)


@pytest.mark.gpu
@gpu
def test_batch_invariant_rows_do_not_depend_on_their_neighbours(tmp_path_factory):
    """--batch-invariant: every matmul on the int8 GEMM, no dense copy; a prompt's last row and a decode row
    give the same logits, bit for bit, alone and beside prompts or decodes of any count (the GEMV's 8-row
    limit, the graph buckets and the GEMM's tile choice crossed)."""
    from imp.gpu.runner import GpuModelRunner
    from imp.messages import SamplingParams, SeqWork
    from tests.test_gpu_runner import BS, _model

    path = _model(tmp_path_factory, T.Q4_K)
    g = GpuModelRunner.load(path, num_blocks=96, block_size=BS, kv_dtype=torch.bfloat16, max_graph_batch=16,
                            int8_act=True, batch_invariant=True)
    L = g.w.layers[0]
    assert not g._split_mixed and all(m.dense is None for m in (L.wqkv, L.wo, L.w13, L.w2, g.w.head))
    assert {m.mode(n, p) for m in (L.wqkv, L.wo, L.w13, L.w2, g.w.head) for n in (1, 8, 9, 300)
            for p in (False, True)} == {"qmm"}
    sp = SamplingParams(max_tokens=8)

    def share(sid, toks, start, table):
        return SeqWork(seq_id=sid, token_ids=toks, start_pos=start, block_table=table, sample=True, params=sp)

    A = [5, 9, 200, 3, 17]
    alone = g.forward([share("a", A, 0, [0])])[0]
    for n in (3, 30, 100):  # prompt row beside another prompt of n rows
        both = g.forward([share("o", list(range(40, 40 + n)), 0, list(range(1, 1 + -(-n // BS)))),
                          share("a", A, 0, [0])])
        assert torch.equal(both[1], alone), n
    dec = g.forward([share("a", [7], len(A), [0])])[0]
    for n in (1, 7, 8, 20, 40):  # decode row beside n one-token rows: 2 .. 41 rows
        rows = g.forward([share(f"d{i}", [11 + i], 0, [10 + i]) for i in range(n)] + [share("a", [7], len(A), [0])])
        assert torch.equal(rows[-1], dec), n
