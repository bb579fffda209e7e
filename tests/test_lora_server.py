"""LoRA at runtime through the real server (issue 13 §4): load / select / unload with the
reference's status codes, traversal refusals, every dialect's `lora` field, `model` naming an
adapter, adapters and base rows batched together, the prefix cache keyed by adapter, adapters
surviving suspend/resume, ids never reused. The logits against HF+peft: tests/test_lora.py."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from tests.serverproc import ServerProcess, call
from tests.test_lora import write_peft

pytestmark = pytest.mark.slow
DIMS = {0: (576, 576), 1: (192, 576), 2: (192, 576), 3: (576, 576), 4: (1536, 576), 5: (1536, 576), 6: (576, 1536)}


def factors(seed, layers=range(30), std=0.1):
    rng = np.random.default_rng(seed)
    return {(layer, m): (rng.standard_normal((8, i), np.float32) * std, rng.standard_normal((o, 8), np.float32) * std)
            for layer in layers for m, (o, i) in DIMS.items()}


@pytest.fixture(scope="module")
def lora_server(smollm2_path, tmp_path_factory):
    from safetensors.numpy import save_file

    d = tmp_path_factory.mktemp("loras")
    root = d / "loras"
    write_peft(root / "style", factors(1), r=8, alpha=16)
    t = {}
    for (layer, m), (a, b) in factors(2, range(0, 30, 3)).items():
        mod = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"][m]
        t[f"base_model.model.model.layers.{layer}.{mod}.lora_A.weight"] = a
        t[f"base_model.model.model.layers.{layer}.{mod}.lora_B.weight"] = b
    save_file(t, str(root / "other.safetensors"), metadata={"lora_alpha": "8"})
    rng = np.random.default_rng(3)
    write_peft(root / "wrong", {(0, 1): (rng.standard_normal((8, 576), np.float32),
                                         rng.standard_normal((576, 8), np.float32))}, r=8, alpha=8)  # k is 192 wide
    (root / "pickled").mkdir()
    (root / "pickled" / "adapter_config.json").write_text('{"r": 8}')
    (root / "pickled" / "adapter_model.bin").write_bytes(b"\x80\x04")
    outside = d / "outside"
    write_peft(outside, factors(4, [0]), r=8, alpha=8)
    (root / "escape").symlink_to(outside)
    srv = ServerProcess(smollm2_path, "--kv-cache-tokens", "4096", "--lora-dir", str(root),
                        log_path=d / "server.out")
    srv.root, srv.outside = root, outside
    with srv:
        yield srv


CHAT = {"model": "m", "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
        "temperature": 0, "max_tokens": 12}


def chat(url, **kw):
    st, r = call(url, "/v1/chat/completions", {**CHAT, **kw})
    assert st == 200, r
    return r["choices"][0]["message"]["content"], r["usage"]


def test_load_refusals_and_selection_on_every_dialect(lora_server):
    url = lora_server.url
    st, a = call(url, "/admin/lora/load", {"path": "style"})
    assert st == 200 and a["loaded"] and a["name"] == "style" and a["id"] == 1, a
    assert call(url, "/admin/lora/load", {"path": "style"})[1]["error"]["code"] == "lora_already_loaded"
    for body, status, needle in [
        ({"path": "../outside"}, 400, "'..'"), ({"path": str(lora_server.outside)}, 400, "outside --lora-dir"),
        ({"path": "escape"}, 400, "outside --lora-dir"), ({"path": "pickled"}, 400, "pickle"),
        ({"path": "wrong"}, 400, "made for another model"), ({"path": "nothere"}, 400, "does not exist"),
        ({}, 400, "'path' is required"), ({"path": "style", "name": ""}, 400, "'name'"),
    ]:
        st, err = call(url, "/admin/lora/load", body)
        assert st == status and needle in err["error"]["message"], (body, st, err)
    st, b = call(url, "/admin/lora/load", {"path": "other.safetensors"})
    assert st == 200 and b["name"] == "other" and b["id"] == 2, b
    models = [m["id"] for m in call(url, "/v1/models")[1]["data"]]
    assert "style" in models and "other" in models

    base, _ = chat(url)
    styled, _ = chat(url, lora="style")
    other, _ = chat(url, lora="other")
    assert styled != base and other != base and styled != other, (base, styled, other)
    assert chat(url, lora="style")[0] == styled  # deterministic
    assert chat(url, model="style")[0] == styled  # a model naming the adapter, as vLLM serves them
    # the other dialects carry the field too
    st, r = call(url, "/v1/completions", {"model": "m", "prompt": "The sea is", "max_tokens": 8, "temperature": 0})
    st2, r2 = call(url, "/v1/completions", {"model": "m", "prompt": "The sea is", "max_tokens": 8, "temperature": 0,
                                            "lora": "style"})
    assert st == st2 == 200 and r["choices"][0]["text"] != r2["choices"][0]["text"]
    st, m = call(url, "/v1/messages", {"model": "m", "max_tokens": 8, "temperature": 0, "lora": "style",
                                       "messages": [{"role": "user", "content": "Write one sentence about the sea."}]})
    assert st == 200 and m["content"][0]["text"], m
    st, rs = call(url, "/v1/responses", {"model": "m", "input": "Write one sentence about the sea.", "lora": "style",
                                         "max_output_tokens": 8, "temperature": 0, "store": False})
    assert st == 200 and rs["status"] in ("completed", "incomplete"), rs
    # unknown names: 400 lora_not_loaded in each dialect's shape
    st, err = call(url, "/v1/chat/completions", {**CHAT, "lora": "nope"})
    assert st == 400 and err["error"]["code"] == "lora_not_loaded" and "style" in err["error"]["message"]
    st, err = call(url, "/v1/messages", {"model": "m", "max_tokens": 4, "lora": "nope",
                                         "messages": [{"role": "user", "content": "hi"}]})
    assert st == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err


def test_batched_adapters_equal_alone_and_the_prefix_cache_is_keyed_by_adapter(lora_server):
    url = lora_server.url
    loaded(url)
    msgs = [{"role": "user", "content": "List four animals that live in the ocean, with one fact each."}]
    alone = {k: chat(url, messages=msgs, max_tokens=16, **kw)[0]
             for k, kw in (("base", {}), ("style", {"lora": "style"}), ("other", {"lora": "other"}))}
    jobs = [kw for _ in range(2) for kw in ({}, {"lora": "style"}, {"lora": "other"})]
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda kw: chat(url, messages=msgs, max_tokens=16, **kw)[0], jobs))
    for kw, text in zip(jobs, got):
        assert text == alone[kw.get("lora", "base")], (kw, text)
    # raw tokens no request has sent yet: the base's blocks are not the adapter's
    fresh = {"model": "m", "prompt": "Mountains and rivers shape the land over many thousands of years, " * 3,
             "max_tokens": 2, "temperature": 0}

    def cached(**kw):
        st, r = call(url, "/v1/completions", {**fresh, **kw})
        assert st == 200, r
        return r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)

    assert cached() == 0 and cached() > 0  # the base warms its own cache
    assert cached(lora="style") == 0  # same tokens, another adapter: no hit
    assert cached(lora="style") > 0 and cached(lora="other") == 0


def loaded(url) -> dict:
    """name -> id of the loaded adapters; style and other loaded when missing (tests run alone too)."""
    have = {a["name"]: a["id"] for a in call(url, "/admin/lora")[1]["data"]}
    for path, name in (("style", "style"), ("other.safetensors", "other")):
        if name not in have:
            st, a = call(url, "/admin/lora/load", {"path": path})
            assert st == 200, a
            have[name] = a["id"]
    return have


def test_adapters_survive_suspend_and_unload_frees_their_name(lora_server):
    url = lora_server.url
    ids = loaded(url)
    styled, _ = chat(url, lora="style")
    st, s = call(url, "/admin/suspend?drain_s=10", {}, "POST")
    assert st == 200 and s["kv_released"], s
    assert call(url, "/admin/lora/load", {"path": "style", "name": "x"})[1]["error"]["code"] == "suspended"
    assert call(url, "/admin/resume", {}, "POST")[0] == 200
    assert chat(url, lora="style")[0] == styled  # same adapter, same id, after the reload
    st, u = call(url, "/admin/lora/unload", {"name": "style"})
    assert st == 200 and u == {"id": ids["style"], "name": "style", "unloaded": True}, u
    st, err = call(url, "/v1/chat/completions", {**CHAT, "lora": "style"})
    assert st == 400 and err["error"]["code"] == "lora_not_loaded"
    assert call(url, "/admin/lora/unload", {"name": "style"})[1]["error"]["code"] == "lora_not_found"
    assert call(url, "/admin/lora/unload", {"id": 99})[0] == 404
    assert call(url, "/admin/lora/unload", {"id": "1"})[0] == 400
    st, again = call(url, "/admin/lora/load", {"path": "style"})
    assert st == 200 and again["id"] == max(ids.values()) + 1, again  # ids are never reused
    st, h = call(url, "/health")
    assert st == 200 and h["kv_blocks_used"] == 0, h  # nothing leaked: every block is free or cached


def test_speculation_under_an_adapter_gives_the_adapter_s_tokens(lora_server):
    """A verify share of an adapter's request runs its draft rows with the adapter's deltas: the text with
    speculation equals the text without, alone and beside the base model's and another adapter's requests,
    and verify steps did run (the prompt is a list to copy)."""
    url = lora_server.url
    loaded(url)
    copy = "Repeat this list exactly: " + ", ".join(str(i) for i in range(300, 360))
    msgs = [{"role": "user", "content": copy}]
    kws = ({}, {"lora": "style"}, {"lora": "other"})
    off = [chat(url, messages=msgs, max_tokens=48, speculative=False, **kw)[0] for kw in kws]
    on = [chat(url, messages=msgs, max_tokens=48, speculative=True, **kw) for kw in kws]
    assert [t for t, _ in on] == off
    assert any(u.get("completion_tokens_details", {}).get("imp_spec_verify_steps", 0) > 0 for _, u in on[1:]), on
    assert off[1] != off[0] or off[2] != off[0]  # the adapters change the text (else this tests nothing)
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        together = list(ex.map(lambda kw: chat(url, messages=msgs, max_tokens=48, speculative=True, **kw)[0], kws))
    assert together == off
