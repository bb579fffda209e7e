"""Tokenizer built from a GGUF file's metadata, with llama.cpp's choices.

A GGUF carries no tokenizer.json: only the vocabulary, merges or scores,
token types and a few flags. We rebuild the tokenizer with HF `tokenizers`
(fast, well kept) and pick what llama.cpp (`src/llama-vocab.cpp`) picks,
because llama.cpp is what the GGUF was made for:

  gpt2  byte-level BPE. `tokenizer.ggml.pre` names the split regexes, which
        llama.cpp applies *in sequence* (each to the pieces the previous one
        left); a chain of isolated `Split`s does the same.
  llama SentencePiece-style (Gemma, Llama 2): llama.cpp merges the adjacent
        pair whose concatenation is the best-scored token, falling back to
        `<0xNN>` byte tokens. That is BPE with merges ranked by the merged
        token's score, spaces written as U+2581, and byte_fallback; our own
        Numba engine runs it (`imp/text/spm.py`: 160 MB less than
        `tokenizers` for Gemma's 515 k merges).

Decoding does not go through `tokenizers`: every id maps to its bytes once,
at load, and text is `bytes.decode("utf-8", "replace")`. The incremental
detokenizer uses the same table with an incremental UTF-8 decoder, so a
stream's concatenated output equals `decode(all_ids)` by construction, and a
character split across tokens is held back instead of streamed as U+FFFD.

Special tokens (CONTROL type) are only recognised in text when the caller
says the text is trusted (`parse_special=True`, or a template part in
`encode_chat`); user text that spells `<|im_start|>` stays plain text.
"""

from __future__ import annotations

import codecs
import re
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from imp.formats.packed import PackedBytes
from imp.text.spm import SpmEngine

if TYPE_CHECKING:  # HF `tokenizers` is imported where a byte-level BPE is built: a SentencePiece
    from tokenizers import Tokenizer as _HFTokenizer  # model's server never maps its 6 MB library

# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# --------------------------------------------------------------------------
# pre-tokenizer regexes, as in llama.cpp's llm_tokenizer_bpe constructor.
# llama.cpp rewrites `(?i:'s|...)` into explicit case classes because its
# regex engine lacks inline flags; the HF Oniguruma engine has them, and the
# two spellings match the same strings.

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]
_DIGITS_THEN_GPT2 = [r"\p{N}", _GPT2]

