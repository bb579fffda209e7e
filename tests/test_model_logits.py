"""Model runtime logits: paged-cache invariants on a tiny synthetic GGUF (fast),
and agreement with HF transformers on the real SmolLM2 GGUF (slow)."""

from imp.messages import SamplingParams, SeqWork
from imp.model.runner import ModelRunner
from tests.fixtures.synth import write_synthetic_gguf

import pytest
import torch
from gguf import GGMLQuantizationType as T

P = SamplingParams(max_tokens=8)
BS = 4  # small blocks so every test crosses block boundaries


@pytest.fixture(scope="module")
def synth_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    return write_synthetic_gguf(path, n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128,
                                vocab=512, qtype=T.Q8_0, seed=1)


@pytest.fixture(scope="module", params=["f32", "gguf"])
def runner(synth_path, request):
    # "f32": the torch reference forward; "gguf": the fused Numba kernels on the file's blocks
    return ModelRunner.load(synth_path, num_blocks=64, block_size=BS, weights=request.param)


def exact(r) -> float:
    """The invariance tolerance: the fused path is bit-identical by construction."""
    return 0.0 if r.model.weights == "gguf" else 1e-4


def table(first_block: int, n: int = 12) -> list[int]:
    # deliberately non-contiguous, descending block ids: the paging must follow the table
    return [first_block + 2 * (n - i) for i in range(n)]


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def fwd(r, seq_id, toks, start, bt):
    return torch.from_numpy(r.forward([SeqWork(seq_id, toks, start, bt, True, P)]))[0]


def test_one_go_equals_chunks_equals_token_by_token(runner):
    toks = prompt(13)
    whole = fwd(runner, "a", toks, 0, table(0))
    fwd(runner, "b", toks[:6], 0, table(1))
    chunked = fwd(runner, "b", toks[6:], 6, table(1))
    for i, t in enumerate(toks):
        stepwise = fwd(runner, "c", [t], i, table(30))
    torch.testing.assert_close(chunked, whole, rtol=0, atol=exact(runner))
    torch.testing.assert_close(stepwise, whole, rtol=0, atol=exact(runner))
    assert whole.shape == (512,) and whole.dtype == torch.float32
    assert whole.std() > 0.1  # random weights still give non-degenerate logits


def test_batch_of_mixed_lengths_equals_each_alone(runner):
    # a: fresh prefill; b: chunk on top of a cached prefix; c, d: decode steps
    pa, pb, pc, pd = prompt(9, 1), prompt(11, 2), prompt(7, 3), prompt(3, 4)
    fwd(runner, "b", pb[:5], 0, table(1))
    fwd(runner, "c", pc[:6], 0, table(2, 8))
    fwd(runner, "d", pd[:2], 0, table(3, 8))
    batch = [
        SeqWork("c", pc[6:], 6, table(2, 8), True, P),
        SeqWork("a", pa, 0, table(0), True, P),
        SeqWork("d", pd[2:], 2, table(3, 8), True, P),
        SeqWork("b", pb[5:], 5, table(1), True, P),
    ]
    together = torch.from_numpy(runner.forward(batch))
    alone = torch.stack([torch.from_numpy(runner.forward([s]))[0] for s in batch])  # same slots rewritten, same values
    torch.testing.assert_close(together, alone, rtol=0, atol=exact(runner))


def test_step_samples_only_flagged_seqs(runner):
    toks = prompt(5)
    out = runner.step([
        SeqWork("x", toks, 0, table(0), False, P),
        SeqWork("y", toks, 0, table(1), True, P),
    ])
    assert [t.seq_id for t in out] == ["y"]
    assert out[0].token_id == int(fwd(runner, "y", toks, 0, table(1)).argmax())
    # a prefill chunk that samples nothing still fills the cache
    assert runner.step([SeqWork("z", toks[:3], 0, table(2), False, P)]) == []
    nxt = runner.step([SeqWork("z", toks[3:], 3, table(2), True, P)])
    assert nxt[0].token_id == out[0].token_id


