"""llguidance's view of OUR vocabulary: token bytes, EOS, special ids.

llguidance builds its token trie from the bytes of every token. We hand it
the bytes our tokenizer decodes each id to (`Tokenizer.piece_bytes`), not a
HF tokenizer.json, so the masks are about exactly the ids our model samples.

Special tokens get llguidance's marker byte 0xFF in front (its convention,
docs/special_tokens.md upstream): no UTF-8 text contains 0xFF, so a special
token is never allowed because its *text* (`<|im_end|>`) fits the grammar;
a Lark grammar can still name one explicitly (`<|im_end|>`, `<[2]>`).
Every EOS id is marked special too, so EOS enters a mask only through
llguidance's own rule: when the grammar may end here.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import llguidance

SPECIAL_MARKER = b"\xff"

# llguidance's slices: precomputed sub-tries of the tokens a common lexeme allows, so a mask
# inside a JSON string is a copy, not a walk of the whole trie (2 ms -> 0.08 ms a mask on
# Gemma 3's 262,144 tokens). Its default (`general_slices()`) is four: JSON whitespace and
# a string's characters {1,10}, {1,30} and unbounded; they hold 93 MB for Gemma 3 (17 for
# SmolLM2), the {1,30} slice alone 44 (8), none 29 (5). A fresh matcher's first mask with
# the one slice against the four (bench/constrain_slices.py, Gemma 3): strings 65 -> 84 us,
# maxLength 40 94 -> 106, an integer with strict whitespace 36 -> 50, a key 16-34 either
# way. 49 MB of a ~500 MB server for at most 20 us where a CPU decode step is ~10 ms.
DEFAULT_SLICES = (
    r'[^"\\\x00-\x1F\x7F]{1,30}',  # a JSON string's characters, up to 30 bytes a token
)


class TokenizerView:
    """The duck-typed object `llguidance.LLTokenizer` reads (its TokenizerWrapper protocol).

    llguidance calls it (`view(text) -> ids`) only to turn bytes the grammar
    forces into tokens (fast-forward tokens); with no `encode` it uses
    llguidance's own greedy longest-match over the same trie, which is a
    valid, if not always canonical, tokenization."""

    is_tokenizer_wrapper = True  # llguidance checks this flag

    def __init__(self, tokens: list[bytes], eos_ids: Sequence[int], bos_id: int | None,
                 special_ids: Iterable[int], encode: Callable[[str], list[int]] | None):
        self.tokens = tokens
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = bos_id
        self.special_token_ids = sorted(special_ids)
        self._encode = encode
        self._greedy: llguidance.LLTokenizer | None = None  # set once the LLTokenizer exists

    def __call__(self, text: str) -> list[int]:
        # Called from inside llguidance (possibly a Rust worker thread) which unwraps the
        # result: an exception here would abort the process, so it must never raise.
        try:
            if self._encode is not None:
                return list(self._encode(text))
        except Exception:  # noqa: BLE001
            pass
        return self._greedy.greedy_tokenize(text) if self._greedy is not None else []


def build_tokenizer(token_bytes: list[bytes], eos_ids: Iterable[int], special_ids: Iterable[int], *,
                    bos_id: int | None = None, n_vocab: int | None = None,
                    encode: Callable[[str], list[int]] | None = None,
                    slices: list[str] | None = None) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for a vocabulary (build once per model: ~0.2 s for 49k tokens).

    token_bytes[i] is what id i decodes to; eos_ids end a generation (at least
    one); special_ids are never matched by their text. n_vocab pads the
    vocabulary to the model's logits width (padding ids are never allowed), so
    a bitmask row has ceil(n_vocab / 32) words. `encode(text)` must return ids
    whose bytes are exactly text's UTF-8 (no BOS, no added prefix space); leave
    it None when unsure. slices: llguidance's mask-speed-up regexes (None: DEFAULT_SLICES;
    [] none)."""
    eos = sorted(set(eos_ids))
    if not eos:
        # llguidance would append an empty EOS token, one past the model's vocabulary
        raise ValueError("at least one EOS id is needed")
    n = len(token_bytes) if n_vocab is None else n_vocab
    if n < len(token_bytes):
        raise ValueError(f"n_vocab {n} < {len(token_bytes)} tokens")
    if eos[-1] >= n or eos[0] < 0:
        raise ValueError(f"EOS ids {eos} outside the vocabulary of {n}")
    special = {i for i in special_ids if 0 <= i < n} | set(eos)
    # b"" tokens (padding, or ids that decode to nothing) are never in a mask: the trie
    # has no path to them.
    tokens = [bytes(b) for b in token_bytes] + [b""] * (n - len(token_bytes))
    view = TokenizerView(tokens, eos, bos_id, special, encode)
    tok = llguidance.LLTokenizer(view, eos_token=eos, slices=list(DEFAULT_SLICES if slices is None else slices))
    view._greedy = tok
    view.tokens = []  # llguidance copied them into its trie; kept, they were ~14 MB for Gemma 3
    return tok


def from_tokenizer(tok, n_vocab: int | None = None) -> llguidance.LLTokenizer:
    """The llguidance tokenizer for one of our tokenizers (duck-typed: `vocab_size`,
    `piece_bytes(i)`, `is_special(i)`, `eos_ids`, `bos_id`), padded to the model's
    logits width n_vocab. Built once per model at boot."""
    V = tok.vocab_size
    return build_tokenizer([tok.piece_bytes(i) for i in range(V)], tok.eos_ids,
                           [i for i in range(V) if tok.is_special(i)], bos_id=getattr(tok, "bos_id", None),
                           n_vocab=max(V, n_vocab or V))
