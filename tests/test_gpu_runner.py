"""GpuModelRunner against the CPU ModelRunner (fp32 weights) on synthetic
models: greedy tokens equal for a batch of mixed prompt lengths, through the
eager path (prefill, mixed steps) and the CUDA-graph decode path; SmolLM2 too
when its GGUF is at hand. Marked `gpu`; skipped cleanly without CUDA/CuPy."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from imp.messages import SamplingParams, SeqWork

pytestmark = pytest.mark.gpu


def _gpu_ok() -> bool:
    from imp.kernels.cuda import runtime

    return runtime.available()


if not _gpu_ok():
    pytest.skip("needs CUDA and CuPy", allow_module_level=True)

GREEDY = SamplingParams(max_tokens=64)
BS = 16


def _model(tmp_path_factory, qtype: T) -> str:
    d = tmp_path_factory.mktemp("gpu_models")
    path = d / f"synth_{qtype.name}.gguf"
    shape = dict(n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, vocab=512)
    if qtype in (T.Q4_K, T.Q6_K):
        from tests.fixtures.synth_raw import write_raw_gguf

        return write_raw_gguf(path, qtype=qtype, embed_qtype=T.Q8_0, head_qtype=T.Q6_K, tied=False,
                              overrides={"attn_v.weight": T.Q6_K} if qtype == T.Q4_K else None, **shape)
    from tests.fixtures.synth import write_synthetic_gguf

    # untied head: a tied random model just repeats its input token (too easy a test)
    return write_synthetic_gguf(path, qtype=qtype, embed_qtype=T.Q8_0 if qtype != T.BF16 else T.BF16,
                                tied=qtype == T.Q8_0, **shape)


def greedy_run(runner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill all prompts in one (mixed-length) step, then `steps` decode steps."""
    tables, base = [], 0
    for p in prompts:
        nb = (len(p) + steps) // BS + 1
        tables.append(list(range(base + nb - 1, base - 1, -1)))  # reversed: non-trivial block ids
        base += nb
    seqs = [SeqWork(seq_id=str(i), token_ids=p, start_pos=0, block_table=tables[i], sample=True, params=GREEDY)
            for i, p in enumerate(prompts)]
    out = [[t.token_id] for t in runner.step(seqs)]
    for _ in range(steps - 1):
        seqs = [SeqWork(seq_id=str(i), token_ids=[o[-1]], start_pos=len(p) + len(o) - 1, block_table=tables[i],
                        sample=True, params=GREEDY, gen_index=len(o))
                for i, (p, o) in enumerate(zip(prompts, out))]
        for o, t in zip(out, runner.step(seqs)):
            o.append(t.token_id)
    return out


PROMPTS = [[5, 9, 200, 3, 17], list(range(40, 77)), [300], list(range(100, 120))]


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.BF16])
@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_matches_cpu(tmp_path_factory, qtype, graphs):
    from imp.gpu.runner import GpuModelRunner
    from imp.model.runner import ModelRunner

    path = _model(tmp_path_factory, qtype)
    cpu = ModelRunner.load(path, num_blocks=64, block_size=BS, weights="f32")
    gpu = GpuModelRunner.load(path, num_blocks=64, block_size=BS, kv_dtype=torch.float32, dense=False,
                              graphs=graphs, max_graph_batch=8, int8_act=False)  # fp32 activations, as the CPU's f32
    assert not gpu.notes, gpu.notes  # Numba's self-check passed, graphs captured
    assert gpu.use_numba_sampling
    if graphs:
        assert gpu.graph_buckets() == (1, 2, 4, 8)
    want = greedy_run(cpu, PROMPTS, 12)
    got = greedy_run(gpu, PROMPTS, 12)
    assert got == want


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K])
def test_logits_close_and_dense_path(tmp_path_factory, qtype):
    from imp.gpu.runner import GpuModelRunner
    from imp.model.runner import ModelRunner

    path = _model(tmp_path_factory, qtype)
    cpu = ModelRunner.load(path, num_blocks=64, block_size=BS, weights="f32")
    seqs = [SeqWork(seq_id=str(i), token_ids=p, start_pos=0, block_table=list(range(4 * i, 4 * i + 4)),
                    sample=True, params=GREEDY) for i, p in enumerate(PROMPTS)]
    ref = torch.from_numpy(cpu.forward(seqs)).double()
    for kw, tol in ((dict(kv_dtype=torch.float32, dense=False, int8_act=False), 1e-4),
                    (dict(kv_dtype=torch.bfloat16, dense=True, int8_act=False), 3e-2),
                    (dict(kv_dtype=torch.bfloat16, dense=True, int8_act=True), 3e-2)):
        gpu = GpuModelRunner.load(path, num_blocks=64, block_size=BS, graphs=False, **kw)
        out = gpu.forward(seqs).double().cpu()
        assert not torch.isnan(out).any()
        rel = float((out - ref).norm() / ref.norm())
        assert rel < tol, (kw, rel)


