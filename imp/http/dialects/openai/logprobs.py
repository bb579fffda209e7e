"""Logprobs in the wire shapes clients parse: OpenAI chat, OpenAI legacy
completions, vLLM prompt_logprobs.

Values come floored from the sampler (never -inf); `_num` guards once more
so that no NaN or infinity can reach JSON, which has no spelling for them.
"""

from __future__ import annotations

import math

FLOOR = -9999.0


def _num(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


def token_text(tok, tid: int) -> str:
    # specials spelled out: a logprob entry for <|im_end|> must say which token it was
    return tok.decode([tid], skip_special=False)


def _chat_entry(tok, tid: int, lp: float) -> dict:
    s = token_text(tok, tid)
    return {"token": s, "logprob": _num(lp), "bytes": list(tok.piece_bytes(tid))}


def chat_content(tok, items, top_n: int) -> list[dict]:
    """choices[i].logprobs.content: one entry per sampled token, top_n alternatives each."""
    out = []
    for st in items:
        e = _chat_entry(tok, st.token_id, st.logprob)
        e["top_logprobs"] = [_chat_entry(tok, t, lp) for t, lp in st.top[:top_n]]
        if st.lens:  # the logit lens: one entry per layer, first layer first
            e["logit_lens"] = [{"layer": i, "rank": x.rank, "logprob": _num(x.logprob), "entropy": _num(x.entropy),
                                "top": [{"token": token_text(tok, t), "logprob": _num(lp)} for t, lp in x.top]}
                               for i, x in enumerate(st.lens)]
        out.append(e)
    return out


class CompletionLogprobs:
    """choices[i].logprobs of /v1/completions, built up token by token.

    text_offset indexes the choice's text (the echoed prompt included), as
    vLLM does; streaming chunks carry the entries of their own tokens with
    offsets that keep counting across chunks.
    """

    def __init__(self, tok, top_n: int, offset: int = 0):
        self.tok, self.top_n, self.offset = tok, top_n, offset

    def _top(self, pairs) -> dict:
        d: dict[str, float] = {}
        for t, lp in pairs[: self.top_n]:
            d.setdefault(token_text(self.tok, t), _num(lp))  # two ids can spell the same text
        return d

    def entries(self, items) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for st in items:
            s = token_text(self.tok, st.token_id)
            out["tokens"].append(s)
            out["token_logprobs"].append(_num(st.logprob))
            out["top_logprobs"].append(self._top(st.top) if self.top_n else None)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out

    def prompt(self, prompt_ids: list[int], entries) -> dict:
        """The echoed prompt's part: its first token has no logprob (null)."""
        by_pos = {e.position: e for e in entries}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for pos, tid in enumerate(prompt_ids):
            s = token_text(self.tok, tid)
            e = by_pos.get(pos)
            out["tokens"].append(s)
            out["token_logprobs"].append(_num(e.logprob) if e else None)
            if e is None:
                out["top_logprobs"].append(None)
            else:
                top = self._top(e.top)
                top.setdefault(s, _num(e.logprob))  # the prompt token is always listed
                out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out


def merge(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def prompt_logprobs_json(tok, prompt_ids: list[int], entries, top_n: int) -> list:
    """vLLM's choices[0].prompt_logprobs: entry 0 null, then per prompt token a
    dict {"<id>": {logprob, rank, decoded_token}} holding it and the top N."""
    by_pos = {e.position: e for e in entries}
    out: list = [None]
    for pos in range(1, len(prompt_ids)):
        e = by_pos.get(pos)
        if e is None:  # cannot happen for a finished request; keep the length right
            out.append(None)
            continue
        d = {}
        for rank, (t, lp) in enumerate(e.top[:top_n], 1):
            d[str(t)] = {"logprob": _num(lp), "rank": rank, "decoded_token": token_text(tok, t)}
        d[str(e.token_id)] = {"logprob": _num(e.logprob), "rank": e.rank,
                              "decoded_token": token_text(tok, e.token_id)}
        out.append(d)
    return out
