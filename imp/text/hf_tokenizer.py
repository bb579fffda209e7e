"""Tokenizer of an HF model directory (tokenizer.json), with the interface of
the GGUF `Tokenizer` (encode / encode_chat / decode / decode_bytes / eos_ids /
bos_id / add_bos / is_special / id_to_piece / piece_bytes), so the engine,
the detokenizer actor and `IncrementalDetokenizer` use it unchanged.

It subclasses `Tokenizer` and fills the same attributes from tokenizer.json,
tokenizer_config.json and generation_config.json; every method is
inherited. As there, decoding does not go through `tokenizers`: each id maps
to its bytes once, at load (byte-level BPE: GPT-2's byte alphabet reversed;
SentencePiece-style: U+2581 -> space and `<0xNN>` -> that byte), so streamed
text never shows U+FFFD for a character split across tokens.

BOS/EOS are added by `_wrap` (as for a GGUF), never by tokenizer.json's
post-processor: `encode` always asks `tokenizers` for add_special_tokens=False.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from imp.formats.packed import PackedBytes
from imp.text.tokenizer import CONTROL, EOG_TEXTS, NORMAL, USER_DEFINED, Tokenizer, bytes_to_unicode

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _token_text(v) -> str | None:
    """tokenizer_config's bos_token/eos_token: a string or an AddedToken dict."""
    return v.get("content") if isinstance(v, dict) else v


def _decoder_kinds(spec: dict | None) -> set[str]:
    """Types of the decoder and of its children (a Sequence nests them)."""
    if not spec:
        return set()
    kinds = {spec.get("type")}
    for d in spec.get("decoders") or []:
        kinds |= _decoder_kinds(d)
    return kinds


def _strips_leading_space(spec: dict | None) -> bool:
    """True when decoding drops the space the encoder put before the text
    (Llama-2 style: Strip(start=1) or Metaspace with a prepend scheme)."""
    if not spec:
        return False
    if spec.get("type") == "Strip" and spec.get("start", 0) > 0:
        return True
    if spec.get("type") == "Metaspace" and spec.get("prepend_scheme", "always") != "never":
        return spec.get("add_prefix_space", True) is not False
    return any(_strips_leading_space(d) for d in spec.get("decoders") or [])


class HFTokenizer(Tokenizer):
    def __init__(self, hf: _HFTokenizer, config: dict | None = None, generation_config: dict | None = None):
        # Tokenizer.__init__ parses GGUF metadata; here the same fields come from tokenizer.json.
        config = config or {}
        spec = json.loads(hf.to_str())
        vocab = hf.get_vocab(with_added_tokens=True)  # text -> id
        n = max(vocab.values()) + 1
        tokens = [""] * n
        for text, i in vocab.items():
            tokens[i] = text
        added = hf.get_added_tokens_decoder()  # id -> AddedToken
        self.kind = "hf"
        self.vocab_size = n
        self._tokens = tokens
        self._special = frozenset(i for i, a in added.items() if a.special)
        self._types = [CONTROL if i in self._special else USER_DEFINED if i in added else NORMAL for i in range(n)]

        kinds = _decoder_kinds(spec.get("decoder"))
        byte_level = "ByteLevel" in kinds
        u2b = {c: b for b, c in bytes_to_unicode().items()}
        pieces = []
        for i, t in enumerate(tokens):
            if i in added:
                pieces.append(t.encode("utf-8"))
            elif byte_level:
                pieces.append(bytes(u2b[c] for c in t) if all(c in u2b for c in t) else t.encode("utf-8"))
            elif (m := _BYTE_TOKEN.fullmatch(t)) and "ByteFallback" in kinds:
                pieces.append(bytes([int(m[1], 16)]))
            else:
                pieces.append(t.replace("\u2581", " ").encode("utf-8"))
        self._piece_bytes = PackedBytes.of(pieces)
        self.add_space_prefix = _strips_leading_space(spec.get("decoder"))

        def tid(text):
            return vocab.get(text) if text else None

        self.bos_id = tid(_token_text(config.get("bos_token")))
        self.eos_id = tid(_token_text(config.get("eos_token")))
        if self.bos_id is None or self.eos_id is None:  # older dirs: only the post-processor knows
            gc = generation_config or {}
            if self.bos_id is None and isinstance(gc.get("bos_token_id"), int):
                self.bos_id = gc["bos_token_id"]
            if self.eos_id is None and gc.get("eos_token_id") is not None:
                e = gc["eos_token_id"]
                self.eos_id = e[0] if isinstance(e, list) else e
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:  # does tokenizer.json's post-processor put BOS first?
            with_sp = hf.encode("a", add_special_tokens=True).ids
            add_bos = bool(with_sp) and with_sp[0] == self.bos_id and with_sp != hf.encode("a", add_special_tokens=False).ids
        self.add_bos = add_bos and self.bos_id is not None
        self.add_eos = bool(config.get("add_eos_token", False)) and self.eos_id is not None

        self._set_engines(hf, tokens)

        eog = {i for i in (self.eos_id,) if i is not None}
        gen_eos = (generation_config or {}).get("eos_token_id")
        eog |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else [])
        eog |= {self._special_by_text[t] for t in EOG_TEXTS if t in self._special_by_text}
        self.eos_ids = frozenset(i for i in eog if 0 <= i < n)

    @classmethod
    def from_dir(cls, path) -> "HFTokenizer":
        d = Path(path)

        def load(name):
            f = d / name
            return json.loads(f.read_text()) if f.is_file() else None

        return cls(_HFTokenizer.from_file(str(d / "tokenizer.json")), load("tokenizer_config.json"),
                   load("generation_config.json"))

    def token_text(self, key: str) -> str:
        """"bos"/"eos" -> that token's text ("" if none), for the chat template."""
        i = self.bos_id if key == "bos" else self.eos_id
        return self._tokens[i] if i is not None else ""
