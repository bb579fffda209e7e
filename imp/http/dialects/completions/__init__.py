"""POST /v1/completions — the OpenAI legacy text-completion dialect."""

from __future__ import annotations

from imp.http.dialects.completions.parse import TAKEN
from imp.http.dialects.completions.parse import parse as parse_body
from imp.http.dialects.completions.render import CompletionRenderer
from imp.http.pipeline.dialect import Base, ParseContext


class Completions(Base):
    endpoint = "completions"
    id_prefix = "cmpl-"
    fields = TAKEN
    render_cls = CompletionRenderer

    async def parse(self, body: dict, ctx: ParseContext):
        return parse_body(body, ctx.text.tokenizer.vocab_size), None


DIALECT = Completions()