@pytest.mark.parametrize("weights", ["hybrid", "gguf"])
def test_quantized_paths_stay_close(synth_path, weights):
    ref_r = ModelRunner.load(synth_path, num_blocks=64, block_size=BS, weights="f32")
    fast = ModelRunner.load(synth_path, num_blocks=64, block_size=BS, weights=weights)
    toks = prompt(10)
    ref, got = fwd(ref_r, "a", toks, 0, table(0)), fwd(fast, "a", toks, 0, table(0))
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    ref, got = fwd(ref_r, "a", [7], 10, table(0)), fwd(fast, "a", [7], 10, table(0))  # decode path
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_fused_is_the_default_and_keeps_fp16_kv(synth_path):
    r = ModelRunner.load(synth_path, num_blocks=8, block_size=BS)
    assert r.model.weights == "gguf" and r.cache.dtype == "float16"  # a numpy pool of fp16 bits
    assert "torch" not in type(r.cache.k).__module__


def test_runner_attributes(runner, synth_path):
    assert runner.num_blocks == 64 and runner.block_size == BS
    assert runner.config.n_layers == 2 and runner.config.vocab_size == 512
    assert len(runner.fingerprint) == 64
    assert runner.metadata["tokenizer.ggml.tokens"][1] == "<|im_start|>"
    r2 = ModelRunner.load(synth_path, kv_tokens=100, block_size=16, weights=runner.model.weights)
    assert r2.num_blocks == 7 and r2.fingerprint == runner.fingerprint


def test_prompt_logprobs_score_each_next_token(runner):
    toks = prompt(9, 5)
    ref = torch.log_softmax(
        torch.stack([fwd(runner, "r", toks[: i + 1], 0, table(3)) for i in range(len(toks))]), -1)
    chunk1 = SeqWork("p", toks[:5], 0, table(4), False, P, prompt_logprobs=2, prompt_next=toks[5])
    (t1,) = runner.step([chunk1])
    assert t1.token_id == -1 and [e.position for e in t1.prompt] == [1, 2, 3, 4, 5]
    chunk2 = SeqWork("p", toks[5:], 5, table(4), True, P, prompt_logprobs=2)
    (t2,) = runner.step([chunk2])
    assert t2.token_id == int(ref[-1].argmax()) and [e.position for e in t2.prompt] == [6, 7, 8]
    for e in t1.prompt + t2.prompt:
        assert e.token_id == toks[e.position]
        assert abs(e.logprob - ref[e.position - 1, e.token_id].item()) < 1e-4
        assert e.rank == int((ref[e.position - 1] > ref[e.position - 1, e.token_id]).sum()) + 1
        assert len(e.top) == 2 and e.top[0][0] == int(ref[e.position - 1].argmax())


# ---------------------------------------------------------------- real model vs HF (slow)

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "def fibonacci(n):\n    ",
]
# Measured max |ours - HF| over the 3 prompts x (prompt end + 3 greedy steps):
#   weights="f32":    < 1e-4 (same fp32 arithmetic, different op order); argmax always equal
#   weights="int8" (the default; "hybrid" decodes the same way): 0.8 .. 1.5 on logits of magnitude 18 .. 37 (int8 per-row weights and
#                     bf16 activations in the GEMVs). Argmax equal except on a near-tie:
#                     "The quick brown fox" step 2, HF top-2 margin 0.29 (20.325 vs 20.034).
#   weights="gguf" (the default: fused kernels on the file's Q4_1/Q8_0 blocks, int8
#                     activations per 32, fp16 KV): see GGUF_MEASURED below.
BOUNDS = {"f32": 1e-3, "int8": 2.5, "gguf": 2.5}
TIE_MARGIN = {"f32": 0.0, "int8": 1.0, "gguf": 1.0}  # below this HF top-2 margin, a flip to HF's #2 is allowed


