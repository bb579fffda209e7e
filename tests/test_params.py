"""Sampling fields: defaults from the reference, ranges exact, bad values a 400 naming the field.

The chat dialect parses the body (its ranges), `resolve.sampling_params`
fills in the model's defaults and the context limits — one place each.
"""

import types

import pytest

from imp.engine.port import ModelCard
from imp.http.dialects.chat import parse as chat_request
from imp.http.dialects.completions import parse as openai_completions
from imp.http.pipeline import resolve
from imp.http.errors import ApiError
from imp.text.model import SamplingDefaults

CARD = ModelCard(name="m", path="", fingerprint="f" * 64, context_length=100, vocab_size=1000, block_size=16,
                 kv_blocks=64, kv_bytes_per_token=None, replicas=1, max_batch_size=8, max_queued_tokens=0,
                 retry_after_s=1.0, device="cpu", created=0)
TEXT = types.SimpleNamespace(defaults=SamplingDefaults(), eos_ids=(2,))
MSG = [{"role": "user", "content": "hi"}]


def params(body, prompt_len=10, fixed=None, chat=True):
    full = {"model": "m", **({"messages": MSG} if chat else {"prompt": "hi"}), **body}
    req = (chat_request if chat else openai_completions).parse(full, CARD.vocab_size)
    return req, resolve.sampling_params(req, prompt_len, CARD, TEXT, fixed)


def test_defaults_are_imps_not_openais():
    req, p = params({})
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.95, 50, 1.05)
    assert p.max_tokens == 90  # the rest of the context
    assert p.stop_token_ids == (2,) and req.n == 1 and not req.stream
    assert 0 <= p.seed < 2**63


def test_top_k_rules():
    assert params({"top_k": 0})[1].top_k == 50
    assert params({"top_k": 5})[1].top_k == 5
    assert params({"top_k": 5000})[1].top_k == 0  # >= vocab: off
    assert params({"top_k": -1})[1].top_k == 0


def test_max_tokens_alias_and_context_clamp():
    assert params({"max_completion_tokens": 7})[1].max_tokens == 7
    assert params({"max_tokens": 500})[1].max_tokens == 90
    assert params({}, fixed=16)[1].max_tokens == 16


def test_seed_is_reproducible_and_logit_bias_parsed():
    p = params({"seed": 42, "logit_bias": {"5": -100, "7": 2.5}})[1]
    assert p.seed == 42 and p.logit_bias == ((5, -100.0), (7, 2.5))


def test_logprobs_fields():
    assert params({"logprobs": True, "top_logprobs": 3})[1].logprobs == 3
    assert params({"logprobs": True})[1].logprobs == 0
    assert params({})[1].logprobs == -1


def test_model_is_required():
    for body in ({"messages": MSG}, {"model": "", "messages": MSG}, {"model": 3, "messages": MSG}):
        with pytest.raises(ApiError) as e:
            chat_request.parse(body, 1000)
        assert e.value.status == 400 and e.value.param == "model"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"typical_p": 0}, "typical_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"n": 0}, "n"),
        ({"n": 5}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": "9"}, "max_tokens"),
        ({"seed": "x"}, "seed"),
        ({"best_of": 2}, "best_of"),
        ({"logit_bias": []}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"1000": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"1": float("nan")}}, "logit_bias"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stop": 5}, "stop"),
        ({"stop": ["a"] * 17}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"priority": 1.5}, "priority"),
    ],
)
def test_bad_values_are_400_naming_the_field(body, param):
    with pytest.raises(ApiError) as e:
        params(body)
    assert e.value.status == 400 and e.value.param == param


def test_prompt_filling_the_context_is_a_400():
    with pytest.raises(ApiError) as e:
        params({}, prompt_len=100)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"


def test_new_fields_pass_through_and_are_checked():
    req, p = params({"cache_prompt": True, "session_id": "s-1", "priority": -3, "ignore_eos": True})
    assert (req.cache_prompt, req.session_id, req.priority, p.ignore_eos) == (True, "s-1", -3, True)
    req, p = params({"prompt_logprobs": 5}, chat=False)
    assert req.prompt_logprobs == 5 and p.prompt_logprobs == 5
    for body, chat in [({"prompt_logprobs": 21}, False), ({"prompt_logprobs": 2}, True),
                       ({"prompt_logprobs": 1, "stream": True}, False), ({"cache_prompt": 1}, False),
                       ({"session_id": 5}, False), ({"session_id": "x" * 300}, False),
                       ({"priority": "high"}, False), ({"logprobs": 21}, False), ({"logprobs": True}, False)]:
        with pytest.raises(ApiError) as e:
            params(body, chat=chat)
        assert e.value.status == 400 and e.value.param
