"""The routes table: one line per endpoint, one module per dialect."""

from imp.http import common, openai_chat

ROUTES = [
    ("POST", "/v1/chat/completions", openai_chat.chat_completions),
    ("GET", "/v1/models", common.models),
    ("GET", "/v1/models/{model:.+}", common.model),
    ("GET", "/health", common.health),
    ("GET", "/ready", common.ready),
    ("GET", "/metrics", common.metrics),
]
