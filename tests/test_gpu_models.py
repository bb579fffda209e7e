"""Models on demand on the GPU executor: three models in --models-dir (SmolLM2 and two synthetic llama-shape
files; the GPU forward runs llama only), each with a KV pool of ~6 GiB, and a --models-memory that holds
two. Requests name them interleaved, some streaming while another model loads beside them (its graphs
captured while the resident one replays its own): every answer is what that model gave before its swaps
(--batch-invariant: a row's tokens depend neither on its neighbours nor on a reload's kernel timings),
nothing is cut, the card's free memory (read by this test) follows the loads and unloads, and every
model's event-log stream replays. Marked `gpu`; skipped cleanly without CUDA/CuPy. The fleet's decisions
are test_residency's and test_fleet's; the same show on the CPU executor is test_models_server's."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import sys
import urllib.request

import pytest

pytestmark = pytest.mark.gpu


def _gpu_ok() -> bool:
    from imp.kernels.cuda import runtime

    return runtime.available()


if not _gpu_ok():
    pytest.skip("needs CUDA and CuPy", allow_module_level=True)

GiB = 2**30
KV_TOKENS = 262144  # per model: SmolLM2's pool is 5.6 GiB, each synthetic one's 6 GiB (24 KiB a token)
BUDGET_GB = 14.0  # two of the three


def _post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _listing(url: str) -> dict:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return {m["id"]: m for m in json.loads(r.read())["data"]}


def _free() -> int:
    import torch

    return torch.cuda.mem_get_info(0)[0]


@pytest.fixture(scope="module")
def gpu_fleet(smollm2_path, tmp_path_factory):
    from gguf import GGMLQuantizationType as T

    from tests.fixtures.synth import write_synthetic_gguf
    from tests.serverproc import ServerProcess

    d = tmp_path_factory.mktemp("gpu_fleet")
    models = d / "models"
    models.mkdir()
    shutil.copy(smollm2_path, models / "smol.gguf")
    for name in ("llama-a", "llama-b"):  # untied: a tied random model only repeats its input
        write_synthetic_gguf(str(models / f"{name}.gguf"), arch="llama", n_layers=12, d_model=1024, n_heads=16,
                             n_kv_heads=8, d_ff=2816, vocab=512, head_dim=64, qtype=T.Q8_0, embed_qtype=T.Q8_0,
                             tied=False, seed=len(name) + ord(name[-1]))
    srv = ServerProcess(str(models / "smol.gguf"), "--device", "cuda:0", "--models-dir", str(models),
                        "--kv-cache-tokens", str(KV_TOKENS), "--models-memory", str(BUDGET_GB),
                        "--event-log", str(d / "events.log"), "--batch-invariant", log_path=d / "server.out")
    srv.dir = d
    with srv:
        yield srv


def _complete(url: str, model: str, prompt: str) -> str:
    st, r = _post(url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                            "ignore_eos": True})
    assert st == 200 and r["usage"]["completion_tokens"] == 16, r
    return r["choices"][0]["text"]


def _stream(url: str, model: str, prompt: str) -> tuple[str, int, str | None]:
    from tests.serverproc import stream_completion

    return stream_completion(url, {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                   "ignore_eos": True})


NAMES = ("llama-a", "llama-b", "smol")


def test_models_swap_on_the_card_and_answer_alike(gpu_fleet):
    url = gpu_fleet.url
    first = {m: _complete(url, m, "The sea is") for m in NAMES}  # llama-a beside smol; llama-b swaps smol out
    for _ in range(2):
        for m in NAMES:
            assert _complete(url, m, "The sea is") == first[m], m
            listing = _listing(url)
            resident = {k: v["resident_bytes"] for k, v in listing.items() if v["loaded"]}
            assert len(resident) <= 2 and sum(resident.values()) <= BUDGET_GB * GiB, resident
    # the card: an unload gives the model's pool and weights back, a load takes them again
    loaded = [k for k, v in _listing(url).items() if v["loaded"]]
    victim = next(k for k in loaded if k != "smol")
    free0 = _free()
    st, body = _post(url + "/admin/models/unload", {"model": victim})
    free1 = _free()
    assert st == 200 and body["unloaded"], body
    st, body = _post(url + "/admin/models/load", {"model": victim})
    free2 = _free()
    assert st == 200 and body["loaded"], body
    print(f"\n{victim}: card free {free0 / GiB:.2f} -> {free1 / GiB:.2f} GiB on unload -> {free2 / GiB:.2f} on load;"
          f" resident {body['resident_bytes'] / GiB:.2f} GiB")
    assert free1 - free0 > 5 * GiB and free1 - free2 > 5 * GiB
    assert _complete(url, victim, "The sea is") == first[victim]


def test_streams_while_models_load_beside_them(gpu_fleet):
    """Streams on one model while the next request's model loads (and another is unloaded under them):
    each finishes whole, with the tokens it gives alone."""
    url = gpu_fleet.url
    jobs = [(NAMES[i % 3], f"Count {i}:") for i in range(12)]
    alone = {j: _stream(url, *j) for j in jobs[:3]}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda j: _stream(url, *j), jobs))
    assert all(t == 24 and f == "length" for _, t, f in got), got
    for j, g in zip(jobs, got):
        if j in alone:
            assert g == alone[j], j
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    for m in NAMES:
        assert f'imp_model_swaps_total{{direction="in",model="{m}"}}' in metrics, m
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        health = json.loads(r.read())
    assert health["swapping"] is None and health["kv_blocks_used"] == 0, health


def test_every_models_log_replays(gpu_fleet):
    assert gpu_fleet.stop() == 0
    logs = sorted(gpu_fleet.dir.glob("events*.log"))
    assert {p.name for p in logs} >= {"events.log", "events.llama-a.log", "events.llama-b.log"}
    for p in logs:
        r = subprocess.run([sys.executable, "-m", "imp", "replay", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, (p, r.stdout + r.stderr)
