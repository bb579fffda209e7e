"""POST /v1/score (SGLang's decoder-only scoring): field checks, the host sampler's label
logprobs, and the real server against the raw next-token distribution that /v1/completions'
prompt_logprobs reads for the same prompt."""

from __future__ import annotations

import math

import numpy as np
import pytest

from imp.http.errors import ApiError
from imp.http.endpoints.score import parse, probabilities
from imp.messages import SamplingParams, SeqWork
from imp.sampling.cpu import sample_one


def _refused(body, param):
    with pytest.raises(ApiError) as e:
        parse(body, 100)
    assert e.value.status == 400 and e.value.param == param, (e.value.message, e.value.param)
    return e.value.message


def test_fields_checked_and_named():
    ok = {"query": "Is it", "items": ["a", "b"], "label_token_ids": [5, 7]}
    assert parse(ok, 100) == ("Is it", ["a", "b"], (5, 7), False, False)
    assert parse({**ok, "items": "a", "apply_softmax": True, "item_first": True}, 100)[1:] == (["a"], (5, 7), True, True)
    assert parse({"query": [1, 2], "items": [[3], []], "label_token_ids": [0]}, 100)[1] == [[3], []]
    assert "temperature" in _refused({**ok, "temperature": 0.5}, "temperature")  # nothing ignored
    _refused({**ok, "query": 3}, "query")
    _refused({**ok, "items": []}, "items")
    _refused({**ok, "items": [[1, 2]]}, "items[0]")  # ids after a text query
    _refused({"query": [1], "items": ["x"], "label_token_ids": [1]}, "items[0]")
    _refused({"query": [1], "items": "x", "label_token_ids": [1]}, "items")
    _refused({**ok, "query": "", "items": ["a", ""]}, "items[1]")  # nothing to score
    _refused({**ok, "label_token_ids": []}, "label_token_ids")
    _refused({"query": "q", "items": ["a"]}, "label_token_ids")
    assert "outside the vocabulary" in _refused({**ok, "label_token_ids": [5, 100]}, "label_token_ids")
    _refused({**ok, "label_token_ids": [True]}, "label_token_ids")
    _refused({**ok, "apply_softmax": "yes"}, "apply_softmax")
    _refused({**ok, "model": ""}, "model")


def test_probabilities_whole_vocabulary_or_over_the_labels():
    lp = [math.log(0.5), math.log(0.1), math.log(0.05)]
    assert probabilities(lp, False) == pytest.approx([0.5, 0.1, 0.05])
    assert probabilities(lp, True) == pytest.approx([0.5 / 0.65, 0.1 / 0.65, 0.05 / 0.65])
    assert sum(probabilities([-900.0, -901.0], True)) == pytest.approx(1.0)  # no underflow to 0/0


