"""The GPU pool's blocks to host and back (imp.gpu.kvcopy): the disk / host tier's block bytes and the swap
area, alone and under a runner (a sequence swapped out, its blocks overwritten, swapped into other blocks,
decodes on to the tokens of the run that never left), and through a server (--device cuda: preemptions
that swap, a restart that reads the prompt back). Marked `gpu`; skipped cleanly without CUDA/CuPy."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from imp.messages import KvSwapIn, KvSwapOut, SamplingParams, SeqWork

pytestmark = pytest.mark.gpu


def _gpu_ok() -> bool:
    from imp.kernels.cuda import runtime

    return runtime.available()


if not _gpu_ok():
    pytest.skip("needs CUDA and CuPy", allow_module_level=True)

BS = 16
GREEDY = SamplingParams(max_tokens=64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocks_and_the_swap_area_round_trip(dtype):
    from imp.gpu.kvcopy import DeviceBlocks

    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (3, 12, BS, 2, 64)  # [L, blocks, bs, Hkv, D]
    k = torch.randn(shape, generator=g, device="cuda").to(dtype)
    v = torch.randn(shape, generator=g, device="cuda").to(dtype)
    d = DeviceBlocks(k, v)
    assert d.layout() == f"{str(dtype).removeprefix('torch.')}:3x16x2x64"
    data = d.block(5)()  # the function the file thread calls
    assert len(data) == d.block_bytes()
    d.set_block(9, data)
    assert torch.equal(k[:, 9], k[:, 5]) and torch.equal(v[:, 9], v[:, 5])
    import numpy as np

    from imp.gpu import kvcopy

    last = {}
    for i in range(kvcopy.STAGING + 9):  # past the staging ring: each buffer reused once its DMA is done
        buf = d.staging()  # (numbers, not random bytes: a NaN would not equal itself below)
        last[i % 12] = torch.randn(d.block_bytes() // k.element_size(), generator=g, device="cuda").to(
            dtype).cpu().view(torch.uint8).numpy()
        buf.numpy()[:] = last[i % 12]
        d.set_block(i % 12, buf)
    for b, want in last.items():
        assert d.block(b)() == want.tobytes()
    # a chunk of loads (read side by side into one pinned buffer, one copy up, one launch to place them):
    # slot 1 is a file that was not read (not placed), the ring of chunks reused past its size
    n = d.chunk_blocks()
    assert n == 64  # 12 KB blocks: the most a chunk takes
    for rnd in range(kvcopy.CHUNKS + 2):
        chunk = d.chunk_staging()
        arr = chunk[0].numpy()
        want = {}
        for slot, b in ((0, (rnd + 4) % 12), (2, (rnd + 7) % 12), (3, (rnd + 1) % 12)):
            x = torch.randn(d.block_bytes() // k.element_size(), generator=g, device="cuda").to(dtype)
            arr[slot * d.block_bytes():(slot + 1) * d.block_bytes()] = x.cpu().view(torch.uint8).numpy()
            want[b] = x.cpu().view(torch.uint8).numpy().tobytes()
        untouched = {b: d.block(b)() for b in range(12) if b not in want}
        d.set_blocks(chunk, [(0, (rnd + 4) % 12), (2, (rnd + 7) % 12), (3, (rnd + 1) % 12)])
        for b, w in want.items():
            assert d.block(b)() == w, (rnd, b)
        for b, w in untouched.items():
            assert d.block(b)() == w, (rnd, b)
    d.make_swap(10)
    k0, v0 = k.clone(), v.clone()
    blocks, slots = (3, 7, 1, 0), (4, 5, 6, 9)  # a run of three slots and one alone
    d.swap_out(blocks, slots)
    k.zero_(), v.zero_()
    back = (11, 2, 8, 10)
    d.swap_in(slots, back)
    torch.cuda.synchronize()
    for a, b in zip(blocks, back):
        assert torch.equal(k[:, b], k0[:, a]) and torch.equal(v[:, b], v0[:, a])


def test_a_sequence_swapped_into_other_blocks_decodes_the_same_tokens(tmp_path):
    from gguf import GGMLQuantizationType as T

    from imp.gpu.runner import GpuModelRunner
    from tests.fixtures.synth import write_synthetic_gguf

    path = write_synthetic_gguf(tmp_path / "m.gguf", qtype=T.Q8_0, embed_qtype=T.Q8_0, tied=False, n_layers=2,
                                d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, vocab=512)
    prompt = list(range(40, 77))

    def run(swap_at: int | None) -> list[int]:
        r = GpuModelRunner.load(path, num_blocks=32, block_size=BS, graphs=True, max_graph_batch=8)
        r.make_swap(8)
        table = [3, 4, 5, 6, 7]  # 37 + 30 positions
        out = [r.step([SeqWork(seq_id="a", token_ids=prompt, start_pos=0, block_table=tuple(table), sample=True,
                               params=GREEDY)])[0].token_id]
        for i in range(1, 30):
            if i == swap_at:
                r.swap_out(KvSwapOut(tuple(table), (0, 1, 2, 3, 5)))
                r.k_cache.normal_(), r.v_cache.normal_()  # the pool reused by others meanwhile
                table = [20, 11, 25, 9, 14]
                r.swap_in(KvSwapIn((0, 1, 2, 3, 5), tuple(table)))
            w = SeqWork(seq_id="a", token_ids=(out[-1],), start_pos=len(prompt) + i - 1, block_table=tuple(table),
                        sample=True, params=GREEDY, gen_index=i)
            out.append(r.step([w])[0].token_id)
        return out

    assert run(12) == run(None)


def _complete(url: str, prompt: str, tokens: int) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def test_a_gpu_server_swaps_preempted_requests_and_reads_a_prompt_back_after_a_restart(smollm2_path, tmp_path):
    import concurrent.futures

    from tests.serverproc import ServerProcess

    prompts = [f"Write a long story about a {x} who travels the world. Chapter one:" for x in ("cat", "robot", "owl")]
    # 45 blocks: two ~70-token prompts (a toy tokenizer's bytes) + 256 reserved fit, at 470 tokens they do not
    with ServerProcess(str(smollm2_path), "--device", "cuda", "--kv-cache-tokens", "720", "--max-batch-size", "4",
                       "--preemption-mode", "swap", log_path=tmp_path / "swap.out") as srv:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda p: _complete(srv.url, p, 400), prompts))
        health = json.load(urllib.request.urlopen(srv.url + "/health", timeout=30))
    assert all(o["usage"]["completion_tokens"] == 400 for o in outs)
    assert health["preemptions"] > 0 and health["swaps"] == health["preemptions"] and health["kv_blocks_used"] == 0
    sysmsg = " ".join(f"Rule {i}: answer about topic {i} with care, citing section {i * 7}." for i in range(40))
    cache, got = tmp_path / "pc", []
    for i in range(2):
        with ServerProcess(str(smollm2_path), "--device", "cuda", "--prompt-cache-dir", str(cache),
                           log_path=tmp_path / f"tier{i}.out") as srv:
            got.append(_complete(srv.url, sysmsg, 8))
    n_full = (got[0]["usage"]["prompt_tokens"] - 1) // 16
    assert got[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert got[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == n_full * 16
    assert got[1]["choices"][0]["text"] == got[0]["choices"][0]["text"]
