"""Engines behind one protocol: :func:`make_engine` builds one by kind.

Kinds: ``local`` (in-process CPU model, :mod:`edge.engines.local`) and ``sglang`` (HTTP
client, :mod:`edge.engines.sglang`). The scripted test server lives in
:mod:`edge.engines.scripted` and is not imported here, nor are torch and transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edge.engines.base import (
    Engine,
    FinishReason,
    GenerateChunk,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)
from edge.engines.local import LocalEngine
from edge.engines.sglang import SGLangEngine

ENGINE_KINDS = ("local", "sglang")


def make_engine(kind: str, urls: Sequence[str] = (), **opts: Any) -> Engine:
    """Build the engine ``kind``; ``opts`` go to its constructor."""
    if kind == "local":
        if urls:
            raise ValueError("the local engine runs in-process and takes no URLs")
        return LocalEngine(**opts)
    if kind == "sglang":
        if not urls:
            raise ValueError("the sglang engine needs at least one URL (--engine-url)")
        return SGLangEngine(urls, **opts)
    if kind == "vllm":
        raise ValueError("the vllm engine is not available yet; use 'sglang' or 'local'")
    raise ValueError(f"unknown engine kind {kind!r}; expected one of {', '.join(ENGINE_KINDS)}")


__all__ = [
    "ENGINE_KINDS",
    "Engine",
    "FinishReason",
    "GenerateChunk",
    "GenerateRequest",
    "GenerateResult",
    "LocalEngine",
    "SGLangEngine",
    "SamplingParams",
    "make_engine",
]
