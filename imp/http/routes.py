"""The routes table: one line per endpoint, one module per dialect."""

from imp.http import (anthropic, capacity, control, embeddings, llama_cpp, lora, openai_chat, openai_completions,
                      probes, responses, score)
from imp.http import ui

ROUTES = [
    ("POST", "/v1/chat/completions", openai_chat.chat_completions),
    ("POST", "/v1/completions", openai_completions.completions),
    ("POST", "/infill", llama_cpp.infill),
    ("POST", "/v1/embeddings", embeddings.embeddings),
    ("POST", "/v1/rerank", embeddings.rerank),
    ("POST", "/rerank", embeddings.rerank),
    ("POST", "/v1/score", score.score),
    ("POST", "/tokenize", llama_cpp.tokenize),
    ("POST", "/detokenize", llama_cpp.detokenize),
    ("GET", "/props", llama_cpp.props),
    ("GET", "/info", probes.info),
    ("POST", "/v1/requests/{id}/end_thinking", control.end_thinking),
    ("POST", "/v1/sessions/{id}/close", control.close_session),
    ("GET", "/v1/models", probes.models),
    ("GET", "/v1/models/{model:.+}", probes.model),
    ("GET", "/health", probes.health),
    ("GET", "/ready", probes.ready),
    ("GET", "/metrics", probes.metrics),
    # capacity, live metrics, admin suspend/resume
    ("GET", "/v1/capacity/plan", capacity.capacity_plan),
    ("POST", "/v1/estimate", capacity.estimate_route),
    ("GET", "/v1/metrics", capacity.metrics_json),
    ("POST", "/admin/suspend", probes.suspend),
    ("POST", "/admin/resume", probes.resume),
    ("POST", "/admin/lora/load", lora.load),
    ("POST", "/admin/lora/unload", lora.unload),
    ("GET", "/admin/lora", lora.listing),
    # Anthropic Messages dialect
    ("POST", "/v1/messages", anthropic.messages),
    ("POST", "/v1/messages/count_tokens", anthropic.count_tokens),
    # OpenAI Responses dialect and its store
    ("POST", "/v1/responses", responses.create),
    ("GET", "/v1/responses/{id}", responses.retrieve),
    ("DELETE", "/v1/responses/{id}", responses.delete),
    ("GET", "/v1/responses/{id}/input_items", responses.input_items),
    # the built-in chat UI (GET /, static files under /ui/)
    *ui.ROUTES,
]
