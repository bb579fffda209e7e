"""Fill-in-the-middle prompts, in llama.cpp's layout (`format_infill`).

The model's FIM tokens come from the GGUF (`tokenizer.ggml.fim_pre_token_id`
and friends, or the older `prefix/suffix/middle_token_id`), else from the
spellings FIM-trained vocabularies use. A model without all three of
prefix/suffix/middle cannot do FIM: the caller answers 400 naming that.

Layout (prefix-suffix-middle):

    [extra context] [BOS] <PRE> prefix prompt <SUF> suffix <MID>

Extra context (llama.cpp's input_extra, a list of {filename, text}) goes
first: with <REP>/<SEP> tokens as a repository of files, else as plain text
chunks separated by a snippet marker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from imp.formats.packed import PackedStr

# (pre, suf, mid) spellings, as llama.cpp's vocab loader looks for them
_SPELLINGS = [
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SmolLM-code
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    ("<PRE>", "<SUF>", "<MID>"),  # CodeLlama
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
    ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>"),
]
_REP = ("<|repo_name|>", "<repo_name>", "<reponame>")
_SEP = ("<|file_sep|>", "<file_sep>")
_SNIPPET = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class FimTokens:
    pre: int
    suf: int
    mid: int
    rep: int | None = None
    sep: int | None = None


def fim_tokens(meta: dict, tokens: Sequence[str]) -> FimTokens | None:
    n = len(tokens)

    def key(*names):
        for name in names:
            v = meta.get(f"tokenizer.ggml.{name}")
            if isinstance(v, int) and 0 <= v < n:
                return v
        return None

    pre, suf, mid = key("fim_pre_token_id", "prefix_token_id"), key("fim_suf_token_id", "suffix_token_id"), \
        key("fim_mid_token_id", "middle_token_id")
    find = _finder(tokens)
    if None in (pre, suf, mid):
        for spelling in _SPELLINGS:
            ids = [find(t) for t in spelling]
            if None not in ids:
                pre, suf, mid = ids
                break
        else:
            return None
    rep, sep = key("fim_rep_token_id"), key("fim_sep_token_id")
    if rep is None:
        rep = next((i for i in map(find, _REP) if i is not None), None)
    if sep is None:
        sep = next((i for i in map(find, _SEP) if i is not None), None)
    return FimTokens(pre, suf, mid, rep, sep)


def _finder(tokens: Sequence[str]) -> Callable[[str], int | None]:
    """text -> its first id, or None: a search of a PackedStr's blob, a dict over a list (built
    once, only if asked)."""
    if isinstance(tokens, PackedStr):
        def search(t: str) -> int | None:
            i = tokens.index_of(t.encode("utf-8"))
            return i if i >= 0 else None

        return search
    index: dict[str, int] = {}

    def find(t: str) -> int | None:
        if not index:
            index.update((s, i) for i, s in reversed(list(enumerate(tokens))))  # the first id wins
        return index.get(t)

    return find


def build_infill(tok, fim: FimTokens, prefix: str, suffix: str, prompt: str = "",
                 extra: list[dict] | None = None, prompt_ids: list[int] | None = None) -> list[int]:
    """Token ids of a FIM prompt; the model then writes the middle."""
    enc = tok.encode  # user text: control-token spellings stay text
    head: list[int] = []
    if extra:
        if fim.rep is not None:
            head += [fim.rep, *enc("myproject\n")]
        for chunk in extra:
            if fim.sep is not None:
                head += [fim.sep, *enc(chunk.get("filename", "tmp") + "\n")]
            else:
                head += enc(_SNIPPET)
            head += enc(chunk.get("text", ""))
        if fim.sep is not None:
            head += [fim.sep, *enc("filename\n")]
    body = [fim.pre, *enc(prefix), *(prompt_ids if prompt_ids is not None else enc(prompt)), fim.suf, *enc(suffix), fim.mid]
    if tok.add_bos and tok.bos_id is not None:
        body = [tok.bos_id, *body]
    return head + body
