"""The routes table: one line per endpoint, one module per dialect."""

from imp.http import anthropic, capacity, common, control, llama_cpp, openai_chat, openai_completions

ROUTES = [
    ("POST", "/v1/chat/completions", openai_chat.chat_completions),
    ("POST", "/v1/completions", openai_completions.completions),
    ("POST", "/infill", llama_cpp.infill),
    ("POST", "/tokenize", llama_cpp.tokenize),
    ("POST", "/detokenize", llama_cpp.detokenize),
    ("GET", "/props", llama_cpp.props),
    ("GET", "/info", common.info),
    ("POST", "/v1/requests/{id}/end_thinking", control.end_thinking),
    ("POST", "/v1/sessions/{id}/close", control.close_session),
    ("GET", "/v1/models", common.models),
    ("GET", "/v1/models/{model:.+}", common.model),
    ("GET", "/health", common.health),
    ("GET", "/ready", common.ready),
    ("GET", "/metrics", common.metrics),
    # capacity, live metrics, admin suspend/resume
    ("GET", "/v1/capacity/plan", capacity.capacity_plan),
    ("POST", "/v1/estimate", capacity.estimate_route),
    ("GET", "/v1/metrics", capacity.metrics_json),
    ("POST", "/admin/suspend", common.suspend),
    ("POST", "/admin/resume", common.resume),
    # Anthropic Messages dialect
    ("POST", "/v1/messages", anthropic.messages),
    ("POST", "/v1/messages/count_tokens", anthropic.count_tokens),
]
