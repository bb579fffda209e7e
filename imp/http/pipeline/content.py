"""Message content as text: a string, or an array of typed parts, read the same way by every dialect.

Each dialect names its own part types (`Parts`): which carry text, which are media a
text-only model refuses (a 400 naming the part), how the texts join. Anything else
is a 400 naming the part and its type.
"""

from __future__ import annotations

from dataclasses import dataclass

from imp.http.errors import bad


@dataclass(frozen=True)
class Parts:
    text: frozenset[str]  # part types whose "text" field is the content
    media: frozenset[str]  # images, audio, files: refused by a text-only model
    joiner: str = ""  # between the parts' texts
    refusal: bool = False  # a "refusal" part's text counts (Responses' assistant output)


def text_of(content, where: str, parts: Parts) -> str:
    """A string, or an array of parts -> the text; None is ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{where}' must be a string or an array of content parts", where)
    out = []
    for j, p in enumerate(content):
        pw = f"{where}[{j}]"
        t = p.get("type") if isinstance(p, dict) else None
        if not isinstance(t, str):
            raise bad(f"'{pw}' must be an object with a 'type'", pw)
        if t in parts.text:
            if not isinstance(p.get("text"), str):
                raise bad(f"'{pw}.text' must be a string", pw)
            out.append(p["text"])
        elif t in parts.media:
            raise bad(f"'{pw}': this model is text-only and cannot take '{t}' content", pw, "unsupported_content_type")
        elif t == "refusal" and parts.refusal:
            out.append(p.get("refusal") or "")
        else:
            raise bad(f"'{pw}': unknown content part type '{t}' (expected {', '.join(sorted(parts.text))})", pw)
    return parts.joiner.join(out)
