"""Every request field has a fate: honoured, refused with a 400 that names it, or reported.

Each dialect lists every top-level field it takes (`Dialect.fields`: the ones it honours,
the ones that are without effect by their nature on a local server, and the ones it refuses
with a reason of its own). Before a body is parsed, the pipeline sorts the rest:

- a field imp's API reference defines that this route does not implement (the sampling
  table's DRY, mirostat, banned strings and regexes on Messages and Responses; classifier-free
  guidance and the logit lens anywhere but chat) is a 400 naming it and the routes that take
  it, or (`ELSEWHERE` lacking it) `not_implemented` — unless its value is the one that
  turns the feature off (`"mirostat": 0`, `"dry_multiplier": 0`, as llama.cpp's web UI sends them), which is exactly what this server does. The knobs that
  only tune such a feature (`dry_base`, `mirostat_tau`, ...) have no effect while it is off,
  as in llama.cpp;
- a field nobody defines is never dropped without a word: the answer carries
  `imp-ignored-fields`, the log says it once per field and client, a metric counts it
  (`imp_ignored_fields_total`), and under `--strict-fields` it is a 400 in the dialect's
  words, as the official APIs answer.
"""

from __future__ import annotations

import logging
import re

from imp.http.errors import ApiError

log = logging.getLogger("imp.http")

# imp's API reference defines these (its sampling table); the routes that implement one list it among their
# fields, the others refuse it (ELSEWHERE says where it is taken).
# name -> is this value the feature switched off (what this server does anyway)?
_OFF_ZERO = (lambda v: v is None or v is False or (isinstance(v, (int, float)) and v == 0))
NOT_YET: dict[str, object] = {
    "dry_multiplier": _OFF_ZERO,  # honoured by the OpenAI-family routes (chat, completions): listed there
    "mirostat": _OFF_ZERO,
    "banned_strings": (lambda v: v is None or v == []),
    "banned_regex": (lambda v: v is None or v == []),
    "cfg_scale": (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 1)),
    "logit_lens": _OFF_ZERO,
}
# they tune a NOT_YET feature and have no effect while it is off (llama.cpp does the same)
TUNING = frozenset({"dry_base", "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers",
                    "mirostat_tau", "mirostat_eta", "cfg_negative_prompt"})
_WHAT = {"dry_multiplier": "DRY sampling", "mirostat": "mirostat sampling", "banned_strings": "banned strings",
         "banned_regex": "banned regexes", "cfg_scale": "classifier-free guidance", "logit_lens": "the logit lens"}

# implemented on some routes (they list the field and honour it): where, for the others' 400
_OPENAI = "the OpenAI-family routes (/v1/chat/completions, /v1/completions)"
ELSEWHERE = {"dry_multiplier": _OPENAI, "mirostat": _OPENAI, "banned_strings": _OPENAI, "banned_regex": _OPENAI,
             "logit_lens": "/v1/chat/completions", "cfg_scale": "/v1/chat/completions"}

_SAFE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_said: set[tuple[str, str]] = set()  # (field, client) pairs logged already
_SAID_MAX = 4096


def label(name: str) -> str:
    """A field name as a metric label: client-chosen text, so bounded in shape."""
    return name if _SAFE.fullmatch(name) else "other"


def sort(body: dict, known: frozenset[str], *, strict: bool, unknown_message) -> tuple[str, ...]:
    """The body's fields nobody defines (to report), after refusing the reference's unimplemented
    ones; under strict, the first unknown field is a 400 (unknown_message(name) words it)."""
    ignored = []
    for name, value in body.items():
        if name in known or name in TUNING:
            continue
        off = NOT_YET.get(name)
        if off is not None:
            if not off(value):
                if name in ELSEWHERE:
                    raise ApiError(400, f"'{name}': {_WHAT[name]} is taken by {ELSEWHERE[name]}, not by this "
                                        f"route; leave it out (or send the value that turns it off)",
                                   param=name, code="unsupported_parameter")
                raise ApiError(400, f"'{name}': {_WHAT[name]} is in imp's API reference but not implemented "
                                    f"yet; leave it out (or send the value that turns it off)",
                               param=name, code="not_implemented")
            continue
        if strict:
            raise ApiError(400, unknown_message(name), param=name, code="unknown_parameter")
        ignored.append(name)
    return tuple(ignored)


def say_once(ignored: tuple[str, ...], endpoint: str, client: str) -> None:
    """One log line per field and client (bounded: a client inventing names cannot fill memory)."""
    for name in ignored:
        key = (label(name), client)
        if key in _said or len(_said) >= _SAID_MAX:
            continue
        _said.add(key)
        log.warning("%s: field %r is not one this server knows; ignored (reported in the imp-ignored-fields "
                    "header; --strict-fields refuses it) [client %s]", endpoint, name[:64], client)


def header(ignored: tuple[str, ...]) -> str:
    return ", ".join(label(n) for n in ignored[:32])
