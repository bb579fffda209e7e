"""POST /v1/responses and the stored responses — the OpenAI Responses dialect (Codex, the Agents SDK).

`store: true` (the default) persists the response and its input items in the
store actor; `previous_response_id` continues a stored chain (the earlier turns
are rebuilt from the store, so their prompt prefix hits the prefix cache).
"""

from __future__ import annotations

from imp.http.dialects.responses import store
from imp.http.dialects.responses.parse import TAKEN, history
from imp.http.dialects.responses.parse import parse as parse_body
from imp.http.dialects.responses.render import ResponsesRenderer
from imp.http.errors import bad
from imp.http.pipeline import fields as B
from imp.http.pipeline.dialect import Base, ParseContext


class Responses(Base):
    endpoint = "responses"
    id_prefix = "resp_"
    fields = TAKEN
    render_cls = ResponsesRenderer

    async def parse(self, body: dict, ctx: ParseContext):
        st = ctx.port.store
        if B.boolean(body, "store", True) and st is None:
            raise bad("'store': true needs the responses store, and this server runs without one "
                      "(--responses-store off): send store: false", "store")
        past = await history(st, B.string(body, "previous_response_id"))
        return parse_body(body, ctx.text.tokenizer.vocab_size, ctx.text.template.source, past)


DIALECT = Responses()
retrieve, delete, input_items = store.retrieve, store.delete, store.input_items
