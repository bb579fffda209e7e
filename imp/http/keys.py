"""The application's typed state (aiohttp AppKeys), injected by `create_app`.

Handlers read their dependencies from here and nowhere else: the engine
port, the text model, the server's frozen config, the live-request table.
A module of its own so that dialects never import the app factory.
"""

from __future__ import annotations

from aiohttp import web

PORT: web.AppKey = web.AppKey("engine_port", object)  # imp.engine.port.EnginePort
TEXT: web.AppKey = web.AppKey("text_model", object)  # imp.text.model.TextModel
CONFIG: web.AppKey = web.AppKey("config", object)  # imp.config.ServerConfig
LIVE: web.AppKey = web.AppKey("live_requests", object)  # imp.http.control.LiveRequests
GRAMMARS: web.AppKey = web.AppKey("grammars", object)  # imp.constrain.compile.GrammarCache, or None
EMBEDDER: web.AppKey = web.AppKey("embedder", object)  # imp.model.bert.BertEncoder (duck-typed), or None
FLEET: web.AppKey = web.AppKey("fleet", object)  # imp.engine.port.Models (models on demand), or None
CLOSING: web.AppKey = web.AppKey("closing", object)  # imp.http.closing.Closing: the gate after the drain
