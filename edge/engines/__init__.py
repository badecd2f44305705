"""Engines behind one protocol: :func:`make_engine` builds one by kind.

Kinds: ``local`` (in-process CPU model, :mod:`edge.engines.local`), ``sglang`` and ``vllm``
(HTTP clients sharing :mod:`edge.engines.http`: placement over several servers, health
probing, bounded retries, aborts) and ``verl`` (an adapter over verl's ``LLMServerClient``,
:mod:`edge.engines.verl`, for an edge running inside a verl job). Torch and transformers
are not imported here; the scripted test servers live in :mod:`rollbus.testing`, outside the
production packages.
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
from edge.engines.models import LOCAL_MODELS, LocalModel, local_model
from edge.engines.sglang import SGLangEngine
from edge.engines.verl import VerlEngine
from edge.engines.vllm import VLLMEngine

ENGINE_KINDS = ("local", "sglang", "vllm", "verl")
HTTP_ENGINES: dict[str, type[SGLangEngine] | type[VLLMEngine]] = {"sglang": SGLangEngine, "vllm": VLLMEngine}


def make_engine(kind: str, urls: Sequence[str] = (), **opts: Any) -> Engine:
    """Build the engine ``kind``; ``opts`` go to its constructor (``verl`` needs ``client=``)."""
    if kind == "local":
        if urls:
            raise ValueError("the local engine runs in-process and takes no URLs")
        return LocalEngine(**opts)
    if kind in HTTP_ENGINES:
        if not urls:
            raise ValueError(f"the {kind} engine needs at least one URL (--engine-url)")
        return HTTP_ENGINES[kind](urls, **opts)
    if kind == "verl":
        if urls or "client" not in opts:
            raise ValueError("the verl engine wraps an in-process LLMServerClient (client=...) and takes no URLs")
        return VerlEngine(**opts)
    raise ValueError(f"unknown engine kind {kind!r}; expected one of {', '.join(ENGINE_KINDS)}")


__all__ = [
    "ENGINE_KINDS",
    "LOCAL_MODELS",
    "Engine",
    "FinishReason",
    "GenerateChunk",
    "GenerateRequest",
    "GenerateResult",
    "LocalEngine",
    "LocalModel",
    "SGLangEngine",
    "SamplingParams",
    "VLLMEngine",
    "VerlEngine",
    "local_model",
    "make_engine",
]
