"""Sentence embeddings: the numpy BERT encoder against HF transformers, and /v1/embeddings,
/v1/rerank through the real server with the official openai SDK (both process layouts)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

pytestmark = pytest.mark.slow

TEXTS = ["The cat sits on the mat.", "A dog runs in the park", "Felines resting on rugs", "hello",
         "Ünïcödé, 東京 and an emoji 🙂 " * 4, "x"]


def test_encoder_matches_transformers_mean_pooled_and_normalized(minilm_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from imp.model.bert import BertEncoder

    enc = BertEncoder.load(minilm_path)
    assert (enc.hidden, enc.max_tokens, enc.pooling, enc.normalize) == (384, 256, "mean", True)
    tok = transformers.AutoTokenizer.from_pretrained(str(minilm_path))
    model = transformers.AutoModel.from_pretrained(str(minilm_path)).eval()
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    ids = enc.tokenize(TEXTS)
    assert ids == [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], batch["attention_mask"])]
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    m = batch["attention_mask"][..., None].float()
    ref = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1).numpy()
    ours = enc.embed(ids)
    assert np.abs(ours - ref).max() < 1e-5
    one_by_one = np.stack([enc.embed([x])[0] for x in ids])  # padding inside a batch changes nothing
    assert np.abs(one_by_one - ours).max() < 1e-5


def _post(url, path, body):
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("layout", ["0", "2"], ids=["one-process", "api-servers-2"])
def test_embeddings_and_rerank_through_the_server(smollm2_path, minilm_path, tmp_path, layout):
    openai = pytest.importorskip("openai")
    from imp.model.bert import BertEncoder
    from tests.serverproc import ServerProcess

    want = BertEncoder.load(minilm_path).embed(BertEncoder.load(minilm_path).tokenize(TEXTS[:3]))
    with ServerProcess(smollm2_path, "--kv-cache-tokens", "2048", "--embedding-model", str(minilm_path),
                       "--api-servers", layout, log_path=tmp_path / "e.out") as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        listed = {m.id: m for m in c.models.list().data}
        r = c.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS[:3])  # the SDK asks for base64
        got = np.array([d.embedding for d in r.data], dtype=np.float32)
        floats = c.embeddings.create(model="m", input=TEXTS[:3], encoding_format="float")
        st_rr, rr = _post(srv.url, "/v1/rerank", {"model": "m", "query": "a cat on a mat",
                                                   "documents": ["dogs in parks", "a cat lying on a rug",
                                                                 {"text": "stock prices fell"}], "top_n": 2})
        st_r2, rr2 = _post(srv.url, "/rerank", {"model": "m", "query": "q", "documents": ["a", "b"],
                                                "return_documents": False})
        errors = {name: _post(srv.url, "/v1/embeddings", body) for name, body in {
            "dimensions": {"model": "m", "input": "x", "dimensions": 128},
            "input[1]": {"model": "m", "input": ["ok", [1, 2, 3]]},
            "long": {"model": "m", "input": "word " * 400},
            "empty": {"model": "m", "input": ""},
            "format": {"model": "m", "input": "x", "encoding_format": "int8"},
            "model": {"input": "x"},
            "truncate_prompt_tokens": {"model": "m", "input": "x", "truncate_prompt_tokens": 8},
            "normalize": {"model": "m", "input": "x", "normalize": False},
        }.items()}
        rerank_errors = [_post(srv.url, "/v1/rerank", {"model": "m", "query": "q", "documents": d})
                         for d in ("a single string", [{"title": "no text"}], [])]
        chat = _post(srv.url, "/v1/chat/completions", {"model": "m", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        deadline = time.monotonic() + 10  # API servers report to the engine's metrics asynchronously
        while True:
            with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as m:
                metrics = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in m.read().decode().splitlines()
                           if ln.startswith("imp_endpoint_requests_total{")}
            if metrics.get('imp_endpoint_requests_total{endpoint="rerank"}') == 5 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert listed["all-MiniLM-L6-v2"].model_extra["task"] == "embedding" and len(listed) == 2
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == "all-MiniLM-L6-v2"
    assert r.usage.prompt_tokens == sum(len(x) for x in BertEncoder.load(minilm_path).tokenize(TEXTS[:3]))
    assert np.abs(got - want).max() < 1e-6 and np.abs(np.array([d.embedding for d in floats.data]) - want).max() < 1e-6
    assert got[0] @ got[2] > got[0] @ got[1]  # cat ~ feline more than cat ~ dog
    assert st_rr == 200 and len(rr["results"]) == 2 and rr["results"][0]["index"] == 1  # top_n 2, best first
    assert rr["results"][0]["document"]["text"] == "a cat lying on a rug"
    assert rr["results"][0]["relevance_score"] > rr["results"][1]["relevance_score"]
    assert st_r2 == 200 and len(rr2["results"]) == 2 and "document" not in rr2["results"][0]
    for name, (st, body) in errors.items():
        assert st == 400, (name, body)
    assert errors["dimensions"][1]["error"]["param"] == "dimensions"
    assert errors["input[1]"][1]["error"]["param"] == "input[1]"
    assert errors["long"][1]["error"]["code"] == "input_too_long"
    assert [(st, b["error"]["param"]) for st, b in rerank_errors] == [(400, "documents"), (400, "documents[0]"),
                                                                      (400, "documents")]
    assert chat[0] == 200  # the chat model serves beside it
    assert metrics['imp_endpoint_requests_total{endpoint="embeddings"}'] == 2 + len(errors)  # refusals counted
    assert metrics['imp_endpoint_requests_total{endpoint="rerank"}'] == 2 + len(rerank_errors)


def test_without_an_embedding_model_the_routes_say_how_to_load_one(smollm2_path, tmp_path):
    from tests.serverproc import ServerProcess

    with ServerProcess(smollm2_path, "--kv-cache-tokens", "2048", log_path=tmp_path / "n.out") as srv:
        st, body = _post(srv.url, "/v1/embeddings", {"model": "m", "input": "x"})
        st2, _ = _post(srv.url, "/v1/rerank", {"model": "m", "query": "q", "documents": ["a"]})
    assert st == 400 and st2 == 400
    assert body["error"]["code"] == "model_not_loaded" and "--embedding-model" in body["error"]["message"]
