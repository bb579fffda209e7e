"""The OpenAI-compatible surface through the official openai client, against
the one shared real server (tests/conftest.py `imp_server`)."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
MSGS = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


@pytest.fixture(scope="module")
def cl(imp_server):
    import openai

    return openai.OpenAI(base_url=imp_server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def root(imp_server):
    """The same client at the server root, for llama.cpp routes (/tokenize, /props ...)."""
    import openai

    return openai.OpenAI(base_url=imp_server.url, api_key="none", max_retries=0, timeout=120)


def raw(server, method, path, body=None, headers=None):
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    req = urllib.request.Request(server.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# --------------------------------------------------------------------------- /v1/completions


def test_completions_prompt_forms(cl, root):
    a = cl.completions.create(model="x", prompt=PROMPT, max_tokens=6, temperature=0)
    assert a.object == "text_completion" and a.id.startswith("cmpl-")
    assert "Paris" in a.choices[0].text and a.usage.prompt_tokens == 5
    ids = tokenize(root, PROMPT)
    b = cl.completions.create(model="x", prompt=ids, max_tokens=6, temperature=0)
    c = cl.completions.create(model="x", prompt=[ids], max_tokens=6, temperature=0)
    d = cl.completions.create(model="x", prompt=[PROMPT], max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text == c.choices[0].text == d.choices[0].text
    e = cl.completions.create(model="x", prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text.startswith(PROMPT)


def tokenize(root, text) -> list[int]:
    return root.post("/tokenize", body={"content": text}, cast_to=object)["tokens"]


def test_completions_streaming_equals_non_streaming(cl):
    kw = dict(model="x", prompt=PROMPT, max_tokens=12, temperature=0)
    whole = cl.completions.create(**kw)
    chunks = list(cl.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "text_completion" for c in chunks)


def test_completions_seed_reproducible(cl):
    kw = dict(model="x", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=77)
    a = cl.completions.create(**kw)
    b = cl.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


def test_completions_n(cl):
    m = cl.completions.create(model="x", prompt="Once upon a time", max_tokens=5, temperature=1.0, n=2)
    assert [c.index for c in m.choices] == [0, 1]


def _check_completion_logprobs(lp, n_tokens, top_n, greedy=True):
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n_tokens
    for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert isinstance(top, dict) and 1 <= len(top) <= top_n and l <= 0
        if greedy:  # temperature 0: the emitted token is the most likely one
            assert max(top.values()) == pytest.approx(l) and top.get(tok) == pytest.approx(l)
    assert lp.text_offset == sorted(lp.text_offset)


@pytest.mark.parametrize("stop", [None, ["zzz", "Qq"]])
def test_completions_logprobs_shape_stream_and_not(cl, stop):
    kw = dict(model="x", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, stop=stop)
    r = cl.completions.create(**kw)
    lp = r.choices[0].logprobs
    _check_completion_logprobs(lp, r.usage.completion_tokens, 3)
    assert "".join(lp.tokens) == r.choices[0].text
    chunks = [c for c in cl.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs]
    toks = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offs = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert toks == lp.tokens and offs == lp.text_offset


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_shape(cl, stream):
    kw = dict(model="x", messages=MSGS, max_tokens=6, temperature=0, logprobs=True, top_logprobs=4,
              stop=["zzz"])
    if stream:
        entries = [e for c in cl.chat.completions.create(stream=True, **kw)
                   if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        entries = cl.chat.completions.create(**kw).choices[0].logprobs.content
    assert entries
    for e in entries:
        assert len(e.top_logprobs) == 4 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob) and e.bytes is not None


def test_prompt_logprobs_and_echo_shapes(cl):
    r = cl.completions.create(model="x", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
                              extra_body={"prompt_logprobs": 2})
    ch = r.choices[0]
    n_prompt, n_out = r.usage.prompt_tokens, r.usage.completion_tokens
    plp = ch.model_extra["prompt_logprobs"]
    assert len(plp) == n_prompt and plp[0] is None
    for e in plp[1:]:
        assert 1 <= len(e) <= 3
        for tid, v in e.items():
            assert int(tid) >= 0 and set(v) == {"logprob", "rank", "decoded_token"} and v["rank"] >= 1
    lp = ch.logprobs
    assert len(lp.tokens) == n_prompt + n_out and ch.text.startswith(PROMPT)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len(PROMPT)


def test_prompt_logprobs_agree_with_the_sampled_logprob(cl, root):
    """Raw prompt scoring of [prompt + t] at t's position == the logprob t was sampled with
    (greedy, no penalties: the processed distribution is the raw one there)."""
    a = cl.completions.create(model="x", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1,
                              extra_body={"repetition_penalty": 1.0})
    ids = tokenize(root, PROMPT + a.choices[0].text)
    b = cl.completions.create(model="x", prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 0})
    last = b.choices[0].model_extra["prompt_logprobs"][-1]
    assert last[str(ids[-1])]["logprob"] == pytest.approx(a.choices[0].logprobs.token_logprobs[0], abs=1e-3)
    assert last[str(ids[-1])]["rank"] == 1


# --------------------------------------------------------------------------- tokenize, props, info, models


def test_tokenize_detokenize_round_trip(root):
    text = "Hello wörld, <|im_start|> 123"
    t = root.post("/tokenize", body={"content": text, "with_pieces": True}, cast_to=object)
    assert all(set(p) == {"id", "piece"} for p in t["tokens"])
    ids = [p["id"] for p in t["tokens"]]
    assert root.post("/tokenize", body={"prompt": text}, cast_to=object)["tokens"] == ids
    assert root.post("/detokenize", body={"tokens": ids}, cast_to=object)["content"] == text
    lit = root.post("/tokenize", body={"content": text, "parse_special": False}, cast_to=object)["tokens"]
    assert len(lit) > len(ids)  # the control-token spelling stays text when asked


def test_props_info_models_shapes(root, cl):
    p = root.get("/props", cast_to=object)
    assert p["default_generation_settings"]["n_ctx"] == p["n_ctx"] == 8192
    assert {"total_slots", "model_path", "chat_template", "bos_token", "eos_token"} <= set(p)
    assert "im_start" in p["chat_template"] and p["eos_token"] == "<|im_end|>"
    i = root.get("/info", cast_to=object)
    assert i["max_total_tokens"] == 8192 and i["model_id"] and i["max_best_of"] == 1
    models = {m.id: m.model_extra["loaded"] for m in cl.models.list().data}
    assert list(models.values()) == [True]  # one model (models on demand: test_models_server)


# --------------------------------------------------------------------------- reasoning


THINK = [{"role": "user", "content": "Explain gravity in detail."}, {"role": "assistant", "content": "<think>"}]


def test_continue_final_message_inside_a_think_block(cl):
    r = cl.chat.completions.create(model="x", messages=THINK, max_tokens=12, temperature=0,
                                   extra_body={"continue_final_message": True, "add_generation_prompt": False})
    m = r.choices[0].message
    assert m.model_extra["reasoning_content"] and m.model_extra["reasoning"] == m.model_extra["reasoning_content"]
    assert m.content == ""  # still thinking at max_tokens
    chunks = list(cl.chat.completions.create(model="x", messages=THINK, max_tokens=12, temperature=0, stream=True,
                                             extra_body={"continue_final_message": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert streamed == m.model_extra["reasoning_content"]


def test_end_thinking_ends_the_block_and_the_answer_follows(cl, imp_server):
    got = {"reasoning": "", "content": ""}
    thinking = threading.Event()

    def run():
        for c in cl.chat.completions.create(
                model="x", messages=THINK, max_tokens=60, temperature=0, stream=True,
                extra_headers={"X-Request-Id": "think-test-1"},
                extra_body={"continue_final_message": True, "ignore_eos": True}):
            if c.choices:
                got["reasoning"] += c.choices[0].delta.model_extra.get("reasoning_content") or ""
                got["content"] += c.choices[0].delta.content or ""
                if got["reasoning"]:
                    thinking.set()
        thinking.set()

    th = threading.Thread(target=run)
    th.start()
    assert thinking.wait(60)
    status, _, body = raw(imp_server, "POST", "/v1/requests/think-test-1/end_thinking")
    th.join(60)
    assert status == 200 and json.loads(body)["ended"], body
    assert got["reasoning"] and got["content"].strip()
    assert "</think>" not in got["content"] + got["reasoning"]
    status, headers, body = raw(imp_server, "POST", "/v1/requests/think-test-1/end_thinking")
    assert status == 404 and json.loads(body)["error"]["code"] == "request_not_found"
    assert headers["X-Request-Id"]


# --------------------------------------------------------------------------- fields, errors


def test_pass_through_fields_are_accepted(cl):
    r = cl.chat.completions.create(model="x", messages=MSGS, max_tokens=4, temperature=0, extra_body={
        "cache_prompt": True, "session_id": "sess-1", "priority": 5, "ignore_eos": True, "min_p": 0.1,
        "typical_p": 0.9, "repetition_penalty": 1.1, "top_k": 0})
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


C, CH = "/v1/completions", "/v1/chat/completions"
U = [{"role": "user", "content": "hi"}]
BAD = [
    (C, {"max_tokens": 2}, "'prompt' is required"),
    (C, {"prompt": ["a", "b"]}, "batch"),
    (C, {"prompt": [[1, 2], [3]]}, "batch"),
    (C, {"prompt": [1, "a"]}, "prompt"),
    (C, {"prompt": [99999999]}, "vocabulary"),
    (C, {"prompt": 5}, "prompt"),
    (C, {"prompt": ""}, "empty"),
    (C, {"prompt": "a", "suffix": "b"}, "fill-in-the-middle"),
    (C, {"prompt": "a", "logprobs": 21}, "logprobs"),
    (C, {"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
    (C, {"prompt": "a", "prompt_logprobs": 1, "stream": True}, "stream"),
    (C, {"prompt": "a", "echo": True, "logprobs": 1, "stream": True}, "stream"),
    (C, {"prompt": "a", "temperature": -1}, "temperature"),
    (C, {"prompt": "a", "top_p": 0}, "top_p"),
    (C, {"prompt": "a", "min_p": 1.5}, "min_p"),
    (C, {"prompt": "a", "typical_p": 0}, "typical_p"),
    (C, {"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    (C, {"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    (C, {"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    (C, {"prompt": "a", "n": 5}, "'n'"),
    (C, {"prompt": "a", "best_of": 2}, "best_of"),
    (C, {"prompt": "a", "logit_bias": {"1": 101}}, "logit_bias"),
    (C, {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    (C, {"prompt": "a", "seed": "x"}, "seed"),
    (C, {"prompt": "a", "stop": [1]}, "stop"),
    (C, {"prompt": "a", "ignore_eos": "yes"}, "ignore_eos"),
    (C, {"prompt": "a", "cache_prompt": 1}, "cache_prompt"),
    (C, {"prompt": "a", "session_id": 7}, "session_id"),
    (C, {"prompt": "a", "priority": 1.5}, "priority"),
    (C, {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    (CH, {"messages": U, "continue_final_message": True}, "assistant"),
    (CH, {"messages": U + [{"role": "assistant", "content": "x"}], "continue_final_message": True,
          "add_generation_prompt": True}, "add_generation_prompt"),
    (CH, {"messages": U, "prompt_logprobs": 1}, "prompt_logprobs"),
    (CH, {"messages": U, "top_logprobs": 3}, "logprobs"),
    (CH, {"messages": U, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CH, {"messages": U, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ("/infill", {"input_prefix": "a"}, "fill-in-the-middle"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "a", "with_pieces": "y"}, "with_pieces"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "vocabulary"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
]


@pytest.mark.parametrize("path,body,needle", BAD, ids=[f"{p}:{json.dumps(b)[:40]}" for p, b, _ in BAD])
def test_bad_values_are_400_envelopes(imp_server, path, body, needle):
    status, headers, data = raw(imp_server, "POST", path, dict(body, model="x") if path != "/tokenize" and
                                path != "/detokenize" else body, {"X-Request-Id": "bad-1"})
    assert status == 400, data
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert needle in err["message"]
    assert headers["X-Request-Id"] == "bad-1"


def test_ids_on_every_response(imp_server):
    status, headers, _ = raw(imp_server, "POST", C, {"model": "x", "prompt": "a", "max_tokens": 1})
    assert status == 200 and headers["X-Request-Id"].startswith("cmpl-")
    long = "x" * 300
    status, headers, _ = raw(imp_server, "GET", "/nope", headers={"X-Request-Id": long})
    assert status == 404 and headers["X-Request-Id"] == long[:128]
    status, headers, data = raw(imp_server, "GET", "/v1/completions")
    assert status == 405 and json.loads(data)["error"]["message"] and headers["X-Request-Id"]


# --------------------------------------------------------------------------- usage when a stop string ends

def test_a_stop_string_keeps_the_usage_in_every_dialect(cl, imp_server):
    """The renderer ends such a choice, not the scheduler (whose own last TokenOut, with the counts, comes
    after the client's end): completion_tokens counts the tokens through the one that completed the stop
    string, in each dialect that has stop strings (Responses has none), streamed or not."""
    msgs = [{"role": "user", "content": "Count from 1 to 30, separated by commas."}]
    full = cl.chat.completions.create(model="m", messages=msgs, max_tokens=80, temperature=0)
    text = full.choices[0].message.content
    stop = next(s for s in (" 7,", "7", " 3,", "3") if s in text)
    cut = cl.chat.completions.create(model="m", messages=msgs, max_tokens=80, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].message.content == text[:text.index(stop)]
    n = cut.usage.completion_tokens
    assert 0 < n < full.usage.completion_tokens and cut.usage.prompt_tokens == full.usage.prompt_tokens
    chunks = list(cl.chat.completions.create(model="m", messages=msgs, max_tokens=80, temperature=0, stop=[stop],
                                             stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == n and chunks[-1].usage.prompt_tokens == cut.usage.prompt_tokens
    st, _, body = raw(imp_server, "POST", "/v1/messages", {"model": "m", "max_tokens": 80, "messages": msgs,
                                                            "temperature": 0, "stop_sequences": [stop]})
    a = json.loads(body)
    assert st == 200 and a["stop_reason"] == "stop_sequence" and a["usage"]["output_tokens"] == n
    st, _, body = raw(imp_server, "POST", "/v1/completions", {"model": "m", "max_tokens": 80, "temperature": 0,
                                                               "prompt": "1, 2, 3, 4, 5,", "stop": [" 9"]})
    c = json.loads(body)
    assert st == 200 and c["choices"][0]["finish_reason"] == "stop" and c["usage"]["completion_tokens"] > 0, c


# --------------------------------------------------------------------------- DRY

def test_dry_breaks_a_loop_deterministically_and_bad_values_are_400s(imp_server):
    """llama.cpp's DRY fields on the OpenAI routes: a prompt in a loop continues the loop without DRY and
    leaves it with DRY (the same text every time, with speculation or without); out-of-range values are
    400s naming the field; a route that does not take DRY says so."""
    loop = {"model": "m", "prompt": "one two three four one two three four one two three", "max_tokens": 12,
            "temperature": 0}

    def text(**kw):
        st, _, body = raw(imp_server, "POST", "/v1/completions", {**loop, **kw})
        assert st == 200, body
        return json.loads(body)["choices"][0]["text"]

    plain = text()
    assert "four one two three" in plain
    on = dict(dry_multiplier=2.0, dry_allowed_length=1)
    dry = text(**on)
    assert dry != plain and "four one two three" not in dry
    assert text(**on, speculative=True) == text(**on, speculative=False) == dry
    assert text(dry_multiplier=2.0, dry_allowed_length=1, dry_penalty_last_n=0) == plain  # last_n 0: off
    st, _, body = raw(imp_server, "POST", "/v1/chat/completions", {
        "model": "m", "max_tokens": 8, "messages": MSGS, "dry_multiplier": 0.8, "dry_sequence_breakers": ["\n", "###"]})
    assert st == 200, body
    for bad in ({"dry_base": 0.5}, {"dry_multiplier": -1}, {"dry_allowed_length": 1.5}, {"dry_penalty_last_n": -2},
                {"dry_sequence_breakers": []}, {"dry_sequence_breakers": ["a", 3]}):
        st, _, body = raw(imp_server, "POST", "/v1/completions", {**loop, "dry_multiplier": 1.0, **bad})
        assert st == 400 and json.loads(body)["error"]["param"] == next(iter(bad)), (bad, body)
    st, _, body = raw(imp_server, "POST", "/v1/messages", {"model": "m", "max_tokens": 8, "messages": MSGS,
                                                            "dry_multiplier": 0.8})
    assert st == 400 and "chat/completions" in json.loads(body)["error"]["message"]


def test_banned_phrases_never_reach_the_client_stream_or_not(cl, imp_server):
    """banned_strings / banned_regex (imp.core.banned): the greedy answer names Paris; banned (without case),
    the text never does, streamed or not (the same text), usage counts the rewinds, logprobs stay one per
    token, the KV pool is whole afterwards; bad values and the refused pairs are 400s naming the field."""
    msgs = [{"role": "user", "content": "What is the capital of France? One sentence."}]

    def chat(stream=False, **kw):
        r = cl.chat.completions.create(model="m", messages=msgs, max_tokens=30, temperature=0, stream=stream,
                                       **({"stream_options": {"include_usage": True}} if stream else {}),
                                       extra_body=kw)
        if not stream:
            return r.choices[0].message.content, r.usage
        parts, usage = [], None
        for ev in r:
            parts += [c.delta.content or "" for c in ev.choices]
            usage = ev.usage or usage
        return "".join(parts), usage

    plain, _ = chat()
    assert "Paris" in plain
    for kw in ({"banned_strings": ["paris"]}, {"banned_regex": [r"[Pp]ar[a-z]*"]}):
        text, usage = chat(**kw)
        assert "paris" not in text.lower() and text, (kw, text)
        assert usage.completion_tokens_details.model_extra["imp_banned_rewinds"] >= 1
        assert chat(stream=True, **kw)[0] == text
    r = cl.chat.completions.create(model="m", messages=msgs, max_tokens=30, temperature=0.8, seed=3, n=2,
                                   logprobs=True, extra_body={"banned_strings": ["Paris", "France"]})
    for c in r.choices:
        assert "paris" not in c.message.content.lower() or r.usage.completion_tokens_details.model_extra.get(
            "imp_banned_rewinds", 0) >= 64  # the rewinds spent: the phrases pass (the reference's rule)
        assert len(c.logprobs.content) > 0
    assert sum(len(c.logprobs.content) for c in r.choices) == r.usage.completion_tokens
    health = json.loads(raw(imp_server, "GET", "/health")[2])
    assert health["kv_blocks_used"] == health["kv_blocks_pinned"] and health["kv_blocks_reserved"] == 0, health
    body = {"model": "m", "messages": msgs, "max_tokens": 8}
    for bad, field in (({"banned_strings": [""]}, "banned_strings"), ({"banned_strings": ["x"] * 65}, "banned_strings"),
                       ({"banned_strings": ["é" * 129]}, "banned_strings"), ({"banned_regex": ["("]}, "banned_regex"),
                       ({"banned_regex": ["a*"]}, "banned_regex"), ({"banned_regex": ["x"] * 17}, "banned_regex"),
                       ({"banned_strings": ["x"], "mirostat": 2}, "banned_strings"),
                       ({"banned_strings": ["x"], "response_format": {"type": "json_object"}}, "banned_strings"),
                       ({"banned_regex": ["x"], "tool_choice": "required", "tools": [{"type": "function", "function": {
                           "name": "f", "parameters": {"type": "object", "properties": {}}}}]}, "banned_regex")):
        st, _, out = raw(imp_server, "POST", "/v1/chat/completions", {**body, **bad})
        assert st == 400 and json.loads(out)["error"]["param"] == field, (bad, out)
    st, _, out = raw(imp_server, "POST", "/v1/chat/completions", {**body, "banned_strings": []})  # [] = off
    assert st == 200, out
    st, _, out = raw(imp_server, "POST", "/v1/messages", {**body, "banned_strings": ["x"]})
    assert st == 400 and "chat/completions" in json.loads(out)["error"]["message"]


def test_the_logit_lens_rides_on_each_content_entry_stream_or_not(cl, imp_server):
    """logit_lens: one {layer, rank, logprob, entropy, top} per layer on every content entry (it implies
    logprobs), the last layer's the sampled row's at temperature 0 without penalties; the same streamed;
    the text is the text without it; bad values, and the routes without it, are 400s naming it."""
    body = dict(model="m", messages=MSGS, max_tokens=5, temperature=0, extra_body={"repetition_penalty": 1.0})
    plain = cl.chat.completions.create(**body)
    r = cl.chat.completions.create(**{**body, "extra_body": {"repetition_penalty": 1.0, "logit_lens": 3}})
    assert r.choices[0].message.content == plain.choices[0].message.content
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        lens = e.model_extra["logit_lens"]
        assert [x["layer"] for x in lens] == list(range(30)) and all(len(x["top"]) == 3 for x in lens)
        assert lens[-1]["rank"] == 1 and abs(lens[-1]["logprob"] - e.logprob) < 1e-3
        assert lens[-1]["top"][0]["token"] == e.token
    streamed = [c.logprobs.content for ev in cl.chat.completions.create(
        **{**body, "stream": True, "extra_body": {"repetition_penalty": 1.0, "logit_lens": 3}})
        for c in ev.choices if c.logprobs]
    got = [e.model_extra["logit_lens"] for part in streamed for e in part]
    assert [[x["rank"] for x in L] for L in got] == [[x["rank"] for x in e.model_extra["logit_lens"]]
                                                    for e in entries]
    for bad in (21, -1, "yes", 2.5):
        st, _, out = raw(imp_server, "POST", "/v1/chat/completions",
                         {"model": "m", "messages": MSGS, "logit_lens": bad})
        assert st == 400 and json.loads(out)["error"]["param"] == "logit_lens", (bad, out)
    for path, extra in (("/v1/completions", {"prompt": PROMPT}), ("/v1/messages", {"messages": MSGS, "max_tokens": 4})):
        st, _, out = raw(imp_server, "POST", path, {"model": "m", "logit_lens": True, **extra})
        assert st == 400 and "chat/completions" in json.loads(out)["error"]["message"], out


def test_cfg_scale_guides_by_the_system_message_and_refuses_what_it_cannot_guide(cl, imp_server):
    """Classifier-free guidance on chat: the same greedy text every time, streamed or not, another text than
    without it (the system message pushed harder), another again with a negative prompt; the pool whole after;
    the pairs the reference refuses (no system message nor negative prompt, tools, banned strings) and n > 1
    are 400s naming cfg_scale; a route without it says which route has it."""
    msgs = [{"role": "system", "content": "You are a pirate. Always talk like a pirate."},
            {"role": "user", "content": "Tell me about the sea in one sentence."}]
    body = dict(model="m", messages=msgs, max_tokens=24, temperature=0)

    def text(stream=False, **kw):
        r = cl.chat.completions.create(**body, stream=stream, extra_body=kw)
        if not stream:
            return r.choices[0].message.content
        return "".join(c.delta.content or "" for ev in r for c in ev.choices)

    plain, guided = text(), text(cfg_scale=3)
    assert guided != plain and guided == text(cfg_scale=3) == text(stream=True, cfg_scale=3)
    assert text(cfg_scale=3, cfg_negative_prompt="You are a polite librarian.") not in (plain, guided)
    assert text(cfg_scale=1) == plain  # 1 = off
    health = json.loads(raw(imp_server, "GET", "/health")[2])
    assert health["kv_blocks_used"] == health["kv_blocks_pinned"] and health["kv_blocks_reserved"] == 0, health
    req = {"model": "m", "messages": msgs, "max_tokens": 4, "cfg_scale": 2}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    for bad in ({"messages": msgs[1:]}, {"tools": tools}, {"banned_strings": ["x"]}, {"n": 2}, {"cfg_scale": 11},
                {"cfg_scale": 0.5}):
        st, _, out = raw(imp_server, "POST", "/v1/chat/completions", {**req, **bad})
        assert st == 400 and json.loads(out)["error"]["param"] == "cfg_scale", (bad, out)
    st, _, out = raw(imp_server, "POST", "/v1/chat/completions", {**req, "messages": msgs[1:],
                                                                  "cfg_negative_prompt": "Be dull."})
    assert st == 200, out  # no system message, but a negative prompt: guided
    st, _, out = raw(imp_server, "POST", "/v1/messages", {**req, "messages": msgs[1:]})
    assert st == 400 and "chat/completions" in json.loads(out)["error"]["message"]


def test_the_sampling_table_mixed_with_plain_neighbours_gives_the_alone_texts(imp_server):
    """DRY, mirostat, banned strings, guidance, the logit lens and plain requests at once: each text is the one
    it gets alone (the shared server's event log, with these in it, is replayed by test_server_e2e)."""
    sysmsg = [{"role": "system", "content": "You are a pirate."}, *MSGS]
    bodies = [{"messages": MSGS, "dry_multiplier": 0.8},
              {"messages": MSGS, "mirostat": 2, "temperature": 0.9, "seed": 4},
              {"messages": MSGS, "banned_strings": ["Paris"]},
              {"messages": sysmsg, "cfg_scale": 2.5},
              {"messages": MSGS, "logit_lens": 2},
              {"messages": MSGS}, {"messages": sysmsg, "temperature": 0.7, "seed": 9}]

    def text(b):
        st, _, out = raw(imp_server, "POST", "/v1/chat/completions", {"model": "m", "max_tokens": 16, "temperature": 0,
                                                                      **b})
        assert st == 200, out
        return json.loads(out)["choices"][0]["message"]["content"]

    alone = [text(b) for b in bodies]
    got: dict[int, str] = {}
    threads = [threading.Thread(target=lambda i=i, b=b: got.__setitem__(i, text(b))) for i, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [got[i] for i in range(len(bodies))] == alone
    assert "Paris" not in alone[2]


def test_mirostat_is_seeded_and_its_bad_values_are_400s(imp_server):
    """llama.cpp's mirostat fields on the OpenAI routes: a seed gives the same text (with speculation or without),
    another tau another text; out-of-range values are 400s naming the field."""
    body = {"model": "m", "prompt": "Once upon a time, in a small village by the sea,", "max_tokens": 24,
            "temperature": 1.0, "seed": 5, "mirostat": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2}

    def text(**kw):
        st, _, out = raw(imp_server, "POST", "/v1/completions", {**body, **kw})
        assert st == 200, out
        return json.loads(out)["choices"][0]["text"]

    a = text()
    assert a == text() == text(speculative=True) == text(speculative=False)
    assert text(mirostat_tau=9.0) != a or text(mirostat=1) != a
    st, _, out = raw(imp_server, "POST", "/v1/chat/completions", {
        "model": "m", "max_tokens": 8, "messages": MSGS, "mirostat": 1, "temperature": 0.7})
    assert st == 200, out
    for bad in ({"mirostat": 3}, {"mirostat": 1.5}, {"mirostat_tau": -1}, {"mirostat_eta": "x"}):
        st, _, out = raw(imp_server, "POST", "/v1/completions", {**body, **bad})
        assert st == 400 and json.loads(out)["error"]["param"] == next(iter(bad)), (bad, out)
