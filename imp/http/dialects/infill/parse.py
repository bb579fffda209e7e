"""llama.cpp's /infill body (n_predict, input_prefix/suffix/extra) -> the typed request.

Field names follow llama.cpp's server so its clients (editor plugins) work unchanged.
"""

from __future__ import annotations

from imp.http.dialects.openai import fields as openai_fields
from imp.http.errors import bad
from imp.http.pipeline import fields as B
from imp.http.pipeline import structured
from imp.http.pipeline.request import GenerateRequest, Infill


def _text_field(body: dict, name: str) -> str:
    return B.string(body, name, "") or ""


def _extra(body: dict) -> tuple[tuple[str, str], ...]:
    v = body.get("input_extra")
    if v is None:
        return ()
    if not isinstance(v, list) or len(v) > 64:
        raise bad("'input_extra' must be an array of at most 64 {filename, text} objects", "input_extra")
    out = []
    for i, c in enumerate(v):
        if not isinstance(c, dict) or not isinstance(c.get("text", ""), str) \
                or not isinstance(c.get("filename", "tmp"), str):
            raise bad(f"'input_extra[{i}]' must be an object with string 'text' and 'filename'", "input_extra")
        out.append((c.get("filename", "tmp"), c.get("text", "")))
    return tuple(out)


# every top-level field /infill takes: llama.cpp's names, the OpenAI family's sampling and limits
# (logprobs and prompt_logprobs are refused below, with where to get them)
TAKEN = frozenset({"model", "input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "return_tokens",
                   "logit_bias", "logprobs", "prompt_logprobs", *openai_fields.COMMON, *openai_fields.SAMPLING,
                   *structured.FIELDS["openai"], *B.TEMPLATE_FIELDS})


def parse_infill(body: dict, vocab_size: int) -> GenerateRequest:
    """llama.cpp's /infill body (n_predict, input_prefix/suffix/extra) -> the typed request."""
    B.refuse_request_template(body)
    infill = Infill(prefix=_text_field(body, "input_prefix"), suffix=_text_field(body, "input_suffix"),
                    prompt=_text_field(body, "prompt"), extra=_extra(body))
    n_predict = B.num(body, "n_predict", -1, integer=True)
    if n_predict == 0:
        raise bad("'n_predict' must be -1 (no limit) or >= 1", "n_predict")
    c = openai_fields.common(body)
    if c.n > 1:
        raise bad("/infill generates one completion: 'n' must be 1", "n")
    if B.num(body, "logprobs", 0, 20, integer=True) is not None or body.get("prompt_logprobs") is not None:
        raise bad("/infill does not return logprobs; use /v1/completions with 'suffix'", "logprobs")
    mt = c.max_tokens if c.max_tokens is not None else (n_predict if n_predict not in (None, -1) else None)
    constraint, field = structured.parse(body, dialect="openai")  # llama.cpp's grammar / json_schema
    return GenerateRequest(endpoint="infill", model=B.string(body, "model"), infill=infill, prompt_param="prompt",
                           sampling=openai_fields.sampling(body, vocab_size), max_tokens=mt, stop=c.stop,
                           stream=c.stream, priority=c.priority, cache_prompt=c.cache_prompt,
                           session_id=c.session_id, lora=c.lora, constraint=constraint, constraint_field=field)
