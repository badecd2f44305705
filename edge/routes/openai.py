"""OpenAI-compatible model route: ``POST /sessions/{id}/v1/chat/completions``."""

from __future__ import annotations

from edge.codec.openai_wire import OpenAIWire
from edge.routes.model import model_router

router = model_router(OpenAIWire(), "/sessions/{session_id}/v1/chat/completions")
