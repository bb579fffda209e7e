"""The OpenAI completions body -> the typed request.

prompt: a string, a token-id list, or a one-element list of either (a batch
is a 400, like the reference says). suffix turns the request into
fill-in-the-middle with the model's FIM tokens. echo prepends the prompt;
with logprobs it carries the prompt tokens' raw logprobs too, as does
prompt_logprobs (vLLM shape); neither can stream, both need every prompt row
forwarded, which the scheduler arranges (SamplingParams.prompt_logprobs).
"""

from __future__ import annotations

from imp.http.dialects.openai import fields as openai_fields
from imp.http.errors import bad
from imp.http.pipeline import fields as B
from imp.http.pipeline import structured
from imp.http.pipeline.request import GenerateRequest, Infill


def _is_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def prompt_field(raw) -> tuple[tuple[int, ...] | None, str | None]:
    """The request's prompt as (token ids, None) or (None, text); 400 on anything else."""
    if raw is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(raw, list):
        if _is_ids(raw):
            return tuple(raw), None
        if len(raw) == 1 and (isinstance(raw[0], str) or _is_ids(raw[0])):
            return prompt_field(raw[0])
        if len(raw) > 1 and (all(isinstance(p, str) for p in raw) or all(_is_ids(p) for p in raw)):
            raise bad("a batch of prompts is not supported: send one prompt per request", "prompt",
                      "batch_not_supported")
        raise bad("'prompt' must be a string, a list of token ids, or a one-element list of either", "prompt")
    if not isinstance(raw, str):
        raise bad("'prompt' must be a string, a list of token ids, or a one-element list of either", "prompt")
    return None, raw


# the scalar fields, read in one pass (completions' logprobs is a count, not chat's boolean)
FIELDS = {"suffix": B.Str(), "echo": B.Bool(), **openai_fields.COMMON, **openai_fields.SAMPLING,
          "logprobs": B.Num(0, 20, integer=True), "prompt_logprobs": B.Num(0, 20, integer=True)}


# every top-level field the completions route takes (`user` identifies the caller: no effect here)
TAKEN = frozenset({"model", "prompt", "logit_bias", "user", *FIELDS, *structured.FIELDS["openai"],
                   *B.TEMPLATE_FIELDS})


def parse(body: dict, vocab_size: int) -> GenerateRequest:
    model = B.model_name(body)
    B.refuse_request_template(body)
    ids, text = prompt_field(body.get("prompt"))
    f = B.read(body, FIELDS)
    suffix, echo = f["suffix"], f["echo"]
    infill = None
    if suffix:  # "" is no suffix, as in OpenAI's API
        if echo:
            raise bad("'echo' cannot be combined with 'suffix'", "echo")
        infill = Infill(prompt=text or "", prompt_ids=ids, suffix=suffix)
    c = openai_fields.common_of(f)
    sampling = openai_fields.sampling_of(f, B.logit_bias(body, vocab_size))
    plp = openai_fields.prompt_logprobs(f["prompt_logprobs"], allowed=True, stream=c.stream)
    constraint, field = structured.parse(body, dialect="openai")
    lp = f["logprobs"]
    if echo and lp is not None and c.stream:
        raise bad("'echo' with 'logprobs' cannot be used with 'stream': true", "echo")
    return GenerateRequest(
        endpoint="completions", model=model, prompt_text=text if infill is None else None,
        prompt_ids=ids if infill is None else None, infill=infill, prompt_param="prompt", sampling=sampling,
        max_tokens=c.max_tokens, n=c.n, stop=c.stop, stream=c.stream, include_usage=c.include_usage,
        logprobs=lp is not None, top_logprobs=lp or 0, prompt_logprobs=plp, echo=echo, priority=c.priority,
        cache_prompt=c.cache_prompt, session_id=c.session_id, lora=c.lora, constraint=constraint, constraint_field=field,
    )
