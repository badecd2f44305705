"""Anthropic-compatible model route: ``POST /sessions/{id}/v1/messages`` (the session's
``anthropic_base_url`` is ``.../sessions/{id}``; the Anthropic SDK appends ``/v1/messages``)."""

from __future__ import annotations

from edge.codec.anthropic_wire import AnthropicWire
from edge.routes.model import model_router

router = model_router(AnthropicWire(), "/sessions/{session_id}/v1/messages")