def test_sampled_and_logprob_steps_run(tmp_path_factory):
    from imp.gpu.runner import GpuModelRunner

    path = _model(tmp_path_factory, T.Q8_0)
    gpu = GpuModelRunner.load(path, num_blocks=64, block_size=BS, max_graph_batch=4)
    p = SamplingParams(max_tokens=8, temperature=0.8, top_k=40, top_p=0.9, logprobs=3, seed=11,
                       repetition_penalty=1.2, logit_bias=((7, 2.0),))
    typ = SamplingParams(max_tokens=8, temperature=0.8, typical_p=0.5, seed=3)
    seqs = [SeqWork(seq_id="a", token_ids=[1, 2, 3], start_pos=0, block_table=[0], sample=True, params=p,
                    history=[2, 2]),
            SeqWork(seq_id="b", token_ids=[4, 5], start_pos=0, block_table=[1], sample=True, params=typ),
            SeqWork(seq_id="c", token_ids=[6, 7, 8, 9], start_pos=0, block_table=[2], sample=False, params=GREEDY,
                    prompt_logprobs=2, prompt_next=10)]
    out = gpu.step(seqs)
    assert [t.seq_id for t in out] == ["a", "b", "c"]
    assert len(out[0].top) == 3 and out[0].logprob <= 0.0
    assert out[2].token_id == -1 and len(out[2].prompt) == 4
    dec = [SeqWork(seq_id="a", token_ids=[out[0].token_id], start_pos=3, block_table=[0], sample=True, params=p,
                   gen_index=1)]
    t1 = gpu.step(dec)
    assert 0 <= t1[0].token_id < 512


def test_a_reload_decides_as_the_first_load(tmp_path_factory):
    """The loader's `decided` (imp.server): a reload after a suspend or a model swap keeps the first load's dense
    copies and matmul kernels (no timing again) and gives the same greedy tokens."""
    from imp.gpu.runner import GpuModelRunner

    path = _model(tmp_path_factory, T.Q8_0)
    decided: dict = {}
    prompts = [[5, 9, 200, 3] + list(range(40, 40 + 5 * i)) for i in range(4)]
    first = GpuModelRunner.load(path, num_blocks=64, block_size=BS, max_graph_batch=8, int8_act=True, decided=decided)
    tokens = greedy_run(first, prompts, 12)
    assert decided["tuner"] and first.w.tune_stats["times"], decided
    choices = dict(decided["tuner"])
    del first
    again = GpuModelRunner.load(path, num_blocks=64, block_size=BS, max_graph_batch=8, int8_act=True, decided=decided)
    assert again.w.tuner is decided["tuner"] and dict(again.w.tuner) == choices
    assert not again.w.tune_stats["times"]  # nothing timed: every shape's choice was there
    assert again.w.dense == decided["dense"]
    assert greedy_run(again, prompts, 12) == tokens


