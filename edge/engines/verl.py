r"""verl's rollout servers through its ``LLMServerClient``, so the edge can run inside a verl job.

verl is not imported (nor required): the client is duck-typed on the signature of
``verl/workers/rollout/llm_server.py``::

    class LLMServerClient:
        async def generate(self, request_id, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                           image_data=None, video_data=None, ..., **kwargs) -> TokenOutput

    class TokenOutput(BaseModel):            # verl/workers/rollout/replica.py
        token_ids: list[int]
        log_probs: list[float] | None        # when sampling_params["logprobs"] is true
        stop_reason: str | None              # "completed", "aborted", None (unknown), or a new reason
        extra_fields: dict[str, Any]         # "global_steps": the version of the weights; "min_global_steps",
                                             # "max_global_steps": the versions a partial rollout spans
        ...

What rollbus sends: ``request_id`` is the **session id** (verl's client load-balances by
it and keeps a session on one server for prefix caching; it picks its own id for the
server request); ``sampling_params`` is ``{"max_tokens", "temperature", "top_p", "top_k",
"logprobs"}`` plus ``stop`` and ``stop_token_ids`` when set (verl's vLLM and SGLang
servers both read these keys); ``image_data`` (only when the turn has images) the images whose pad
tokens are in ``prompt_ids``, in order, as RGB ``PIL.Image.Image``\ s, as verl's own agent loop hands
them over (its vLLM server puts them in ``multi_modal_data``, its SGLang server in ``image_data``).

Finish reasons: verl folds ``stop`` and ``length`` into ``"completed"``; rollbus must not
(a truncated turn reaches the agent as ``finish_reason: "length"``). For ``"completed"``
(or ``None``) the finish is ``length`` when the turn used all ``max_new_tokens`` and its
last token is not a stop token, else ``stop``; ``"aborted"`` is ``abort``; a literal
``"stop"``/``"length"`` passes through; any other reason is an ``EngineError``.
``extra_fields`` becomes the turn's ``weight_version`` (:func:`weight_version`): ``"3"`` for
weights of step 3, ``"3..4"`` for a partial rollout resumed across a weight update (its
``min_global_steps`` 3, ``max_global_steps`` 4); the materializer reads both forms into a
trajectory's ``min_global_steps`` / ``max_global_steps``.

Constrained decoding: verl's client hands ``sampling_params`` to its servers as keyword arguments
of their own sampling types, with no place for a grammar that works on both, so a turn under a
:class:`~edge.engines.base.Constraint` (a forced tool call, a JSON format) is refused here as a 400
(:class:`~schemas.errors.EngineRefused`) rather than sampled unconstrained.

Failures (converted here, once): no answer within ``timeout`` is ``EngineTimeout``; a dead
or unreachable server actor (Ray's ``RayActorError`` family, recognized by class name)
or an empty load balancer is ``EngineUnavailable``; any other exception the client
raises, or an output without token ids or with a log-prob count that does not match,
is ``EngineError``. Nothing is retried (the agent may retry the turn). verl's client has
no per-request abort: a cancelled call stops waiting and the server finishes the turn.
There is no streaming either: :meth:`VerlEngine.stream` yields the whole generation once.
"""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import AsyncIterator, Sequence
from numbers import Integral
from typing import Any, Protocol

from edge.engines.base import FinishReason, GenerateChunk, GenerateRequest, GenerateResult, id_list
from edge.engines.http import refusal
from edge.engines.pool import session_of
from schemas.errors import EngineError, EngineRefused, EngineTimeout, EngineUnavailable

_UNAVAILABLE_CLASSES = {"RayActorError", "ActorDiedError", "ActorUnavailableError", "ActorUnschedulableError",
                        "NodeDiedError", "RaySystemError"}
_COMPLETED = {"completed", None}
_STEP_KEYS = ("global_steps", "min_global_steps", "max_global_steps")


class LLMServerClientLike(Protocol):
    """The part of verl's ``LLMServerClient`` rollbus calls."""

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> Any: ...


class VerlEngine:
    """An :class:`~edge.engines.base.Engine` over a verl ``LLMServerClient`` (see the module docstring)."""

    name = "verl"

    def __init__(self, client: LLMServerClientLike, *, timeout: float = 300.0) -> None:
        self._client = client
        self._timeout = timeout

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.constraint is not None:
            raise EngineRefused(f"the verl engine cannot sample under a constraint ({request.constraint.label}): "
                                "forced tool choice and JSON response formats need the sglang, vllm or local engine")
        images = {"image_data": await asyncio.to_thread(pil_images, request.images)} if request.images else {}
        try:
            output = await asyncio.wait_for(
                self._client.generate(session_of(request.request_id), prompt_ids=id_list(request.input_ids),
                                      sampling_params=sampling_params(request), **images),
                self._timeout,
            )
        except TimeoutError as exc:  # asyncio's, and Ray's GetTimeoutError
            raise EngineTimeout(f"verl rollout server did not answer within {self._timeout}s: {exc!r}") from exc
        except Exception as exc:  # the duck-typed client's own errors: converted here, once
            raise _converted(exc) from exc
        return to_result(output, request)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk | GenerateResult]:
        result = await self.generate(request)
        if result.token_ids:
            yield GenerateChunk(token_ids=result.token_ids, logprobs=result.logprobs)
        yield result

    async def aclose(self) -> None:
        """The client belongs to the verl job; nothing to close here."""


