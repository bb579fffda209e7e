"""Engine Deltas -> llama.cpp's /infill answer: one JSON object, or `data:` chunks then the final one."""

from __future__ import annotations

from imp.http.dialects.openai.wire import error_event, sse_data
from imp.http.pipeline.dialect import Job
from imp.http.pipeline.driver import finish_label
from imp.http.pipeline.request import GenerateRequest
from imp.messages import Delta, FinishReason

_STOP_TYPE = {"stop": "eos", "length": "limit"}


def _settings(req: GenerateRequest, p) -> dict:
    return {"n_predict": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
            "min_p": p.min_p, "typical_p": p.typical_p, "repeat_penalty": p.repetition_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "seed": p.seed, "ignore_eos": p.ignore_eos, "stop": list(req.stop)}


class InfillRenderer:
    def __init__(self, job: Job):
        self.job, self.req = job, job.req
        self.return_tokens = job.extra
        self.head = {"index": 0, "id_slot": 0, "model": job.card.name}
        self.text, self.ids, self.finish, self.done = "", [], "stop", {}

    thinking = False

    def take(self, d: Delta) -> None:
        self.text += d.text
        self.ids += d.token_ids
        if d.finish != FinishReason.NONE:
            self.finish = finish_label(d.finish)
            self.done = {"tokens_predicted": d.completion_tokens, "tokens_evaluated": d.prompt_tokens,
                         "tokens_cached": d.cached_tokens}

    async def body(self) -> dict:
        job = self.job
        return dict(self.head, content="" if self.req.stream else self.text,
                    tokens=self.ids if self.return_tokens else [], stop=True,
                    stop_type=_STOP_TYPE.get(self.finish, "eos"), stopping_word="", truncated=False,
                    generation_settings=_settings(self.req, job.params),
                    prompt=job.text.tokenizer.decode(job.prompt.ids, skip_special=False), id=job.rid, **self.done)

    def start(self, first: Delta | None) -> bytes:
        return b""

    def keepalive(self) -> bytes:
        return b""

    def delta(self, d: Delta) -> bytes:
        self.take(d)
        if not d.text:
            return b""
        return sse_data(dict(self.head, content=d.text, tokens=list(d.token_ids) if self.return_tokens else [],
                             stop=False))

    async def end(self) -> bytes:
        return sse_data(await self.body())

    def error(self, message: str, code: str) -> bytes:
        return error_event(message, code)
