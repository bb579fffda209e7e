"""POST /infill — llama.cpp's fill-in-the-middle route."""

from __future__ import annotations

from imp.http.dialects.infill.parse import TAKEN, parse_infill
from imp.http.dialects.infill.render import InfillRenderer
from imp.http.errors import bad
from imp.http.pipeline import fields as B
from imp.http.pipeline.dialect import Base, ParseContext


class Infill(Base):
    endpoint = "infill"
    id_prefix = "infill-"
    keepalive = False  # llama.cpp's clients read every data: line as a chunk
    fields = TAKEN
    render_cls = InfillRenderer

    async def parse(self, body: dict, ctx: ParseContext):
        if ctx.text.fim is None:  # before anything else: no field can make this model fill in the middle
            raise bad("this model has no fill-in-the-middle tokens (no tokenizer.ggml.fim_pre/suf/mid_token_id, "
                      "no <fim_prefix>-style tokens)", None, "fim_not_supported")
        return parse_infill(body, ctx.text.tokenizer.vocab_size), B.boolean(body, "return_tokens")


DIALECT = Infill()