def test_the_host_sampler_answers_the_labels_in_their_order():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32)
    p = SamplingParams(max_tokens=1, logprobs=0, score_ids=(7, 3, 7, 49))
    assert p.host_sampled and not p.plain_greedy
    t = sample_one(logits, SeqWork("s", (1,), 0, (0,), True, p))
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    assert [i for i, _ in t.top] == [7, 3, 7, 49]
    assert np.allclose([v for _, v in t.top], ref[[7, 3, 7, 49]], atol=1e-5)
    assert t.token_id == int(np.argmax(logits))  # the draw itself is the plain greedy one


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["0", "2"], ids=["one-process", "api-servers-2"])
def test_score_through_the_server_equals_the_next_token_distribution(smollm2_path, tmp_path, layout):
    from tests.serverproc import ServerProcess, call

    with ServerProcess(smollm2_path, "--kv-cache-tokens", "4096", "--api-servers", layout,
                       log_path=tmp_path / "s.out") as srv:
        st, tok = call(srv.url, "/tokenize", {"content": "The capital of France is"})
        assert st == 200
        query = tok["tokens"]
        items = [[], call(srv.url, "/tokenize", {"content": " the city of"})[1]["tokens"]]
        labels = [call(srv.url, "/tokenize", {"content": w})[1]["tokens"][0] for w in (" Paris", " London", " a")]
        st, out = call(srv.url, "/v1/score", {"query": query, "items": items, "label_token_ids": labels,
                                              "model": "smollm2"})
        assert st == 200, out
        assert out["object"] == "scoring" and len(out["scores"]) == 2 and all(len(r) == 3 for r in out["scores"])
        assert out["usage"]["prompt_tokens"] == 2 * len(query) + len(items[1])
        # the reference: the same prompt with the label appended, its last prompt token's raw logprob
        for item, row in zip(items, out["scores"]):
            for label, p in zip(labels, row):
                st, c = call(srv.url, "/v1/completions", {"model": "m", "prompt": query + item + [label],
                                                         "max_tokens": 1, "prompt_logprobs": 0})
                assert st == 200, c
                want = math.exp(c["choices"][0]["prompt_logprobs"][-1][str(label)]["logprob"])
                assert p == pytest.approx(want, rel=2e-3, abs=1e-7), (item, label)
        assert out["scores"][0][0] > out["scores"][0][1]  # Paris over London after "...France is"
        st, soft = call(srv.url, "/v1/score", {"query": query, "items": items, "label_token_ids": labels,
                                               "apply_softmax": True})
        for raw, row in zip(out["scores"], soft["scores"]):
            assert sum(row) == pytest.approx(1.0) and row == pytest.approx([x / sum(raw) for x in raw], rel=1e-4)
        # text: query + item joined as text; item_first puts the item in front
        st, t1 = call(srv.url, "/v1/score", {"query": "The capital of France is", "items": ["", " the city of"],
                                             "label_token_ids": labels})
        assert st == 200 and t1["scores"][0] == pytest.approx(out["scores"][0], rel=1e-3)
        st, t2 = call(srv.url, "/v1/score", {"query": " is", "items": ["The capital of France"],
                                             "label_token_ids": labels, "item_first": True})
        assert st == 200 and t2["scores"][0] == pytest.approx(out["scores"][0], rel=1e-3)
        # refusals name the field, and nothing is left behind
        st, e = call(srv.url, "/v1/score", {"query": query, "items": [[1]], "label_token_ids": [10 ** 6]})
        assert st == 400 and e["error"]["param"] == "label_token_ids"
        st, e = call(srv.url, "/v1/score", {"query": query, "items": [[1]], "label_token_ids": [1], "top_k": 5})
        assert st == 400 and e["error"]["param"] == "top_k"
        st, e = call(srv.url, "/v1/score", {"query": [1] * 9000, "items": [[1]], "label_token_ids": [1]})
        assert st == 400 and e["error"]["code"] == "context_length_exceeded"
        st, h = call(srv.url, "/health")
        assert st == 200 and h["kv_blocks_used"] == 0 and h["kv_blocks_reserved"] == 0, h


def test_the_gpu_sampler_sends_score_rows_to_the_host_sampler():
    """On a GPU a score row goes to the CPU sampler with the typical_p rows (imp.sampling.gpu.
    sample_rows); its routing is device-independent, so CPU tensors check it here."""
    torch = pytest.importorskip("torch")
    from imp.sampling import gpu

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    ps = [SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, logprobs=0, score_ids=(4, 9)),
          SamplingParams(max_tokens=1, logprobs=2)]
    out = gpu.sample_rows(logits, [SeqWork(f"s{i}", (1,), 0, (0,), True, p) for i, p in enumerate(ps)],
                          use_numba=False)
    want = torch.log_softmax(logits[1].double(), -1)[[4, 9]].tolist()
    assert [i for i, _ in out[1].top] == [4, 9] and np.allclose([v for _, v in out[1].top], want, atol=1e-5)
    assert out[0].top == () and len(out[2].top) == 2  # the other rows as before
    assert [t.token_id for t in out] == torch.argmax(logits, -1).tolist()