@pytest.mark.parametrize("int8_act,cpu_weights", [(True, "gguf"), (False, "f32")])
def test_smollm2_greedy_matches_cpu(smollm2_path, int8_act, cpu_weights):
    """The default GPU path (int8 activations) against the CPU's default (GGUF blocks, the same int8
    activations); fp32 activations against the CPU's fp32 weights."""
    from imp.gpu.runner import GpuModelRunner
    from imp.model.runner import ModelRunner

    cpu = ModelRunner.load(str(smollm2_path), num_blocks=64, block_size=BS, weights=cpu_weights, kv_dtype=torch.float32)
    gpu = GpuModelRunner.load(str(smollm2_path), num_blocks=64, block_size=BS, kv_dtype=torch.float32, dense=False,
                              max_graph_batch=4, int8_act=int8_act)
    prompts = [[1, 2, 3, 4, 5, 6], list(range(100, 140)), [42]]
    got, want = greedy_run(gpu, prompts, 8), greedy_run(cpu, prompts, 8)
    if not int8_act:
        assert got == want
        return
    # int8 activations: the two int8 paths' logits differ by ~1e-2 relative (measured on the H200: GPU int8 vs
    # CPU blocks 1.1e-2, either vs fp32 weights 0.23 on the first prompt), so a near-tie may go either way:
    # tokens equal up to the first difference, and there the CPU's top two are within 0.25 and include the GPU's
    for p, a, b in zip(prompts, got, want):
        j = next((k for k in range(len(a)) if a[k] != b[k]), None)
        if j is None:
            continue
        seq = [SeqWork(seq_id="x", token_ids=p + b[:j], start_pos=0, block_table=[60, 61, 62, 63], sample=True,
                       params=GREEDY)]
        top = torch.topk(torch.from_numpy(cpu.forward(seq)).double()[0], 2)
        assert a[j] in top.indices.tolist() and float(top.values[0] - top.values[1]) < 0.25, (p, a, b, top)
    # and not every prompt at a tie: one ran all 8 tokens equal (the H200 lane, 2026-12-01: prompts 1 and 3
    # met near-ties at tokens 7 and 3, top-two gaps under 0.25, prompt 2 equal throughout)
    assert any(a == b for a, b in zip(got, want)), (got, want)


def test_135m_shape_q4_1_greedy_and_logits_match_cpu(tmp_path_factory):
    """SmolLM2's shape (30 layers, d 576, GQA 9/3, vocab 49152) with random Q4_1 blocks and a
    Q8_0 tied embedding (what bench/gpu.py times): greedy tokens equal the CPU runner's (fp32
    weights), logits within 1e-3 relative."""
    from gguf import GGMLQuantizationType as T

    from imp.gpu.runner import GpuModelRunner
    from imp.model.runner import ModelRunner
    from tests.fixtures.synth_raw import write_raw_gguf

    path = str(tmp_path_factory.mktemp("m135") / "135m-q4_1.gguf")
    write_raw_gguf(path, n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, d_ff=1536, vocab=49152, qtype=T.Q4_1,
                   embed_qtype=T.Q8_0, tied=True, context_length=8192, rope_theta=100000.0, seed=0)
    cpu = ModelRunner.load(path, num_blocks=64, block_size=BS, weights="f32")
    gpu = GpuModelRunner.load(path, num_blocks=64, block_size=BS, kv_dtype=torch.float32, dense=False,
                              max_graph_batch=4, int8_act=False)
    prompts = [list(range(400, 407)), list(range(400, 460)), [400]]
    assert greedy_run(gpu, prompts, 8) == greedy_run(cpu, prompts, 8)
    seqs = [SeqWork(seq_id="a", token_ids=list(range(500, 540)), start_pos=0, block_table=[60, 61, 62], sample=True,
                    params=GREEDY)]
    ref = torch.from_numpy(cpu.forward(seqs)).double()
    got = gpu.forward(seqs).double().cpu()
    assert float((got - ref).norm() / ref.norm()) < 1e-3


@pytest.mark.parametrize("graphs", [True, False])
def test_split_decode_attention_gives_the_cpu_s_tokens(tmp_path_factory, graphs):
    """--gpu-decode-attention split (issue 39: paged_decode_split for every decode row, graphs and eager steps): on
    SmolLM2's shape (GQA 9/3, D 64, 8k context: segments of 256 keys) a 600-token prompt decodes over three segments
    merged, beside short ones; greedy tokens equal the CPU runner's (fp32 weights and cache)."""
    from gguf import GGMLQuantizationType as T

    from imp.gpu.runner import GpuModelRunner
    from imp.model.runner import ModelRunner
    from tests.fixtures.synth_raw import write_raw_gguf

    path = str(tmp_path_factory.mktemp("m135s") / "135m-q4_1.gguf")
    write_raw_gguf(path, n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, d_ff=1536, vocab=49152, qtype=T.Q4_1,
                   embed_qtype=T.Q8_0, tied=True, context_length=8192, rope_theta=100000.0, seed=0)
    cpu = ModelRunner.load(path, num_blocks=64, block_size=BS, weights="f32")
    gpu = GpuModelRunner.load(path, num_blocks=64, block_size=BS, kv_dtype=torch.float32, dense=False, graphs=graphs,
                              max_graph_batch=4, int8_act=False, decode_attention="split")
    assert gpu.fwd.split_work is not None and gpu.fwd.split_rows == 4
    prompts = [list(range(400, 1000)), list(range(400, 407)), [400]]
    assert greedy_run(gpu, prompts, 8) == greedy_run(cpu, prompts, 8)


