"""`--weights q8_0` (imp/formats/requant.py): a BF16 / F16 / F32 model's matrices stored as Q8_0 at load."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from tests.fixtures.synth_raw import write_raw_gguf


def _bf16_model(tmp_path, **kw):
    return write_raw_gguf(tmp_path / "bf16.gguf", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128,
                          vocab=512, qtype=T.BF16, embed_qtype=T.F32, tied=True, **kw)


def test_the_matrices_become_gguf_s_q8_0_of_their_values_and_the_rest_stays(tmp_path):
    from imp.formats.gguf_file import read_header, tensor_bytes
    from imp.formats.quants import dequantize
    from imp.formats.requant import Requant

    path = _bf16_model(tmp_path)
    h = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    rq = Requant(h, mm, "q8_0")
    mats = [n for n, i in h.tensors.items() if "norm" not in n]
    assert sorted(rq.converted) == sorted(mats) and "token_embd.weight" in rq.converted  # the tied head (F32) too
    for name in mats:
        info, orig = rq.infos[name], h.tensors[name]
        assert info.qtype == T.Q8_0 and info.shape == orig.shape and info.nbytes == orig.shape[0] * orig.shape[1] // 32 * 34
        vals = dequantize(tensor_bytes(mm, orig), orig.qtype, orig.shape)
        got = rq.raw(name)
        assert got.shape == (orig.shape[0], orig.shape[1] // 32 * 34)
        assert np.array_equal(got, quants.quantize(vals, T.Q8_0))  # ggml's own rounding, byte for byte
        back = dequantize(got, T.Q8_0, orig.shape)
        assert np.abs(back - vals).max() <= np.abs(vals).max() / 127  # half a step of the coarsest block, at most
        assert rq.raw(name) is got  # made once
    for name in h.tensors:
        if "norm" in name:
            assert rq.infos[name] == h.tensors[name]
            assert np.array_equal(rq.raw(name), tensor_bytes(mm, h.tensors[name]))
    assert rq.layout_tag() == ":w=q8_0" and "matrices to Q8_0" in rq.summary()
    native = Requant(h, mm)
    assert native.converted == [] and native.layout_tag() == "" and native.summary() == ""
    with pytest.raises(ValueError, match="--weights"):
        Requant(h, mm, "fp4")


def test_a_quantized_model_is_left_as_it_is(tmp_path):
    from imp.formats.gguf_file import read_header
    from imp.formats.requant import Requant

    path = write_raw_gguf(tmp_path / "q4.gguf", qtype=T.Q4_1, embed_qtype=T.Q8_0)
    rq = Requant(read_header(path), np.memmap(path, dtype=np.uint8, mode="r"), "q8_0")
    assert rq.converted == [] and rq.layout_tag() == ""
    assert "no BF16 / F16 / F32 matrix" in rq.summary()


def test_the_cpu_runner_serves_a_bf16_model_as_q8_0_close_to_bf16(tmp_path):
    """The CPU runner on the converted model: the fused Q8_0 kernels, logits within Q8_0's error of the BF16 model's,
    a KV layout of its own (the disk tier never hands one model's blocks to the other)."""
    from imp.messages import SamplingParams, SeqWork
    from imp.model.runner import ModelRunner

    path = _bf16_model(tmp_path, seed=3)
    p = SamplingParams(max_tokens=4, temperature=0.0)
    prompt = tuple(range(1, 40))
    native = ModelRunner.load(path, kv_tokens=256)
    q8 = ModelRunner.load(path, kv_tokens=256, requant="q8_0")
    # BF16 matrices run on the torch forward (fp32 KV); as Q8_0 on the fused kernels (fp16 KV)
    assert q8.fused and not native.fused and "matrices to Q8_0" in q8.weights_note
    assert q8.kv_layout().endswith(":w=q8_0") and ":w=" not in native.kv_layout()
    a = native.forward([SeqWork("a", prompt, 0, (0, 1, 2), True, p)])
    b = q8.forward([SeqWork("a", prompt, 0, (0, 1, 2), True, p)])
    rel = float(np.linalg.norm(a - b) / np.linalg.norm(a))
    assert 0 < rel < 0.05, rel


def test_weights_is_validated_and_reaches_the_cli():
    import argparse

    from imp.config import ServerConfig, add_serve_args, config_from_args

    assert ServerConfig().weights == "native"
    assert ServerConfig(weights="q8_0").weights == "q8_0"
    with pytest.raises(ValueError, match="--weights"):
        ServerConfig(weights="fp8")
    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert config_from_args(p.parse_args(["--weights", "q8_0"])).weights == "q8_0"


@pytest.mark.gpu
def test_the_gpu_runner_uploads_the_converted_matrices_and_agrees_with_the_cpu(tmp_path):
    """GPU lane: the same BF16 file under --weights q8_0 uploads Q8_0 matrices (about half the bytes) and its logits
    are the CPU runner's on the converted model, within the GPU's own numerics."""
    from imp.kernels.cuda import runtime

    if not runtime.available():
        pytest.skip("needs CUDA and CuPy")
    from imp.gpu.runner import GpuModelRunner
    from imp.messages import SamplingParams, SeqWork
    from imp.model.runner import ModelRunner

    path = _bf16_model(tmp_path, seed=5)
    p = SamplingParams(max_tokens=4, temperature=0.0)
    work = [SeqWork("a", tuple(range(1, 40)), 0, (0, 1, 2), True, p)]
    native = GpuModelRunner.load(path, kv_tokens=256, graphs=False)
    q8 = GpuModelRunner.load(path, kv_tokens=256, graphs=False, requant="q8_0")
    assert {pt.fmt for L in q8.w.layers for pt in L.wqkv.parts} == {"Q8_0"}
    assert q8.w.weight_bytes < 0.6 * native.w.weight_bytes
    assert q8.kv_layout().endswith(":w=q8_0") and "matrices to Q8_0" in q8.weights_note
    cpu = ModelRunner.load(path, kv_tokens=256, requant="q8_0").forward(work)
    gpu = q8.forward(work)
    gpu = gpu.detach().float().cpu().numpy() if hasattr(gpu, "detach") else np.asarray(gpu)
    rel = float(np.linalg.norm(gpu.reshape(cpu.shape) - cpu) / np.linalg.norm(cpu))
    assert rel < 0.02, rel
