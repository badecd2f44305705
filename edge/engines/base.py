"""The engine seam: token ids in, token ids + log probs + finish reason out.

Every engine (SGLang, vLLM, verl's server manager, the local CPU model, the scripted
test server) sits behind :class:`Engine`. Engines raise only the ``EngineError`` family
of :mod:`schemas.errors`; third-party errors are converted where they are met.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec
import numpy as np

FinishReason = Literal["stop", "length", "abort"]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What reaches the engine. ``max_new_tokens`` is already clamped to the chain's capacity."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()


class Constraint(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the sampled text must be, for the engine's constrained decoding
    (:func:`edge.tokens.constraint.derive_constraint` says how it is derived).

    ``grammar`` is in llguidance's Lark syntax (``%json {...}`` for JSON-schema parts, ``<name>`` for
    a marker that is one token of its own); ``json_schema`` is set when the whole text is one JSON
    value, for engines with a JSON-schema parameter of their own. ``label`` names it in the log:
    ``tool:required``, ``tool:<name>``, ``json_object``, ``json_schema`` (``json_schema:<name>``)."""

    label: str
    grammar: str
    json_schema: dict[str, Any] | None = None


class GenerateRequest(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str  # unique per engine call: "<session_id>:<request_no>"
    input_ids: Sequence[int]  # a list, or a numpy array of the chain's packed ids (see id_list)
    sampling: SamplingParams
    return_logprob: bool = True
    constraint: Constraint | None = None  # sample only text the constraint admits
    # The raw bytes of the images whose placeholders appear in input_ids, in order; the ids hold each image's
    # expanded <|image_pad|> run, as verl's prompt ids do (vision.processor says how many).
    images: tuple[bytes, ...] = ()


class GenerateChunk(msgspec.Struct, frozen=True, kw_only=True):
    """New tokens since the previous chunk of a streamed generation."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None


class GenerateResult(msgspec.Struct, frozen=True, kw_only=True):
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None  # one per token when requested
    finish_reason: FinishReason
    weight_version: str | None = None


@runtime_checkable
class Engine(Protocol):
    name: str

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate to completion."""
        ...

    def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk | GenerateResult]:
        """Yield chunks as the engine produces them, then the final :class:`GenerateResult`
        (whose ``token_ids`` are the whole generation)."""
        ...

    async def aclose(self) -> None: ...


def id_list(ids: Sequence[int]) -> list[int]:
    """Token ids as a list of Python ints, for an engine's wire (the edge hands a continued chain's
    ids over as a numpy view of its packed tokens, not as a list)."""
    if isinstance(ids, np.ndarray):
        return ids.tolist()
    return [int(token) for token in ids]
