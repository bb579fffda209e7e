"""The Numba SentencePiece engine (imp/text/spm.py) against the `tokenizers` BPE it replaced.

The reference is that engine as imp built it (and HF transformers builds it from a GGUF): BPE
over the vocabulary with one merge per way of cutting a NORMAL / USER_DEFINED token in two,
ranked by the token's score, "▁" for spaces, byte fallback, fused unknowns, user-defined tokens
matched whole. Synthetic vocabularies with tied scores, duplicate texts, missing byte tokens and
characters outside the vocabulary run in every `make test`; Gemma 3's real one when it is cached.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer as HF
from tokenizers import models, normalizers

from imp.text.spm import SpmEngine
from imp.text.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED
from tests.test_tokenizer import _gemma_path


def hf_reference(tokens, types, scores, add_space_prefix, unk_id) -> HF:
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    ranked = []
    for i, t in enumerate(tokens):
        if len(t) > 1 and types[i] in (NORMAL, USER_DEFINED):
            ranked += [(-scores[i], i, vocab[t[:k]], t[:k], t[k:]) for k in range(1, len(t))
                       if t[:k] in vocab and t[k:] in vocab]
    ranked.sort()
    hf = HF(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked], byte_fallback=True,
                       unk_token=tokens[unk_id] if unk_id is not None else None, fuse_unk=True))
    norm = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("\u2581"))
    hf.normalizer = normalizers.Sequence(norm)
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, ty in enumerate(types) if ty == CONTROL])
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, ty in enumerate(types) if ty == USER_DEFINED]
    if user:
        hf.add_tokens(user)
    hf.encode_special_tokens = True
    return hf


def engine(tokens, types, scores, add_space_prefix, unk_id) -> SpmEngine:
    mergeable = {i for i, t in enumerate(tokens) if len(t) > 1 and types[i] in (NORMAL, USER_DEFINED)}
    return SpmEngine(tokens, scores, add_space_prefix, unk_id, mergeable,
                     [i for i, ty in enumerate(types) if ty == USER_DEFINED])


WORDS = "the quick brown fox jumps over lazy dogs and then sleeps under a tree naïve café 東京 🙂".split()


def synthetic(seed: int, byte_tokens: bool):
    """A vocabulary in Gemma's shape: specials, unk, bytes, characters, merged pieces (some with
    equal scores, some texts twice), user-defined tokens."""
    rng = random.Random(seed)
    tokens, types, scores = ["<pad>", "<unk>", "<bos>", "<eos>"], [CONTROL, UNKNOWN, CONTROL, CONTROL], [0.0] * 4
    if byte_tokens:
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [BYTE] * 256
        scores += [0.0] * 256
    chars = sorted({c for w in WORDS for c in w if c not in "🙂東"} | {"\u2581"})  # some characters stay out
    tokens += chars
    types += [NORMAL] * len(chars)
    scores += [-100.0] * len(chars)
    pieces = set()
    for w in WORDS:
        w = "\u2581" + w
        for _ in range(6):
            a = rng.randrange(len(w) - 1)
            pieces.add(w[a:rng.randrange(a + 2, len(w) + 1)])
    for p in sorted(pieces):
        tokens.append(p)
        types.append(NORMAL)
        scores.append(float(rng.choice([-1, -2, -3, -len(p)])))  # plenty of ties
    for p in sorted(pieces)[:5]:  # the same text twice: the first id is the text's
        tokens.append(p)
        types.append(NORMAL)
        scores.append(-0.5)
    for u in ("<u1>", "zz", "\u2581dog"):
        tokens.append(u)
        types.append(USER_DEFINED)
        scores.append(0.0)
    tokens.append("<start_of_turn>")
    types.append(CONTROL)
    scores.append(0.0)
    return tokens, types, scores


def texts(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = list(" \n\t.,!") + WORDS + ["<u1>", "zz", "<start_of_turn>", "dog", "東京", "\u2581", "éé"]
    return [("" if rng.random() < 0.5 else " ").join(rng.choice(alphabet) for _ in range(rng.randrange(1, 25)))
            for _ in range(n)]


@pytest.mark.parametrize("byte_tokens", [True, False], ids=["byte-fallback", "unk-fused"])
@pytest.mark.parametrize("prefix", [True, False], ids=["space-prefix", "no-prefix"])
def test_ids_equal_the_tokenizers_bpe(byte_tokens, prefix):
    for seed in range(3):
        vocab = synthetic(seed, byte_tokens)
        ref, ours = hf_reference(*vocab, prefix, 1), engine(*vocab, prefix, 1)
        for s in texts(seed, 400):
            assert ours.encode(s) == ref.encode(s, add_special_tokens=False).ids, (seed, s)


def test_long_text_and_empty():
    vocab = synthetic(7, True)
    ref, ours = hf_reference(*vocab, True, 1), engine(*vocab, True, 1)
    long = " ".join(texts(8, 2000))
    assert ours.encode(long) == ref.encode(long, add_special_tokens=False).ids
    assert ours.encode("") == []


@pytest.mark.slow
@pytest.mark.skipif(_gemma_path() is None, reason="Gemma 3 GGUF not in the cache")
def test_gemma_vocabulary():
    from imp.formats.gguf_file import read_header
    from tests.test_tokenizer import CORPUS

    md = read_header(_gemma_path()).metadata
    vocab = (md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"], md["tokenizer.ggml.scores"])
    prefix, unk = bool(md.get("tokenizer.ggml.add_space_prefix", True)), md.get("tokenizer.ggml.unknown_token_id")
    ref, ours = hf_reference(*vocab, prefix, unk), engine(*vocab, prefix, unk)
    for s in list(CORPUS) + texts(1, 300) + [Path(__file__).read_text()]:
        assert ours.encode(s) == ref.encode(s, add_special_tokens=False).ids, s[:80]
