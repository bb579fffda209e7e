"""LoRA on the GPU runner (imp.gpu.lora): the adapter's effect on the logits agrees with the
CPU path's (which tests/test_lora.py checks against HF+peft), base and adapter rows batched
give what each gives alone, and through the server on cuda:0 an adapter is loaded, selected
and unloaded. Marked `gpu`; skipped cleanly without CUDA/CuPy."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu


def _gpu_ok() -> bool:
    from imp.kernels.cuda import runtime

    return runtime.available()


if not _gpu_ok():
    pytest.skip("needs CUDA and CuPy", allow_module_level=True)

from imp.formats.lora import Adapter, check  # noqa: E402
from imp.messages import SamplingParams, SeqWork  # noqa: E402
from imp.model.lora import LoraTable  # noqa: E402
from tests.test_lora_server import DIMS, call, factors  # noqa: E402

TOKS = (1, 504, 3575, 282, 4649, 314, 253, 2765, 338, 1347, 281, 3227)


def seq(sid, blocks, lora=0, toks=TOKS):
    return SeqWork(sid, toks, 0, tuple(blocks), True, SamplingParams(max_tokens=4, lora=lora))


def test_gpu_adapter_effect_matches_the_cpu_path_and_batches(smollm2_path):
    from imp.gpu.runner import GpuModelRunner
    from imp.model.runner import ModelRunner

    cpu = ModelRunner.load(str(smollm2_path), kv_tokens=2048)
    gpu = GpuModelRunner.load(str(smollm2_path), kv_tokens=2048, device="cuda:0", graphs=False)
    rng = np.random.default_rng(5)
    fac = {(layer, m): (rng.standard_normal((8, i), np.float32) * 0.08, rng.standard_normal((o, 8), np.float32) * 0.08)
           for layer in range(30) for m, (o, i) in DIMS.items()}
    table = LoraTable()
    table.add(1, check(Adapter(8, 2.0, fac), cpu.config, "llama"), 30)
    cb, cl = torch.from_numpy(cpu.forward([seq("a", [0])]))[0], torch.from_numpy(cpu.forward([seq("b", [1], 1)], lora=table))[0]
    gb, gl = (t.float().cpu() for t in (gpu.forward([seq("a", [0])])[0], gpu.forward([seq("b", [1], 1)], lora=table)[0]))
    ce, ge = cl - cb, gl - gb
    cos = torch.nn.functional.cosine_similarity(ce, ge, dim=0).item()
    print(f"\nadapter effect max: CPU {ce.abs().max():.2f}, GPU {ge.abs().max():.2f}; cosine {cos:.4f}; "
          f"|GPU - CPU| with the adapter {(gl - cl).abs().max():.3f} (base {(gb - cb).abs().max():.3f})")
    assert ce.abs().max() > 2.0 and cos > 0.95
    assert int(gl.argmax()) == int(cl.argmax())
    # batched with base rows and another adapter's rows: what each gives alone, up to the GPU's
    # batch-size-dependent kernel choice (bf16 GEMVs picked per N by the tuner), greedy the same
    def same(got, want):
        assert (got - want).abs().max() < 0.3 and int(got.argmax()) == int(want.argmax()), \
            (got - want).abs().max().item()

    both = gpu.forward([seq("c", [2]), seq("d", [3], 1)], lora=table).float().cpu()
    same(both[0], gb)
    same(both[1], gl)
    table.add(2, check(Adapter(8, 2.0, factors(7, range(0, 30, 2))), cpu.config, "llama"), 30)  # a second one
    three = gpu.forward([seq("e", [4], 2), seq("f", [5]), seq("g", [6], 1)], lora=table).float().cpu()
    alone2 = gpu.forward([seq("h", [7], 2)], lora=table)[0].float().cpu()
    same(three[0], alone2)
    same(three[1], gb)
    same(three[2], gl)


def test_lora_through_the_gpu_server(smollm2_path, tmp_path):
    from tests.serverproc import ServerProcess
    from tests.test_lora import write_peft

    root = tmp_path / "loras"
    # a milder adapter than the CPU test's: its text stays coherent, so no near-tie decides a
    # token, and batched rows must give exactly what they give alone
    write_peft(root / "style", factors(1, std=0.05), r=8, alpha=16)
    # --batch-invariant: batched rows must give exactly what they give alone (cuBLAS picks by row count)
    with ServerProcess(smollm2_path, "--device", "cuda:0", "--kv-cache-tokens", "8192", "--lora-dir", str(root),
                       "--batch-invariant", log_path=tmp_path / "server.out") as srv:
        st, a = call(srv.url, "/admin/lora/load", {"path": "style"})
        assert st == 200 and a["id"] == 1, a
        body = {"model": "m", "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
                "temperature": 0, "max_tokens": 16}

        def chat(**kw):
            st, r = call(srv.url, "/v1/chat/completions", {**body, **kw})
            assert st == 200, r
            return r["choices"][0]["message"]["content"]

        base, styled = chat(), chat(lora="style")
        assert base != styled
        jobs = [{}, {"lora": "style"}] * 4
        with concurrent.futures.ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda kw: chat(**kw), jobs))
        print(f"\nbase {base!r}\nstyled {styled!r}\nbatched {got!r}")
        assert got == [base, styled] * 4
        st, u = call(srv.url, "/admin/lora/unload", {"id": 1})
        assert st == 200 and u["unloaded"]
        assert call(srv.url, "/v1/chat/completions", {**body, "lora": "style"})[0] == 400
        assert chat() == base


def test_gathered_mv_matches_float64_and_a_row_alone():
    """The LoRA products: per row W[idx] @ x, within fp32 of the float64 reference, into a column slice,
    and a row's bits the same alone as among 40 rows (torch's sum over the gathered product is not)."""
    from imp.kernels.cuda.gathered_mv import gathered_mv, reference

    g = torch.Generator().manual_seed(3)
    for S, O, K, N in ((3, 8, 576, 40), (2, 960, 8, 40), (4, 5, 1536, 7)):
        w = torch.randn(S, O, K, generator=g).cuda()
        x = torch.randn(N, K + 4, generator=g).cuda()[:, 4:]  # strided rows
        idx = torch.randint(0, S, (N,), generator=g).cuda()
        y = gathered_mv(w, idx, x)
        ref = reference(w, idx, x)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
        for i in (0, N - 1):
            assert torch.equal(gathered_mv(w, idx[i:i + 1], x[i:i + 1])[0], y[i])
        wide = torch.full((N, O + 6), 2.0, device="cuda")
        gathered_mv(w, idx, x, wide[:, 3:3 + O], accumulate=True)
        assert torch.equal(wide[:, 3:3 + O], y + 2.0) and (wide[:, :3] == 2).all() and (wide[:, 3 + O:] == 2).all()
    with pytest.raises(ValueError):
        gathered_mv(w, idx[:2], x)
