"""The routes table: one line per endpoint.

A generation dialect is one line: `handler(<dialect>.DIALECT)` runs the shared
pipeline (`imp.http.pipeline.run`) with that dialect's parser and renderer.
"""

from imp.http.dialects import anthropic, chat, completions, infill, responses
from imp.http.endpoints import capacity, codex, control, embeddings, llama_cpp, lora, models, probes, score, ui
from imp.http.pipeline.run import handler

ROUTES = [
    # generation dialects
    ("POST", "/v1/chat/completions", handler(chat.DIALECT)),
    ("POST", "/v1/completions", handler(completions.DIALECT)),
    ("POST", "/infill", handler(infill.DIALECT)),
    ("POST", "/v1/messages", handler(anthropic.DIALECT)),
    ("POST", "/v1/responses", handler(responses.DIALECT)),
    # and what goes with them
    ("POST", "/v1/messages/count_tokens", anthropic.count_tokens),
    ("GET", "/v1/responses/{id}", responses.retrieve),
    ("DELETE", "/v1/responses/{id}", responses.delete),
    ("GET", "/v1/responses/{id}/input_items", responses.input_items),
    ("POST", "/v1/requests/{id}/end_thinking", control.end_thinking),
    ("POST", "/v1/sessions/{id}/close", control.close_session),
    # encoders and scoring
    ("POST", "/v1/embeddings", embeddings.embeddings),
    ("POST", "/v1/rerank", embeddings.rerank),
    ("POST", "/rerank", embeddings.rerank),
    ("POST", "/v1/score", score.score),
    # llama.cpp's tokenizer and server routes
    ("POST", "/tokenize", llama_cpp.tokenize),
    ("POST", "/detokenize", llama_cpp.detokenize),
    ("GET", "/props", llama_cpp.props),
    # probes, models, capacity and live metrics
    ("GET", "/info", probes.info),
    ("GET", "/v1/models", probes.models),
    ("GET", "/v1/models/{model:.+}", probes.model),
    ("GET", "/codex/models", codex.catalog),  # Codex's model_catalog_url: its apply_patch tool for our models
    ("GET", "/health", probes.health),
    ("GET", "/ready", probes.ready),
    ("GET", "/metrics", probes.metrics),
    ("GET", "/v1/capacity/plan", capacity.capacity_plan),
    ("POST", "/v1/estimate", capacity.estimate_route),
    ("GET", "/v1/metrics", capacity.metrics_json),
    # admin
    ("POST", "/admin/suspend", probes.suspend),
    ("POST", "/admin/resume", probes.resume),
    ("POST", "/admin/lora/load", lora.load),
    ("POST", "/admin/lora/unload", lora.unload),
    ("GET", "/admin/lora", lora.listing),
    ("POST", "/admin/models/load", models.load),
    ("POST", "/admin/models/unload", models.unload),
    # the built-in chat UI (GET /, static files under /ui/)
    *ui.ROUTES,
]
