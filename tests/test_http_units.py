"""Pure pieces of the HTTP surface: reasoning split, FIM prompts, prompt
scoring, the new request fields."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from imp.text.fim import FimTokens, build_infill, fim_tokens
from imp.http.pipeline.reasoning import ThinkSplitter, prompt_opens_think
from imp.messages import SamplingParams, SeqWork
from imp.model.rows import prompt_logprobs as score_prompt


def split(pieces, thinking=False):
    sp = ThinkSplitter(thinking)
    r = c = ""
    for p in pieces:
        a, b = sp.push(p)
        r, c = r + a, c + b
    a, b = sp.flush()
    return r + a, c + b


def test_reasoning_split_basics():
    assert split(["<think>plan</think>\n\nanswer"]) == ("plan", "answer")
    assert split(["  <th", "ink>pl", "an</th", "ink>ans"]) == ("plan", "ans")
    assert split(["no think here <think>x</think>"]) == ("", "no think here <think>x</think>")
    assert split(["still thinking"], thinking=True) == ("still thinking", "")
    assert split(["a</think>b"], thinking=True) == ("a", "b")
    assert split(["<thi"]) == ("", "<thi")  # never completed: it was text
    assert prompt_opens_think("<|im_start|>assistant\n<think>") and not prompt_opens_think("<think>x</think>")


@settings(max_examples=300, deadline=None)
@given(
    think=st.text(alphabet="ab<>/\n tk", max_size=20).filter(lambda s: "</think>" not in s),
    answer=st.text(alphabet="ab<>/\n tk", max_size=20),
    lead=st.sampled_from(["", " ", "\n"]),
    cuts=st.lists(st.integers(0, 60), max_size=10),
    open_in_prompt=st.booleans(),
)
def test_reasoning_split_is_chunking_invariant_and_never_leaks_a_tag(think, answer, lead, cuts, open_in_prompt):
    text = (lead if not open_in_prompt else "") + ("" if open_in_prompt else "<think>") + think + "</think>" + answer
    pieces, last = [], 0
    for c in sorted(set(min(c, len(text)) for c in cuts)):
        pieces.append(text[last:c])
        last = c
    pieces.append(text[last:])
    whole = split([text], open_in_prompt)
    assert split(pieces, open_in_prompt) == whole
    r, c = whole
    assert r == (think if open_in_prompt else think) and "</think>" not in r
    assert c == answer.lstrip("\n")


# --------------------------------------------------------------------------- FIM


class FakeTok:
    vocab_size, bos_id, add_bos = 100, 1, True

    def encode(self, text, add_special=False, parse_special=False):
        return [50 + (ord(ch) % 40) for ch in text]


def test_fim_tokens_from_metadata_or_vocabulary():
    vocab = [f"t{i}" for i in range(100)]
    assert fim_tokens({}, vocab) is None
    meta = {"tokenizer.ggml.fim_pre_token_id": 3, "tokenizer.ggml.fim_suf_token_id": 4,
            "tokenizer.ggml.fim_mid_token_id": 5}
    assert fim_tokens(meta, vocab) == FimTokens(3, 4, 5)
    vocab[7], vocab[8], vocab[9], vocab[10] = "<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>"
    assert fim_tokens({}, vocab) == FimTokens(7, 8, 9, None, 10)
    # a GGUF's vocabulary is packed: found in its blob, the first of duplicates, never a part of one
    from imp.formats.packed import PackedStr

    vocab[20], vocab[30] = "<fim_prefix>", "x<file_sep>"
    assert fim_tokens({}, PackedStr.of_str(vocab)) == fim_tokens({}, vocab) == FimTokens(7, 8, 9, None, 10)
    assert fim_tokens({}, PackedStr.of_str(vocab[:9])) is None


def test_fim_prompt_layout_like_llama_cpp():
    tok, f = FakeTok(), FimTokens(3, 4, 5)
    ids = build_infill(tok, f, "ab", "c", prompt="d")
    assert ids == [1, 3, *tok.encode("ab"), *tok.encode("d"), 4, *tok.encode("c"), 5]
    with_extra = build_infill(tok, FimTokens(3, 4, 5, rep=6, sep=7), "a", "b",
                              extra=[{"filename": "x.py", "text": "z"}])
    assert with_extra[0] == 6 and 7 in with_extra and with_extra.index(1) > with_extra.index(7)


# --------------------------------------------------------------------------- prompt scoring


def test_score_prompt_is_the_raw_log_softmax_with_ranks():
    torch.manual_seed(0)
    rows = torch.randn(4, 30)
    rows[1, 5] = float("-inf")  # a -inf logit must not reach JSON
    w = SeqWork("s", [1, 2, 5, 4], 10, [0], False, SamplingParams(max_tokens=1), prompt_logprobs=3,
                prompt_next=7)
    out = score_prompt(rows, w)
    ref = torch.log_softmax(rows, -1)
    assert [e.position for e in out] == [11, 12, 13, 14]
    assert [e.token_id for e in out] == [2, 5, 4, 7]
    for j, e in enumerate(out):
        assert e.logprob == pytest.approx(max(ref[j, e.token_id].item(), -9999.0), abs=1e-5)
        assert e.rank == 1 + int((ref[j] > ref[j, e.token_id]).sum())
        assert [t for t, _ in e.top] == torch.topk(ref[j], 3).indices.tolist()
    assert out[1].logprob == -9999.0
    last = SeqWork("s", [1, 2], 0, [0], True, SamplingParams(max_tokens=1), prompt_logprobs=0)
    assert [e.position for e in score_prompt(rows[:1], last)] == [1]  # the last row samples
