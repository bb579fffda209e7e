"""The text side of a loaded model: tokenizer, chat template, sampling presets, FIM tokens.

Everything HTTP needs to turn a request into token ids and token ids back
into text, and nothing of the weights: built once at boot from the model's
metadata, so an API server can hold it without holding the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from imp.text.chat_template import ChatTemplate
from imp.text.fim import FimTokens, fim_tokens


@dataclass(frozen=True)
class SamplingDefaults:
    """The model's sampling presets (GGUF general.sampling.*, else imp's arch preset)."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0  # 0 = 50 (the reference's rule)
    min_p: float = 0.0
    repetition_penalty: float = 1.05

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> "SamplingDefaults":
        d = cls()
        kw = {}
        for key, name in (("general.sampling.temp", "temperature"), ("general.sampling.top_p", "top_p"),
                          ("general.sampling.top_k", "top_k"), ("general.sampling.min_p", "min_p")):
            v = meta.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                kw[name] = type(getattr(d, name))(v)
        return cls(**kw) if kw else d


@dataclass(frozen=True)
class TextModel:
    tokenizer: Any  # imp.text.tokenizer.Tokenizer or HFTokenizer: encode / decode / piece_bytes / eos_ids
    template: ChatTemplate
    defaults: SamplingDefaults
    fim: FimTokens | None  # None: the model cannot fill in the middle
    think_end: tuple[int, ...]  # the model's spelling of "</think>\n\n", forced by end_thinking
    max_token_bytes: int = 64  # the longest token's bytes: a text of N bytes is >= N / this tokens

    @classmethod
    def build(cls, tokenizer, template: ChatTemplate, metadata: dict[str, Any]) -> "TextModel":
        return cls(
            tokenizer=tokenizer,
            template=template,
            defaults=SamplingDefaults.from_metadata(metadata),
            fim=fim_tokens(metadata, tokenizer.vocabulary()),
            # "\n\n" after the tag is how chat templates lay out the answer
            think_end=tuple(tokenizer.encode("</think>\n\n", parse_special=True)),
            max_token_bytes=tokenizer.longest_piece(),
        )

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.tokenizer.eos_ids))
