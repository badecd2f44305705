"""SGLang's native ``/generate`` API, spoken over one pooled ``httpx.AsyncClient``.

Request (``GenerateReqInput``, sglang ``python/sglang/srt/managers/io_struct.py``)::

    {"input_ids": [...], "rid": "<request_id>", "return_logprob": true, "stream": false,
     "sampling_params": {"max_new_tokens", "temperature", "top_p", "top_k", "stop",
                         "stop_token_ids", "skip_special_tokens": false, "no_stop_trim": true}}

Response (``TokenizerManager._handle_batch_output``)::

    {"text"?: "...", "output_ids": [...],
     "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", ...} | null,
                   "prompt_tokens", "completion_tokens", "weight_version"?,
                   "output_token_logprobs"?: [[logprob, token_id, text_or_null], ...]}}

Streaming is SSE: ``data: {<same shape>}`` events, then ``data: [DONE]``; a failure
mid-stream arrives as ``data: {"error": {"message": ...}}``. By default ``output_ids``
and ``output_token_logprobs`` are cumulative; with the server's
``--incremental-streaming-output`` they are deltas. ``completion_tokens`` is cumulative
either way, so :class:`_Assembler` tells the two apart per event and needs no setting.

httpx errors are converted here, once: refused connections become
``EngineUnavailable``, timeouts ``EngineTimeout``, anything else (5xx, bodies that do not
decode, missing fields, log probs that do not line up with tokens) ``EngineError``.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import httpx
import msgspec

from edge.engines.base import FinishReason, GenerateChunk, GenerateRequest, GenerateResult
from schemas.errors import EngineError, EngineTimeout, EngineUnavailable

_T = TypeVar("_T")
_FINISH_TYPES: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_JSON = {"content-type": "application/json"}


class _FinishReason(msgspec.Struct):
    type: str
    message: str | None = None


class _MetaInfo(msgspec.Struct):
    finish_reason: _FinishReason | None  # null until the last event of a stream
    completion_tokens: int  # cumulative, in every streaming mode
    weight_version: str | None = None
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None


class _ErrorBody(msgspec.Struct):
    message: str = "no message"


class _Output(msgspec.Struct):
    output_ids: list[int] | None = None
    meta_info: _MetaInfo | None = None
    error: _ErrorBody | None = None


_decoder = msgspec.json.Decoder(_Output)


class SGLangEngine:
    """Client for one or more SGLang servers; a request's session picks its server.

    Requests of one session (``request_id`` = ``"<session_id>:<n>"``) go to the same URL,
    so SGLang's radix cache keeps the session's prefix warm.
    """

    name = "sglang"

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout: float = 300.0,
        connect_timeout: float = 5.0,
        health_timeout: float = 30.0,
        max_connections: int = 256,
    ) -> None:
        if not urls:
            raise ValueError("SGLangEngine needs at least one server URL")
        self.urls = tuple(url.rstrip("/") for url in urls)
        self._health_timeout = health_timeout
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    def url_for(self, request_id: str) -> str:
        session = request_id.rsplit(":", 1)[0]
        return self.urls[zlib.crc32(session.encode()) % len(self.urls)]

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        url = self.url_for(request.request_id)
        with _converted(url):
            body = _payload(request, stream=False)
            response = await self._client.post(f"{url}/generate", content=body, headers=_JSON)
        _raise_for_status(response, url)
        assembler = _Assembler(request.return_logprob)
        assembler.feed(_decode(response.content))
        return assembler.result()

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk | GenerateResult]:
        """Closing this iterator early closes the connection, which makes SGLang abort the request."""
        url = self.url_for(request.request_id)
        assembler = _Assembler(request.return_logprob)
        with _converted(url):
            body = _payload(request, stream=True)
            async with self._client.stream("POST", f"{url}/generate", content=body, headers=_JSON) as response:
                if response.status_code != 200:
                    await response.aread()
                    _raise_for_status(response, url)
                async for data in _sse_data(response.aiter_lines()):
                    chunk = assembler.feed(_decode(data))
                    if chunk is not None:
                        yield chunk
        yield assembler.result()

    async def abort(self, request_id: str) -> None:
        """Ask the server to stop ``request_id``; it then finishes with ``"abort"``."""
        url = self.url_for(request_id)
        with _converted(url):
            response = await self._client.post(f"{url}/abort_request", json={"rid": request_id})
        _raise_for_status(response, url)

    async def health(self) -> bool:
        """True when every server answers ``GET /health`` with 200."""
        for url in self.urls:
            try:
                response = await self._client.get(f"{url}/health", timeout=self._health_timeout)
            except httpx.HTTPError:
                return False
            if response.status_code != 200:
                return False
        return True

    async def aclose(self) -> None:
        await self._client.aclose()


def _payload(request: GenerateRequest, *, stream: bool) -> bytes:
    sampling = request.sampling
    return msgspec.json.encode(
        {
            "input_ids": [int(token) for token in request.input_ids],  # numpy ids too
            "sampling_params": {
                "max_new_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
                "stop": list(sampling.stop),
                "stop_token_ids": list(sampling.stop_token_ids),
                "skip_special_tokens": False,
                "no_stop_trim": True,
            },
            "return_logprob": request.return_logprob,
            "stream": stream,
            "rid": request.request_id,
        }
    )


@contextmanager
def _converted(url: str) -> Iterator[None]:
    """The one place httpx errors become engine errors."""
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        raise EngineUnavailable(f"SGLang at {url} is unreachable: {exc!r}") from exc
    except httpx.TimeoutException as exc:
        raise EngineTimeout(f"SGLang at {url} timed out: {exc!r}") from exc
    except httpx.HTTPError as exc:
        raise EngineError(f"SGLang at {url} failed: {exc!r}") from exc


def _raise_for_status(response: httpx.Response, url: str) -> None:
    if response.status_code == 200:
        return
    message = f"SGLang at {url} answered {response.status_code}: {response.text[:500]}"
    if response.status_code == 503:
        raise EngineUnavailable(message)
    if response.status_code == 504:
        raise EngineTimeout(message)
    raise EngineError(message)


async def _sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The payloads of ``data:`` lines, up to ``[DONE]``."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield data


def _decode(data: bytes | str) -> _Output:
    try:
        output = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EngineError(f"SGLang sent a body that does not decode: {exc}") from exc
    if output.error is not None:
        raise EngineError(f"SGLang reported an error: {output.error.message}")
    return output


def _new_items(items: list[_T], seen: int, total: int, what: str) -> list[_T]:
    """The items not seen yet, whether ``items`` is cumulative or a delta."""
    if len(items) == total and total >= seen:
        return items[seen:]
    if seen + len(items) == total:
        return items
    raise EngineError(f"SGLang sent {len(items)} {what} after {seen}, but completion_tokens is {total}")


class _Assembler:
    """Folds SGLang output events (one for ``generate``, many for ``stream``) into a result."""

    def __init__(self, return_logprob: bool) -> None:
        self._return_logprob = return_logprob
        self._ids: list[int] = []
        self._logprobs: list[float] = []
        self._finish: FinishReason | None = None
        self._weight_version: str | None = None

    def feed(self, output: _Output) -> GenerateChunk | None:
        meta = output.meta_info
        if output.output_ids is None or meta is None:
            raise EngineError("SGLang response lacks output_ids or meta_info")
        total = meta.completion_tokens
        ids = _new_items(output.output_ids, len(self._ids), total, "output_ids")
        logprobs = self._new_logprobs(meta, ids, total) if self._return_logprob else None
        self._ids.extend(ids)
        self._logprobs.extend(logprobs or ())
        self._weight_version = meta.weight_version or self._weight_version
        if meta.finish_reason is not None:
            self._finish = _finish_reason(meta.finish_reason)
        if not ids:
            return None
        return GenerateChunk(token_ids=tuple(ids), logprobs=None if logprobs is None else tuple(logprobs))

    def _new_logprobs(self, meta: _MetaInfo, ids: list[int], total: int) -> list[float]:
        entries = _new_items(meta.output_token_logprobs or [], len(self._logprobs), total, "log probs")
        if len(entries) != len(ids):
            raise EngineError(f"SGLang sent {len(entries)} log probs for {len(ids)} tokens")
        if [entry[1] for entry in entries] != ids:
            raise EngineError("SGLang log probs name other tokens than output_ids")
        return [entry[0] for entry in entries]

    def result(self) -> GenerateResult:
        if self._finish is None:
            raise EngineError("SGLang output ended without a finish reason")
        return GenerateResult(
            token_ids=tuple(self._ids),
            logprobs=tuple(self._logprobs) if self._return_logprob else None,
            finish_reason=self._finish,
            weight_version=self._weight_version,
        )


def _finish_reason(finish: _FinishReason) -> FinishReason:
    try:
        return _FINISH_TYPES[finish.type]
    except KeyError:
        raise EngineError(f"SGLang sent an unknown finish reason {finish.type!r}") from None


__all__ = ["SGLangEngine"]