def pil_images(images: Sequence[bytes]) -> list[Any]:
    r"""The images as RGB ``PIL.Image.Image``\ s (the edge checked each one's header and size before)."""
    from PIL import Image  # (only for a turn with images)

    out = []
    for index, data in enumerate(images):
        try:
            with Image.open(io.BytesIO(data)) as image:
                out.append(image.convert("RGB"))
        except (OSError, ValueError, Image.DecompressionBombError) as exc:  # PIL's errors for bad pixel data
            raise EngineRefused(f"image {index} of the turn does not decode: {exc}") from exc
    return out


def sampling_params(request: GenerateRequest) -> dict[str, Any]:
    sampling = request.sampling
    params: dict[str, Any] = {"max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                              "top_p": sampling.top_p, "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                              "logprobs": request.return_logprob}
    if sampling.stop:
        params["stop"] = list(sampling.stop)
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    return params


def to_result(output: Any, request: GenerateRequest) -> GenerateResult:
    """A verl ``TokenOutput`` as a :class:`GenerateResult`, checked."""
    token_ids = getattr(output, "token_ids", None)
    if not isinstance(token_ids, Sequence) or not all(isinstance(t, int) for t in token_ids):
        raise EngineError(f"verl returned no token ids: {type(output).__name__}")
    logprobs = getattr(output, "log_probs", None)
    if request.return_logprob:
        if logprobs is None or len(logprobs) != len(token_ids):
            count = "no" if logprobs is None else len(logprobs)
            raise EngineError(f"verl sent {count} log probs for {len(token_ids)} tokens")
        logprobs = tuple(float(lp) for lp in logprobs)
    return GenerateResult(
        token_ids=tuple(token_ids),
        logprobs=logprobs if request.return_logprob else None,
        finish_reason=finish_reason(getattr(output, "stop_reason", None), token_ids, request),
        weight_version=weight_version(getattr(output, "extra_fields", None)),
    )


def weight_version(extra: Any) -> str | None:
    """``extra_fields``' weight versions as one string: ``"3"``, or ``"3..4"`` when the generation spans
    versions 3 to 4 (the lowest and highest of ``min_global_steps``, ``max_global_steps`` and
    ``global_steps``, the integer ones); a non-integer ``global_steps`` as it is; else None."""
    if not isinstance(extra, dict):
        return None
    steps = [int(v) for k in _STEP_KEYS if isinstance(v := extra.get(k), Integral) and not isinstance(v, bool)]
    if not steps:
        other = extra.get("global_steps")
        return None if other is None else str(other)
    low, high = min(steps), max(steps)
    return str(low) if low == high else f"{low}..{high}"


def finish_reason(stop_reason: str | None, token_ids: Sequence[int], request: GenerateRequest) -> FinishReason:
    if stop_reason in ("aborted", "abort"):
        return "abort"
    if stop_reason in ("stop", "length"):
        return stop_reason  # type: ignore[return-value]
    if stop_reason not in _COMPLETED:
        raise EngineError(f"verl finished with an unknown stop reason {stop_reason!r}")
    sampling = request.sampling
    ended_on_stop = bool(token_ids) and token_ids[-1] in sampling.stop_token_ids
    return "length" if len(token_ids) >= sampling.max_new_tokens and not ended_on_stop else "stop"


_TOO_LONG = re.compile(r"Prompt length \(\d+\)[^\n]*")
"""verl's SGLang and vLLM servers' ``ValueError`` for a prompt that leaves no room in the context."""


def _converted(exc: Exception) -> EngineError:
    names = {cls.__name__ for cls in type(exc).__mro__}
    too_long = _TOO_LONG.search(str(exc)) if "ValueError" in names else None
    if too_long is not None:  # the input cannot succeed as it is: a 400, which the SDKs do not retry
        return EngineRefused(refusal("verl rollout server", too_long.group(0)))
    if names & _UNAVAILABLE_CLASSES or isinstance(exc, ConnectionError) or "No available servers" in str(exc):
        return EngineUnavailable(f"verl rollout server unavailable: {exc!r}")
    return EngineError(f"verl rollout server failed: {exc!r}")


__all__ = ["LLMServerClientLike", "VerlEngine", "weight_version"]