# (regex chain, ignore_merges, llama.cpp's add_bos default) per `pre` name
_PRE: dict[str, tuple[list[str], bool, bool]] = {}
for _names, _spec in [
    (["default", ""], (_DEFAULT, False, False)),
    (["gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "trillion"], ([_GPT2], False, False)),
    (
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"],
        (_DIGITS_THEN_GPT2, False, False),
    ),
    (
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"],
        ([_LLAMA3], True, True),
    ),
    (["dbrx", "smaug-bpe", "chatglm-bpe"], ([_LLAMA3], False, False)),
    (["qwen2", "stablelm2", "deepseek-r1-qwen", "megrez", "hunyuan"], ([_QWEN2], False, False)),
    (["tekken"], ([_TEKKEN], True, True)),
    (["gpt-4o", "llama4"], ([_GPT4O], False, False)),
]:
    for _n in _names:
        _PRE[_n] = _spec

# Texts llama.cpp treats as end-of-generation when the vocab has them.
EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>",
    "<|return|>", "<|call|>",
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def gguf_metadata(path) -> dict:
    """Every key/value of a GGUF header as plain Python values (no tensors).

    A direct parse (`gguf_file.read_header`): gguf.GGUFReader builds a numpy
    view per array element, which takes 4 s for SmolLM2's vocabulary and
    20+ s for Gemma's; this takes well under a second.
    """
    from imp.formats.gguf_file import read_header

    return read_header(path).metadata


_GIL_FREE_CHARS = 4096  # longer texts go through encode_batch, which runs without the GIL


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary. Thread-safe after init."""

    def __init__(self, meta: dict):
        kind = meta.get("tokenizer.ggml.model", "gpt2")
        kept: Sequence[str] = meta["tokenizer.ggml.tokens"]  # a PackedStr for a real vocabulary: kept
        tokens = list(kept)  # the builders walk it several times: decoded once, dropped after __init__
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        types = np.full(n, NORMAL, np.int32) if types is None or len(types) == 0 else np.asarray(types, np.int32)
        self.kind = kind
        self.vocab_size = n
        self._tokens = kept
        self._types = types

        def tid(key):
            v = meta.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None and 0 <= int(v) < n else None

        self.bos_id = tid("bos_token_id")
        self.eos_id = tid("eos_token_id")
        self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", kind == "llama"))
        if kind == "gpt2":
            pre = meta.get("tokenizer.ggml.pre", "default")
            if pre not in _PRE:
                # llama.cpp refuses unknown names too: a wrong split silently
                # gives different ids from the ones the model was trained on.
                raise ValueError(f"unknown tokenizer.ggml.pre {pre!r}; known: {sorted(_PRE)}")
            regexes, ignore_merges, add_bos_default = _PRE[pre]
            hf, self._piece_bytes = _byte_level(tokens, types, list(meta["tokenizer.ggml.merges"]), regexes,
                                                ignore_merges)
        elif kind == "llama":
            add_bos_default = True
            scores = meta.get("tokenizer.ggml.scores")
            scores = np.zeros(n) if scores is None or len(scores) == 0 else np.asarray(scores, np.float64)
            spm, self._piece_bytes = _sentencepiece(tokens, types, scores, self.add_space_prefix,
                                                    tid("unknown_token_id"))
        else:
            raise ValueError(f"unsupported tokenizer.ggml.model {kind!r} (gpt2 and llama are)")
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and self.bos_id is not None
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and self.eos_id is not None

        # Special = CONTROL; user-defined tokens are always matched whole
        # (llama.cpp does so even when specials are not parsed).
        self._special = frozenset(np.flatnonzero(types == CONTROL).tolist())
        # One engine, special-token spellings kept as text; trusted text is cut at them first
        # (`split_special`, as HF's added-token matcher does: leftmost-longest, every piece
        # normalized on its own, and the specials made here have no strip flags). A second engine
        # for trusted text, serialized to JSON and parsed back, was 1.4 s and ~100 MB of Gemma 3's load.
        if kind == "gpt2":
            from tokenizers import AddedToken

            hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(self._special)])
            user = [AddedToken(tokens[i], special=False, normalized=False)
                    for i in np.flatnonzero(types == USER_DEFINED).tolist()]
            if user:
                hf.add_tokens(user)
        self._set_engines(None, tokens, literal=hf if kind == "gpt2" else spm)

        eog = {i for i in (self.eos_id, tid("eot_token_id"), tid("eom_token_id")) if i is not None}
        eog |= {self._special_by_text[t] for t in EOG_TEXTS if t in self._special_by_text}
        self.eos_ids = frozenset(eog)

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> "Tokenizer":
        return cls(meta)

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        return cls(gguf_metadata(path))

    # ------------------------------------------------------------------ encode

    def _set_engines(self, hf: _HFTokenizer | None, tokens: list[str], literal: _HFTokenizer | None = None) -> None:
        """The engines: `hf` parses special-token spellings, the literal one keeps them as text (two
        rather than toggling `encode_special_tokens` per call, which would race between threads; the
        literal one a copy of hf through its JSON unless given); hf None: trusted text is cut at the
        specials here instead (`encode`). And the special-token matcher. Needs self._special."""
        self._hf_special = hf
        if literal is None:
            from tokenizers import Tokenizer as _HFTokenizer

            literal = _HFTokenizer.from_str(hf.to_str())
        self._hf_literal = literal
        if not isinstance(literal, SpmEngine):  # SpmEngine never matches specials
            self._hf_literal.encode_special_tokens = True
        specials = sorted({tokens[i] for i in self._special if tokens[i]}, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._special_by_text = {tokens[i]: i for i in sorted(self._special, reverse=True)}

    def encode(self, text: str, add_special: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of `text`. add_special adds BOS/EOS as the model asks;
        parse_special lets control-token spellings in `text` become those
        tokens (only for trusted text)."""
        if parse_special and self._hf_special is None:
            ids = []
            for piece in self.split_special(text):
                ids.extend([piece] if isinstance(piece, int) else self._encode(self._hf_literal, piece))
        else:
            ids = self._encode(self._hf_special if parse_special else self._hf_literal, text)
        return self._wrap(ids) if add_special else ids

    @staticmethod
    def _encode(hf: _HFTokenizer | SpmEngine, text: str) -> list[int]:
        if not text:
            return []
        if isinstance(hf, SpmEngine):
            return hf.encode(text)  # its merge loop runs without the GIL
        if len(text) > _GIL_FREE_CHARS:
            # encode_batch releases the GIL while Rust works (encode holds it: a 1 MB text would
            # stall the event loop for a second even from a worker thread)
            return hf.encode_batch([text], add_special_tokens=False)[0].ids
        return hf.encode(text, add_special_tokens=False).ids

    def _wrap(self, ids: list[int]) -> list[int]:
        if self.add_bos and not (ids and ids[0] == self.bos_id):
            ids = [self.bos_id, *ids]
        if self.add_eos and not (ids and ids[-1] == self.eos_id):
            ids = [*ids, self.eos_id]
        return ids

    def split_special(self, text: str) -> list[str | int]:
        """Trusted text cut at control-token spellings: strings and ids."""
        if self._special_re is None:
            return [text] if text else []
        out: list[str | int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > pos:
                out.append(text[pos : m.start()])
            out.append(self._special_by_text[m.group()])
            pos = m.end()
        if pos < len(text):
            out.append(text[pos:])
        return out

    def encode_chat(self, parts: Iterable[tuple[str, bool]], add_special: bool = False) -> list[int]:
        """Encode a rendered prompt given as (text, trusted) parts.

        Control tokens are recognised only inside trusted (template) parts.
        The text between two control tokens is encoded as one string, both
        template and user text together, so the ids equal those of encoding
        the whole prompt at once whenever the user text holds no specials
        (the BPE does not see artificial cuts at message boundaries).
        """
        ids: list[int] = []
        pending: list[str] = []

        def flush():
            if pending:
                ids.extend(self.encode("".join(pending)))
                pending.clear()

        for text, trusted in parts:
            for piece in self.split_special(text) if trusted else [text]:
                if isinstance(piece, int):
                    flush()
                    ids.append(piece)
                else:
                    pending.append(piece)
        flush()
        return self._wrap(ids) if add_special else ids

    # ------------------------------------------------------------------ decode

    def piece_bytes(self, i: int) -> bytes:
        """The bytes token i stands for (its text for specials)."""
        return self._piece_bytes[i]

    def pieces(self) -> Sequence[bytes]:
        """Every token's bytes, id order (a PackedBytes: one blob, searched as one by imp.text.dry_breakers)."""
        return self._piece_bytes

    def shown_pieces(self) -> tuple[bytes, np.ndarray]:
        """Every token's bytes as a client sees them, special tokens empty (the text banned phrases are
        matched on, imp.core.banned): (blob, offsets [n + 1] int64), item i = blob[offsets[i]:offsets[i + 1]]."""
        pb = self._piece_bytes
        offsets = np.asarray(pb.offsets, dtype=np.int64)
        if not self._special:
            return pb.blob, offsets
        keep = np.ones(len(offsets) - 1, dtype=bool)
        keep[np.fromiter(self._special, dtype=np.int64)] = False
        out = np.zeros_like(offsets)
        np.cumsum(np.diff(offsets) * keep, out=out[1:])
        return pb.join(np.flatnonzero(keep).tolist()), out

    def id_to_piece(self, i: int) -> str:
        """The vocabulary entry as the GGUF spells it."""
        return self._tokens[i]

    def vocabulary(self) -> Sequence[str]:
        """Every entry as the GGUF spells it, id order (a PackedStr for a GGUF: `in` and
        `index` search its blob)."""
        return self._tokens

    def longest_piece(self) -> int:
        """The most bytes one non-special token decodes to (at least 1)."""
        lens = np.diff(self._piece_bytes.offsets)
        if self._special:
            lens[np.fromiter(self._special, dtype=np.int64)] = 0
        return max(1, int(lens.max(initial=0)))

    def is_special(self, i: int) -> bool:
        return i in self._special

    def decode_bytes(self, ids: Sequence[int], skip_special: bool = True, at_start: bool = True) -> bytes:
        n, sp = self.vocab_size, self._special
        out = self._piece_bytes.join([i for i in ids if 0 <= i < n and not (skip_special and i in sp)])
        # SentencePiece with a prefix space: the leading "▁" the encoder added
        # is not part of the text (llama.cpp drops it too).
        if at_start and self.add_space_prefix and out.startswith(b" "):
            out = out[1:]
        return out

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        return self.decode_bytes(ids, skip_special).decode("utf-8", "replace")


class IncrementalDetokenizer:
    """Streams text for ids as they come, never splitting a character.

    `push(ids)` returns the newly complete text; `flush()` ends the stream: a
    trailing incomplete character (max_tokens or a timeout cut it) is dropped,
    never sent as U+FFFD. "".join of all outputs == tokenizer.decode(ids) with
    such a cut-off tail removed.
    `prompt_tail`: the prompt's last few ids. They tell whether the stream
    starts the text (SentencePiece prefix-space rule) and complete a
    character the prompt left half-written; their own text is not emitted.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_tail: Sequence[int] = (), skip_special: bool = True):
        self.tok = tokenizer
        self.skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._at_start = not prompt_tail
        if prompt_tail:
            self._dec.decode(tokenizer.decode_bytes(prompt_tail, skip_special, at_start=False))

    def push(self, ids: Sequence[int]) -> str:
        b = self.tok.decode_bytes(ids, self.skip_special, at_start=self._at_start)
        if b:  # until something is emitted, the stream still starts the text
            self._at_start = False
        return self._dec.decode(b)

    def flush(self) -> str:
        # the decoder holds back only an incomplete UTF-8 sequence at the end: drop it
        self._dec.reset()
        return ""


# --------------------------------------------------------------------------
# builders


def _byte_level(tokens, types, merges, regexes, ignore_merges):
    from tokenizers import Regex, Tokenizer as _HFTokenizer, models, pre_tokenizers

    b2u = bytes_to_unicode()
    u2b = {c: b for b, c in b2u.items()}
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    hf = _HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    piece_bytes = []
    for t, ty in zip(tokens, types.tolist()):
        if ty in (CONTROL, USER_DEFINED) or not all(c in u2b for c in t):
            piece_bytes.append(t.encode("utf-8"))  # raw text, as llama.cpp prints it
        else:
            piece_bytes.append(bytes(u2b[c] for c in t))
    return hf, PackedBytes.of(piece_bytes)


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _sentencepiece(tokens, types, scores, add_space_prefix, unk_id):
    # llama.cpp merges the pair whose concatenation is the best-scored token (imp/text/spm.py)
    ty_list = types.tolist()
    mergeable = {i for i, t in enumerate(tokens) if len(t) > 1 and ty_list[i] in (NORMAL, USER_DEFINED)}
    engine = SpmEngine(tokens, scores, add_space_prefix, unk_id, mergeable,
                       np.flatnonzero(types == USER_DEFINED).tolist())

    piece_bytes = []
    for t, ty in zip(tokens, ty_list):
        m = _BYTE_TOKEN.fullmatch(t) if ty == BYTE else None
        if m:
            piece_bytes.append(bytes([int(m.group(1), 16)]))
        elif ty in (CONTROL, USER_DEFINED, UNKNOWN, UNUSED):
            piece_bytes.append(t.encode("utf-8"))
        else:
            piece_bytes.append(t.replace("\u2581", " ").encode("utf-8"))
    return engine, PackedBytes.of(piece_bytes)