@pytest.mark.parametrize("variant", ["x4", "x8", "a4", "k4"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_bf16_fused_gemv_path(tmp_path_factory, monkeypatch, variant, kv_dtype):
    """BF16 weights through gemv_bf16_fused.gemv_bf16x with the fused QKV+RoPE+KV-write and gate/up+SiLU epilogues
    (forced: no tuning): greedy tokens equal to the CPU runner's with an fp32 cache (prefill through the
    unfused dense path, decode fused, eager and graphed), and graph-replayed logits equal to eager ones."""
    from imp.gpu import linear as gpu_linear
    from imp.gpu.runner import GpuModelRunner
    from imp.model.runner import ModelRunner

    monkeypatch.setattr(gpu_linear, "X_DEFAULT", variant)
    path = _model(tmp_path_factory, T.BF16)
    gpu = GpuModelRunner.load(path, num_blocks=64, block_size=BS, kv_dtype=kv_dtype, tune=False, max_graph_batch=8)
    assert not gpu.notes, gpu.notes
    assert gpu.fwd.fuse and gpu.w.layers[0].wqkv.mode(1) == variant and gpu.w.layers[0].w13.mode(8) == variant
    if kv_dtype == torch.float32:
        cpu = ModelRunner.load(path, num_blocks=64, block_size=BS, weights="f32")
        assert greedy_run(gpu, PROMPTS, 12) == greedy_run(cpu, PROMPTS, 12)
    works = [SeqWork(seq_id=str(i), token_ids=[7 + i], start_pos=len(p), block_table=list(range(4 * i, 4 * i + 4)),
                     sample=True, params=GREEDY) for i, p in enumerate(PROMPTS[:3])]
    pre = [SeqWork(seq_id=str(i), token_ids=p, start_pos=0, block_table=list(range(4 * i, 4 * i + 4)), sample=True,
                   params=GREEDY) for i, p in enumerate(PROMPTS[:3])]
    gpu.step(pre)
    with torch.inference_mode():
        g = gpu.graphs.replay(works).double().cpu()
        e = gpu.forward(works).double().cpu()
    assert float((g - e).norm() / e.norm()) < 1e-5


# --------------------------------------------------------------------------- pipelining

def pipelined_run(runner, prompts: list[list[int]], steps: int, params=GREEDY) -> list[list[int]]:
    """As greedy_run, but step k+1 is launched before step k is collected,
    feeding PENDING_TOKEN (as the executor does with a depth-2 scheduler).
    Prompt 0 joins late (from step 2, as a prefill in a mixed eager step)."""
    from imp.messages import PENDING_TOKEN

    tables, base = [], 0
    for p in prompts:
        nb = (len(p) + steps + 2) // BS + 1
        tables.append(list(range(base + nb - 1, base - 1, -1)))
        base += nb
    n_gen = [0] * len(prompts)  # generated tokens planned so far (the last may be in flight)
    out: list[list[int]] = [[] for _ in prompts]
    landed = []

    def plan(late: bool):
        seqs = []
        for i, p in enumerate(prompts):
            if i == 0 and not late:
                continue
            if n_gen[i] == 0:
                seqs.append(SeqWork(seq_id=str(i), token_ids=p, start_pos=0, block_table=tables[i], sample=True,
                                    params=params))
            else:
                penalized = params.repetition_penalty != 1.0
                seqs.append(SeqWork(seq_id=str(i), token_ids=[PENDING_TOKEN], start_pos=len(p) + n_gen[i] - 1,
                                    block_table=tables[i], sample=True, params=params, gen_index=n_gen[i],
                                    history=out[i][:n_gen[i] - 1] if penalized else [], pending=1))
            n_gen[i] += 1
        return seqs

    h = runner.launch(plan(False))
    for k in range(1, steps + 2):
        nxt = runner.launch(plan(k >= 2)) if k < steps + 1 else None  # launched while h runs
        for t in runner.collect(h):
            out[int(t.seq_id)].append(t.token_id)
        landed.append(h)
        h = nxt
    return [o[:steps] for o in out]


@pytest.mark.parametrize("graphs", [True, False])
def test_pipelined_launches_match_step_by_step(tmp_path_factory, graphs):
    from imp.gpu.runner import GpuModelRunner

    path = _model(tmp_path_factory, T.Q8_0)
    gpu = GpuModelRunner.load(path, num_blocks=64, block_size=BS, kv_dtype=torch.float32, dense=False,
                              graphs=graphs, max_graph_batch=8)
    steps = 10
    for params in (GREEDY, SamplingParams(max_tokens=64, repetition_penalty=1.3),
                   SamplingParams(max_tokens=64, temperature=0.9, top_p=0.9, seed=5)):
        got = pipelined_run(gpu, PROMPTS, steps, params)
        # the same schedule, one step at a time (every token known on the host)
        want = []
        for i, p in enumerate(PROMPTS):
            o = []
            seq = [SeqWork(seq_id="x", token_ids=p, start_pos=0, block_table=list(range(60, 64)), sample=True,
                           params=params)]
            for g in range(steps if i else steps - 1):
                t = gpu.step(seq)[0].token_id
                o.append(t)
                pen = params.repetition_penalty != 1.0
                seq = [SeqWork(seq_id="x", token_ids=[t], start_pos=len(p) + g, block_table=list(range(60, 64)),
                               sample=True, params=params, gen_index=g + 1, history=o[:] if pen else [])]
            want.append(o)
        assert [g[:len(w)] for g, w in zip(got, want)] == want, params


def test_fill_pending_kernel():
    from imp.kernels.cuda.fill_pending_tokens import fill_pending, fill_pending_reference

    g = torch.Generator().manual_seed(0)
    for n, k in ((1, 1), (7, 3), (300, 256), (1000, 600)):
        tokens = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)
        sampled = torch.randint(0, 50000, (k + 5,), generator=g, dtype=torch.int32)
        rows = torch.randperm(n, generator=g)[:k].to(torch.int32)
        rows[::3] = -1  # skipped entries
        src = torch.randint(0, k + 5, (k,), generator=g, dtype=torch.int32)
        want = tokens.clone()
        fill_pending_reference(want, rows, src, sampled, k)
        got = tokens.cuda()
        fill_pending(got, rows.cuda(), src.cuda(), sampled.cuda(), k)
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("graphs", [True, False])
def test_verify_shares_give_the_one_at_a_time_tokens(tmp_path_factory, graphs):
    """Draft-free speculation on the GPU runner: a verify share (the last known token + a draft) keeps its
    draft up to the first position that samples otherwise and samples there, as decoding one token at a
    time does; beside a plain decode and a prompt chunk in the same step (decode graph, mixed graph or
    eager), for greedy and seeded sampling."""
    from imp.gpu.runner import GpuModelRunner

    path = _model(tmp_path_factory, T.Q8_0)
    gpu = GpuModelRunner.load(path, num_blocks=96, block_size=BS, dense=False, graphs=graphs, max_graph_batch=16,
                              int8_act=False)  # every matmul the fp32 GEMV: a row's bits do not depend on its batch
    assert gpu.verifies_drafts
    p, table = PROMPTS[1], tuple(range(0, 8))
    for params in (GREEDY, SamplingParams(max_tokens=64, temperature=0.9, top_p=0.9, seed=5)):
        first = gpu.step([SeqWork(seq_id="a", token_ids=tuple(p), start_pos=0, block_table=table, sample=True,
                                  params=params)])[0].token_id
        toks = [first]
        for g in range(1, 10):  # one at a time
            toks.append(gpu.step([SeqWork(seq_id="a", token_ids=(toks[-1],), start_pos=len(p) + g - 1,
                                          block_table=table, sample=True, params=params, gen_index=g)])[0].token_id)
        other = SeqWork(seq_id="b", token_ids=(PROMPTS[0][-1],), start_pos=len(PROMPTS[0]) - 1,
                        block_table=tuple(range(20, 24)), sample=True, params=params)
        chunk = SeqWork(seq_id="c", token_ids=tuple(PROMPTS[3]), start_pos=0, block_table=tuple(range(30, 34)),
                        sample=True, params=params)
        gpu.step([SeqWork(seq_id="b", token_ids=tuple(PROMPTS[0][:-1]), start_pos=0, block_table=other.block_table,
                          sample=False, params=params)])
        for draft, keep in ((toks[1:6], 5), (toks[1:3] + [toks[3] ^ 1] + toks[4:5], 2), ([toks[1] ^ 1], 0)):
            share = SeqWork(seq_id="a", token_ids=(toks[0], *draft), start_pos=len(p), block_table=table,
                            sample=True, params=params, gen_index=1, draft=len(draft))
            for beside in ([], [other], [other, chunk]):
                out = {t.seq_id: t for t in gpu.step([share, *beside])}
                a = out["a"]
                assert [t.token_id for t in a.accepted] == toks[1:1 + keep], (draft, beside)
                assert a.token_id == toks[1 + keep], (draft, beside)
                assert set(out) == {"a", *(w.seq_id for w in beside)}


def test_dry_rows_take_the_host_sampler_beside_device_rows(tmp_path_factory):
    """A DRY row in a GPU step is sampled on the host with its context (prompt tail + history): the token that
    would extend the repeat, made the argmax by a logit bias, is not drawn with DRY and is without it."""
    from imp.gpu.runner import GpuModelRunner
    from imp.messages import Dry

    path = _model(tmp_path_factory, T.Q8_0)
    gpu = GpuModelRunner.load(path, num_blocks=64, block_size=BS, max_graph_batch=4)
    rep = (5, 6, 7, 8) * 3 + (5, 6, 7)  # the repeat goes on with 8
    bias = ((8, 500.0),)  # this tied random model gives its last input (7) ~165 and 8 ~-17: the bias outweighs both
    plain = SamplingParams(max_tokens=4, logit_bias=bias)
    dry = SamplingParams(max_tokens=4, logit_bias=bias, dry=Dry(multiplier=1e4, allowed_length=1, last_n=-1, prefix=rep))
    for params, want_eight in ((plain, True), (dry, False)):
        out = gpu.step([SeqWork(seq_id="a", token_ids=rep, start_pos=0, block_table=[0], sample=True, params=params),
                        SeqWork(seq_id="b", token_ids=[1, 2, 3], start_pos=0, block_table=[1], sample=True,
                                params=GREEDY)])
        assert [t.seq_id for t in out] == ["a", "b"]
        assert (out[0].token_id == 8) == want_eight, params


def test_banned_and_guided_rows_on_the_device(tmp_path_factory):
    """Banned phrases and classifier-free guidance on a GPU step: a share's banned tokens are -inf on the device
    (the next best is drawn), and a guided row is drawn from l_b + s (l_a - l_b) of its own and its shadow's
    rows in the same step (against the two rows' logits from a plain forward), beside a plain row."""
    import numpy as np

    from imp.gpu.runner import GpuModelRunner

    path = _model(tmp_path_factory, T.Q8_0)
    gpu = GpuModelRunner.load(path, num_blocks=64, block_size=BS, max_graph_batch=4)
    a, b = tuple(PROMPTS[0]), tuple(PROMPTS[1])
    blocks = lambda k: [3 * k, 3 * k + 1, 3 * k + 2]  # noqa: E731 (37 positions: 3 blocks of 16)
    la, lb = (gpu.forward([SeqWork(seq_id=s, token_ids=t, start_pos=0, block_table=blocks(k), sample=True,
                                   params=GREEDY)])[0].float().cpu().numpy().astype(np.float64)
              for s, t, k in (("x", a, 0), ("y", b, 1)))
    top2 = list(np.argsort(-la, kind="stable")[:2])
    out = gpu.step([SeqWork(seq_id="a", token_ids=a, start_pos=0, block_table=blocks(2), sample=True, params=GREEDY,
                            banned=(int(top2[0]),)),
                    SeqWork(seq_id="p", token_ids=b, start_pos=0, block_table=blocks(3), sample=True, params=GREEDY)])
    assert out[0].token_id == top2[1] and out[1].token_id == int(np.argmax(lb))
    guided = SamplingParams(max_tokens=4, cfg_scale=3.0)
    out = gpu.step([SeqWork(seq_id="g", token_ids=a, start_pos=0, block_table=blocks(4), sample=True, params=guided,
                            guide="g.cfg"),
                    SeqWork(seq_id="g.cfg", token_ids=b, start_pos=0, block_table=blocks(5), sample=True,
                            params=GREEDY)])
    z = lb + 3.0 * (la - lb)
    assert out[0].token_id == int(np.argmax(z)) and out[1].token_id == int(np.argmax(lb))


def test_logit_lens_rows_run_eager_and_read_every_layer(tmp_path_factory):
    """A logit-lens row on the GPU: the same token and logprob as without the lens, one entry per layer, the
    last layer's the sampled row's (greedy, no penalty: rank 1, the same logprob); a plain row beside it gets
    its token and no lens; the next step (a decode after it) gets the same token as without the lens."""
    from imp.gpu.runner import GpuModelRunner

    path = _model(tmp_path_factory, T.Q8_0)
    gpu = GpuModelRunner.load(path, num_blocks=64, block_size=BS, max_graph_batch=4)
    plain_p = SamplingParams(max_tokens=4, logprobs=2)
    lens_p = SamplingParams(max_tokens=4, logprobs=2, logit_lens=3)
    a, b = tuple(PROMPTS[0]), tuple(PROMPTS[3])
    out = {}
    for name, p, blocks in (("plain", plain_p, (0, 1)), ("lens", lens_p, (4, 5))):
        first = gpu.step([SeqWork(seq_id=name, token_ids=a, start_pos=0, block_table=blocks, sample=True, params=p),
                          SeqWork(seq_id=name + "-b", token_ids=b, start_pos=0, block_table=(blocks[1] + 10,
                                  blocks[1] + 11), sample=True, params=GREEDY)])
        nxt = gpu.step([SeqWork(seq_id=name, token_ids=(first[0].token_id,), start_pos=len(a), block_table=blocks,
                                sample=True, params=p, gen_index=1)])
        out[name] = (first, nxt)
    (p0, pb), (pn,) = out["plain"][0], out["plain"][1]
    (l0, lb), (ln,) = out["lens"][0], out["lens"][1]
    assert (l0.token_id, lb.token_id, ln.token_id) == (p0.token_id, pb.token_id, pn.token_id)
    assert abs(l0.logprob - p0.logprob) < 1e-4 and not lb.lens and not p0.lens
    assert len(l0.lens) == gpu.config.n_layers and len(ln.lens) == gpu.config.n_layers
    last = l0.lens[-1]
    assert last.rank == 1 and abs(last.logprob - l0.logprob) < 2e-2 and last.top[0][0] == l0.token_id
    assert all(len(x.top) == 3 and x.entropy >= 0 and x.rank >= 1 for x in l0.lens)


def test_mirostat_rows_take_the_host_sampler_and_keep_mu(tmp_path_factory):
    """A mirostat row in a GPU step is drawn on the host (imp.sampling.mirostat): its SampledToken carries the
    mu after the draw, the runner keeps it for the sequence's next share and forgets it when freed."""
    from imp.gpu.runner import GpuModelRunner

    path = _model(tmp_path_factory, T.Q8_0)
    gpu = GpuModelRunner.load(path, num_blocks=64, block_size=BS, max_graph_batch=4)
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=3, mirostat=2, mirostat_tau=2.0, mirostat_eta=0.5)
    out = gpu.step([SeqWork(seq_id="m", token_ids=[1, 2, 3], start_pos=0, block_table=[0], sample=True, params=p,
                            mu=4.0)])
    assert out[0].mu is not None and out[0].mu != 4.0
    t2 = gpu.step([SeqWork(seq_id="m", token_ids=[out[0].token_id], start_pos=3, block_table=[0], sample=True,
                           params=p, gen_index=1)])[0]
    assert t2.mu is not None and len(gpu._mirostat) == 1
    gpu.forget(["m"])
    assert len(gpu._mirostat) == 0
