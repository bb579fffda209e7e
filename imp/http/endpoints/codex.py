"""Codex's model catalog: `GET /codex/models`, what Codex reads from a provider's `model_catalog_url`.

Codex decides a model's tools from its catalog entry. For a model it has no entry for (every
local model) it falls back to metadata that offers no `apply_patch` custom tool: edits then go
through shell commands inside a JSON string, where a patch grammar cannot reach. Pointed here,

    [model_providers.imp]
    base_url = "http://127.0.0.1:8080/v1"
    wire_api = "responses"
    model_catalog_url = "http://127.0.0.1:8080/codex/models"

Codex (0.171) fetches `GET /codex/models?client_version=...` and, for the model named in its
`model`, sends its freeform `apply_patch` tool (a Lark grammar, which imp enforces on the call's
raw input) and sizes its auto-compaction on the model's real context window.

The entry carries the fields Codex 0.171 refuses a catalog without (found by feeding it one:
`support_verbosity`, `experimental_supported_tools`, `base_instructions`) and the ones that
matter here; the rest take Codex's defaults. `base_instructions` is Codex's system prompt for the
model: a short one of ours, because Codex's own default is ~4.5k tokens that a small local model
with an 8-32k window pays on every turn. A user who wants Codex's own prompt keeps Codex's
`model_catalog_json` instead.
"""

from __future__ import annotations

from aiohttp import web

from imp.http import keys

INSTRUCTIONS = """\
You are a coding agent in the Codex CLI, working in the user's workspace.

Run shell commands with `exec_command` (read a file before changing it). Edit files with \
`apply_patch`; its input is the patch itself, not JSON:

*** Begin Patch
*** Update File: <file path>
@@
-<the line as it is now>
+<the line as it should be>
*** End Patch

`*** Add File: <file path>` followed by lines that start with `+` creates a file; \
`*** Delete File: <file path>` removes one. File paths are relative to the working directory.

When the task is done, reply to the user with a short summary of what you changed."""


def entry(slug: str, context_window: int, priority: int = 0) -> dict:
    """One model of the catalog, as Codex's ModelInfo reads it."""
    return {
        "slug": slug,
        "display_name": slug,
        "description": f"{slug} served by imp",
        "context_window": context_window,
        "max_context_window": context_window,
        "apply_patch_tool_type": "freeform",  # the custom tool whose grammar imp holds calls to
        "shell_type": "shell_command",
        "supports_parallel_tool_calls": True,
        "supported_in_api": True,
        "visibility": "list",
        "priority": priority,
        "input_modalities": ["text"],
        "supported_reasoning_levels": [],
        "support_verbosity": False,
        "supports_reasoning_summaries": False,
        "truncation_policy": {"mode": "tokens", "limit": 10000},
        "experimental_supported_tools": [],
        "base_instructions": INSTRUCTIONS,
    }


async def catalog(request: web.Request) -> web.Response:
    """The loaded model and its adapters (a request may name either), in Codex's catalog shape."""
    port = request.app[keys.PORT]
    card = port.card
    names = [card.name, *(a.name for a in port.loras() if a.name != card.name)]
    return web.json_response({"models": [entry(n, card.context_length, i) for i, n in enumerate(names)]})
