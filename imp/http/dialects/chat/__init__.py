"""POST /v1/chat/completions — the OpenAI chat dialect (also what POST /v1/estimate parses)."""

from __future__ import annotations

from imp.http.dialects.chat.parse import TAKEN
from imp.http.dialects.chat.parse import parse as parse_body
from imp.http.dialects.chat.render import ChatRenderer
from imp.http.pipeline.dialect import Base, ParseContext


class Chat(Base):
    endpoint = "chat_completions"
    id_prefix = "chatcmpl-"
    dry_run = True  # "dry_run": true answers POST /v1/estimate's figures
    fields = TAKEN
    render_cls = ChatRenderer

    async def parse(self, body: dict, ctx: ParseContext):
        return parse_body(body, ctx.text.tokenizer.vocab_size, ctx.text.template.source), None


DIALECT = Chat()
