"""An engine in process whose answers come from a function, as httpx's ``MockTransport`` answers
from a handler: ``HandlerEngine(handler)`` with ``handler(GenerateRequest) -> GenerateResult`` (or an
awaitable of one). The handler may raise the engine errors of :mod:`schemas.errors` to play a failing
engine; a streamed generation is the handler's result in chunks of ``chunk_tokens`` tokens, then the
result itself, as :class:`edge.engines.base.Engine` streams.

:func:`replying` makes a handler that answers each call with the next of a list of replies, fitted to the
request the way the scripted engine servers (:mod:`rollbus.testing.scripted`) fit theirs.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from edge.engines.base import FinishReason, GenerateChunk, GenerateRequest, GenerateResult

Handler = Callable[[GenerateRequest], GenerateResult | Awaitable[GenerateResult]]


def default_logprobs(count: int) -> tuple[float, ...]:
    """The scripted servers' log probs: ``-0.01 * (i + 1)`` at position ``i``."""
    return tuple(-0.01 * (i + 1) for i in range(count))


def result(token_ids: Sequence[int], finish_reason: FinishReason = "stop", *,
           logprobs: Sequence[float] | None = None, weight_version: str | None = "handler") -> GenerateResult:
    """A generation of ``token_ids`` (log probs by :func:`default_logprobs` unless given)."""
    ids = tuple(token_ids)
    probs = tuple(logprobs) if logprobs is not None else default_logprobs(len(ids))
    return GenerateResult(token_ids=ids, logprobs=probs, finish_reason=finish_reason, weight_version=weight_version)


def fitted(reply: GenerateResult, request: GenerateRequest) -> GenerateResult:
    """``reply`` as an engine would sample it for ``request``: cut after its first stop token (finish
    ``stop``), then at ``max_new_tokens`` (finish ``length``); no log probs unless asked for."""
    ids, finish = reply.token_ids, reply.finish_reason
    stops = set(request.sampling.stop_token_ids)
    cut = next((i + 1 for i, token in enumerate(ids) if token in stops), None)
    if cut is not None:
        ids, finish = ids[:cut], "stop"
    if len(ids) > request.sampling.max_new_tokens:
        ids, finish = ids[:request.sampling.max_new_tokens], "length"
    logprobs = reply.logprobs[:len(ids)] if reply.logprobs is not None and request.return_logprob else None
    return GenerateResult(token_ids=ids, logprobs=logprobs, finish_reason=finish,
                          weight_version=reply.weight_version)


def replying(*replies: GenerateResult | Sequence[int]) -> Handler:
    """A handler answering call ``n`` with the ``n``-th reply (token ids, or a whole result), fitted
    (:func:`fitted`). A call past the last reply is a test's mistake: ``LookupError``, not an engine error."""
    queue: deque[GenerateResult] = deque(r if isinstance(r, GenerateResult) else result(r) for r in replies)

    def handler(request: GenerateRequest) -> GenerateResult:
        if not queue:
            raise LookupError(f"no reply left for engine request {request.request_id}")
        return fitted(queue.popleft(), request)

    return handler


class HandlerEngine:
    """An :class:`edge.engines.base.Engine` answered by ``handler``; it keeps every request it was sent."""

    def __init__(self, handler: Handler, *, chunk_tokens: int = 4, name: str = "handler") -> None:
        self.name = name
        self.requests: list[GenerateRequest] = []
        self.closed = False
        self._handler = handler
        self._chunk = max(1, chunk_tokens)

    async def _answer(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        answer = self._handler(request)
        return await answer if inspect.isawaitable(answer) else answer

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return await self._answer(request)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk | GenerateResult]:
        answer = await self._answer(request)
        ids, logprobs = answer.token_ids, answer.logprobs
        for start in range(0, len(ids), self._chunk):
            end = start + self._chunk
            yield GenerateChunk(token_ids=ids[start:end], logprobs=None if logprobs is None else logprobs[start:end])
        yield answer

    async def aclose(self) -> None:
        self.closed = True
