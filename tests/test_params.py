"""Sampling fields: defaults from the reference, ranges exact, bad values a 400 naming the field."""

import pytest

from imp.http.errors import ApiError
from imp.http.params import ModelDefaults, sampling

KW = dict(defaults=ModelDefaults(), vocab_size=1000, prompt_len=10, max_context=100,
          fixed_max_tokens=None, eos_ids=(2,))


def test_defaults_are_imps_not_openais():
    g = sampling({}, **KW)
    p = g.params
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.95, 50, 1.05)
    assert p.max_tokens == 90  # the rest of the context
    assert p.stop_token_ids == (2,) and g.n == 1 and not g.stream
    assert 0 <= p.seed < 2**63


def test_top_k_rules():
    assert sampling({"top_k": 0}, **KW).params.top_k == 50
    assert sampling({"top_k": 5}, **KW).params.top_k == 5
    assert sampling({"top_k": 5000}, **KW).params.top_k == 0  # >= vocab: off
    assert sampling({"top_k": -1}, **KW).params.top_k == 0


def test_max_tokens_alias_and_context_clamp():
    assert sampling({"max_completion_tokens": 7}, **KW).params.max_tokens == 7
    assert sampling({"max_tokens": 500}, **KW).params.max_tokens == 90
    assert sampling({}, **dict(KW, fixed_max_tokens=16)).params.max_tokens == 16


def test_seed_is_reproducible_and_logit_bias_parsed():
    p = sampling({"seed": 42, "logit_bias": {"5": -100, "7": 2.5}}, **KW).params
    assert p.seed == 42 and p.logit_bias == ((5, -100.0), (7, 2.5))


def test_logprobs_fields():
    assert sampling({"logprobs": True, "top_logprobs": 3}, **KW).params.logprobs == 3
    assert sampling({"logprobs": True}, **KW).params.logprobs == 0
    assert sampling({}, **KW).params.logprobs == -1


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
        sampling(body, **KW)
    assert e.value.status == 400 and e.value.param == param


def test_prompt_filling_the_context_is_a_400():
    with pytest.raises(ApiError) as e:
        sampling({}, **dict(KW, prompt_len=100))
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
