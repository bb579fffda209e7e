"""Engine Deltas -> OpenAI text completions: one `text_completion`, or its SSE chunks.

echo prepends the prompt (and, with logprobs, the prompt tokens' logprobs);
prompt_logprobs come back per choice in vLLM's shape.
"""

from __future__ import annotations

from imp.http.dialects.openai.logprobs import CompletionLogprobs, merge, prompt_logprobs_json
from imp.http.pipeline.spec_usage import SpecTally
from imp.http.dialects.openai.wire import KEEPALIVE_COMMENT, error_event, fingerprint, sse_data, usage_json
from imp.http.pipeline.dialect import Job
from imp.http.pipeline.driver import finish_label
from imp.http.pipeline.reasoning import ThinkSplitter, prompt_opens_think
from imp.messages import Delta, FinishReason


class CompletionRenderer:
    def __init__(self, job: Job):
        req, n, tok = job.req, job.req.n, job.text.tokenizer
        self.req, self.tok, self.ids, self.prompt_text = req, tok, job.prompt.ids, job.prompt.text
        self.base = {"id": job.rid, "object": "text_completion", "created": job.created,
                     "model": job.card.name, "system_fingerprint": fingerprint(job.card)}
        start = len(self.prompt_text) if req.echo else 0
        self.lp = [CompletionLogprobs(tok, req.top_logprobs, 0 if req.echo and req.logprobs else start)
                   for _ in range(n)]
        # for end_thinking: follow the think state of choice 0's text
        self.think = ThinkSplitter(prompt_opens_think(self.prompt_text[-64:]))
        self.texts = [self.prompt_text if req.echo else ""] * n
        self.lps: list[list] = [[] for _ in range(n)]
        self.finish = ["stop"] * n
        self.completion = [0] * n
        self.spec = SpecTally()
        self.prompt_tokens, self.cached, self.plp = len(self.ids), 0, []

    @property
    def thinking(self) -> bool:
        return self.think.thinking

    def _count(self, d: Delta) -> None:
        if d.index == 0:
            self.think.push(d.text)
        self.completion[d.index] = d.completion_tokens
        self.prompt_tokens, self.cached = d.prompt_tokens or self.prompt_tokens, d.cached_tokens or self.cached
        self.spec.take(d)

    def _usage(self) -> dict:
        return usage_json(self.prompt_tokens, sum(self.completion), self.cached, self.spec.fields())

    # ------------------------------------------------------------------ one JSON body

    def take(self, d: Delta) -> None:
        self._count(d)
        self.texts[d.index] += d.text
        self.lps[d.index].extend(d.logprobs)
        self.plp = self.plp or list(d.prompt_logprobs)
        if d.finish != FinishReason.NONE:
            self.finish[d.index] = finish_label(d.finish)

    async def body(self) -> dict:
        req, choices = self.req, []
        for i in range(req.n):
            lp = None
            if req.logprobs:
                lp = self.lp[i].entries(self.lps[i]) if not req.echo else \
                    merge(self.lp[i].prompt(self.ids, self.plp), self.lp[i].entries(self.lps[i]))
            c = {"index": i, "text": self.texts[i], "logprobs": lp, "finish_reason": self.finish[i]}
            if req.prompt_logprobs >= 0:
                c["prompt_logprobs"] = prompt_logprobs_json(self.tok, self.ids, self.plp, req.prompt_logprobs)
            choices.append(c)
        return dict(self.base, choices=choices, usage=self._usage())

    # ------------------------------------------------------------------ server-sent events

    def _chunk(self, choices, usage=None) -> bytes:
        c = dict(self.base, choices=choices)
        if self.req.include_usage:
            c["usage"] = usage
        return sse_data(c)

    def start(self, first: Delta | None) -> bytes:
        if not self.req.echo:
            return b""
        return b"".join(self._chunk([{"index": i, "text": self.prompt_text, "logprobs": None, "finish_reason": None}])
                        for i in range(self.req.n))

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT

    def delta(self, d: Delta) -> bytes:
        self._count(d)
        out = b""
        if d.text or d.logprobs:
            lp = self.lp[d.index].entries(d.logprobs) if self.req.logprobs else None
            out += self._chunk([{"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": None}])
        if d.finish != FinishReason.NONE:
            out += self._chunk([{"index": d.index, "text": "", "logprobs": None,
                                 "finish_reason": finish_label(d.finish)}])
        return out

    async def end(self) -> bytes:
        usage = self._chunk([], self._usage()) if self.req.include_usage else b""
        return usage + b"data: [DONE]\n\n"

    def error(self, message: str, code: str) -> bytes:
        return error_event(message, code)