@pytest.mark.slow
def test_logits_match_hf_transformers(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    MODEL_DIR, MODEL_FILE = str(smollm2_path.parent), smollm2_path.name
    from tests.hf_gguf import one_read

    with one_read():  # the file parsed once for both
        tok = AutoTokenizer.from_pretrained(MODEL_DIR, gguf_file=MODEL_FILE)
        hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR, gguf_file=MODEL_FILE, dtype=torch.float32).eval()
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    refs = []  # per prompt: [(context so far, HF logits at its last position)] x 4
    for p in ids:
        x, steps = list(p), []
        for _ in range(4):
            with torch.no_grad():
                ref = hf(torch.tensor([x])).logits[0, -1].float()
            steps.append((list(x), ref))
            x = x + [int(ref.argmax())]
        refs.append(steps)
    for weights, bound in BOUNDS.items():
        r = ModelRunner.load(f"{MODEL_DIR}/{MODEL_FILE}", kv_tokens=2048, weights=weights)
        for j, steps in enumerate(refs):
            bt = list(range(j * 16, (j + 1) * 16))
            start = 0
            for ctx, ref in steps:
                ours = fwd(r, "s", ctx[start:], start, bt)  # continues from the cached prefix
                start = len(ctx)
                diff = (ours - ref).abs().max().item()
                assert diff < bound, (weights, j, start, diff)
                top2 = torch.topk(ref, 2)
                got = int(ours.argmax())
                if top2.values[0] - top2.values[1] >= TIE_MARGIN[weights]:
                    assert got == int(top2.indices[0]), (weights, j, start)
                else:
                    assert got in top2.indices.tolist(), (weights, j, start)


@pytest.mark.slow
def test_fp16_kv_cache_costs_little(smollm2_path):
    """The fused path's fp16 KV pool against an fp32 one (same kernels otherwise), and both
    against the torch fp32 reference: a 112-token prefill, then 8 decode steps of fixed
    tokens. fp16 K/V must cost about what the int8 activations already do: its logits' RMS error
    against the reference within 1.25x the fp32 pool's, and no step far off. (RMS, not the max over
    9 x 49k logits: one sensitive step sets the max, and it moves with the CPU tier's rounding; an
    AVX2 EPYC gave max 1.53 at one step, RMS 0.31 fp16 vs fp32, 0.25 vs 0.16 against the reference.)"""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)
    ids = tok(" ".join(PROMPTS * 8))["input_ids"][:120]
    outs = {}
    for name, kw in {"fp16": dict(kv_dtype=torch.float16), "fp32": dict(kv_dtype=torch.float32),
                     "ref": dict(weights="f32")}.items():
        r = ModelRunner.load(str(smollm2_path), kv_tokens=512, **kw)
        got = [fwd(r, "s", ids[:112], 0, list(range(16)))]
        got += [fwd(r, "s", [t], 112 + i, list(range(16))) for i, t in enumerate(ids[112:])]
        outs[name] = torch.stack(got)  # [9, vocab]
    def rms(a, b):
        return (outs[a] - outs[b]).pow(2).mean().sqrt().item()

    kv_max = (outs["fp16"] - outs["fp32"]).abs().max().item()
    kv, q16, q32 = rms("fp16", "fp32"), rms("fp16", "ref"), rms("fp32", "ref")
    print(f"RMS logit diff: fp16 vs fp32 KV {kv:.4f} (max {kv_max:.4f}); vs torch fp32 reference: fp16 KV "
          f"{q16:.4f}, fp32 KV {q32:.4f} (logits up to {outs['ref'].abs().max().item():.1f})")
    assert kv < 0.5 and kv_max < 3.0 and q16 < 1.25 * q32 + 0.1, (kv, kv_max, q16, q32)
    ref_top2 = torch.topk(outs["ref"], 2).values
    clear = (ref_top2[:, 0] - ref_top2[:, 1]) > 1.0
    assert (outs["fp16"].argmax(-1) == outs["ref"].argmax(-1))[clear].all()
