"""vLLM, tokens in and tokens out (placement, health, retries, aborts: :mod:`edge.engines.http`).

**Primary: ``POST /inference/v1/generate``** (``vllm/entrypoints/serve/disagg/protocol.py``)::

    {"request_id": "<request_id>", "token_ids": [...], "stream": false,
     "sampling_params": {"max_tokens", "temperature", "top_p", "top_k"?, "stop", "stop_token_ids",
                         "logprobs": 0, "skip_special_tokens": false, "include_stop_str_in_output": true}}
    -> {"request_id", "choices": [{"index": 0, "token_ids": [...], "finish_reason": "stop"|"length"|"abort",
                                    "logprobs": {"content": [{"token": "token_id:N", "logprob": x, ...}]}}]}

Streamed (``"stream": true``, ``"stream_options": {"include_usage": true}``): SSE events
whose ``choices[0].token_ids`` and ``logprobs.content`` are deltas and whose last
``finish_reason`` is set, then ``{"choices": [], "usage": {"completion_tokens"}}``
(checked against the tokens received), then ``[DONE]``; a failure arrives as
``data: {"error": {"message"}}``. ``logprobs: 0`` asks for the sampled token's log prob
only. ``top_k`` is left out when disabled.

**Fallback: ``POST /v1/completions``** with a token-id ``prompt``, ``return_token_ids``
and ``logprobs: 0``: ``choices[0].token_ids`` and ``logprobs.token_logprobs`` (one per
token), streamed the same way. With ``api="auto"`` (the default) a server whose
``/inference/v1/generate`` answers 404 (started without the scale-out endpoints) is
switched to completions for good, and the request is re-sent there (nothing was
generated).

A turn under a :class:`~edge.engines.base.Constraint` adds vLLM's ``structured_outputs`` to the
sampling parameters (both routes): ``{"json": schema}`` when the whole reply is one JSON value,
else ``{"grammar": <Lark>}`` (llguidance's dialect, JSON schemas inline as ``%json``), which
vLLM's default ``auto`` backend hands to its ``guidance`` backend (xgrammar cannot take it); a
server started with ``--structured-outputs-config.backend xgrammar`` refuses it.

``stop`` and ``length`` stay distinct (vLLM's own finish reasons, passed through); verl's
client folds both into ``completed``, rollbus does not.

Images: neither route takes images with token ids. ``/v1/completions`` takes a token-id ``prompt`` and no
multimodal data; ``/inference/v1/generate``'s ``features`` carries vLLM's own pre-processed multimodal items
(serialized tensors from its render step, with placeholder ranges), not images, and vLLM's ``/generate`` does
not consume them yet. Only the chat routes take images, and they render and tokenize the messages
themselves, which would lose the exact tokens the log must hold. A turn with images is therefore refused
(400, :class:`~schemas.errors.EngineRefused`) and ``rollbus up --processor`` refuses ``--engine vllm`` at
start; images run on SGLang, verl's servers (whose vLLM takes ``multi_modal_data`` in-process) and the
local engine.

Aborts: vLLM aborts a request whose connection closes; rollbus also posts
``/abort_requests {"request_ids": ["generate-tokens-<id>"]}`` (served in vLLM's
``--tokens-only`` mode; a 404 elsewhere is ignored). vLLM reports no weight version.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

import httpx2
import msgspec

from edge.engines.base import Constraint, FinishReason, GenerateChunk, GenerateRequest, GenerateResult, id_list
from edge.engines.http import Call, HttpEngine, raise_for_status
from schemas.errors import EngineError, EngineRefused, Refused, RouteMissing

Api = Literal["generate", "completions"]
LABEL = "vLLM"
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_PREFIX: dict[Api, str] = {"generate": "generate-tokens-", "completions": "cmpl-"}
NO_IMAGES = ("the vllm engine takes no images: vLLM's token-in routes (/inference/v1/generate, /v1/completions) "
             "accept no raw images with token ids; serve images with --engine sglang, verl's servers or the local "
             "engine")


class _Content(msgspec.Struct):
    token: str = ""
    logprob: float | None = None


class _Logprobs(msgspec.Struct):
    content: list[_Content] | None = None  # /inference/v1/generate (chat-style)
    token_logprobs: list[float | None] | None = None  # /v1/completions
    tokens: list[str] | None = None


class _Choice(msgspec.Struct):
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    logprobs: _Logprobs | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int


class _Error(msgspec.Struct):
    message: str = "no message"


class _Output(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: _Error | None = None
    object: str | None = None  # older vLLM errors: {"object": "error", "message": ...}
    message: str | None = None


class VLLMEngine(HttpEngine):
    """Client for one or more vLLM servers (see :mod:`edge.engines.http` for the shared rules)."""

    name = "vllm"
    label = LABEL
    _quiet_errors = (Refused, RouteMissing, EngineRefused)

    def __init__(self, urls: Sequence[str], *, api: Literal["auto", "generate", "completions"] = "auto",
                 model: str | None = None, **options: Any) -> None:
        if api not in ("auto", "generate", "completions"):
            raise ValueError(f"unknown vLLM api {api!r}; expected auto, generate or completions")
        super().__init__(urls, **options)
        self._auto = api == "auto"
        self.api: dict[str, Api] = dict.fromkeys(self.urls, "completions" if api == "completions" else "generate")
        self._model = model

    def _generate_call(self, url: str, request: GenerateRequest, *, stream: bool) -> Call:
        if request.images:
            raise EngineRefused(NO_IMAGES)
        api = self.api[url]
        body = _generate_body(request, stream) if api == "generate" else _completions_body(request, stream, self._model)
        path = "/inference/v1/generate" if api == "generate" else "/v1/completions"
        return Call(url + path, msgspec.json.encode(body))

    def _assembler(self, url: str, request: GenerateRequest) -> _Assembler:
        return _Assembler(request.return_logprob, chat_logprobs=self.api[url] == "generate")

    def _abort_call(self, url: str, request_id: str) -> Call:
        ids = [_PREFIX[self.api[url]] + request_id]
        return Call(f"{url}/abort_requests", msgspec.json.encode({"request_ids": ids}))

    def _check(self, response: httpx2.Response, url: str) -> None:
        if response.status_code == 404 and self._auto and self.api[url] == "generate":
            self.api[url] = "completions"
            raise RouteMissing(f"{LABEL} at {url} has no /inference/v1/generate; switching to /v1/completions")
        raise_for_status(response, LABEL, url)

    async def _generate_on(self, url: str, request: GenerateRequest) -> GenerateResult:
        try:
            return await super()._generate_on(url, request)
        except RouteMissing:
            return await super()._generate_on(url, request)

    async def _stream_on(self, url: str, request: GenerateRequest) -> AsyncIterator[GenerateChunk | GenerateResult]:
        try:
            async with contextlib.aclosing(super()._stream_on(url, request)) as items:
                async for item in items:
                    yield item
        except RouteMissing:  # raised before anything was streamed
            async with contextlib.aclosing(super()._stream_on(url, request)) as items:
                async for item in items:
                    yield item


def _sampling(request: GenerateRequest) -> dict[str, Any]:
    sampling = request.sampling
    params: dict[str, Any] = {
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stop": list(sampling.stop),
        "stop_token_ids": list(sampling.stop_token_ids),
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    if sampling.top_k > 0:
        params["top_k"] = sampling.top_k
    if request.return_logprob:
        params["logprobs"] = 0
    if request.constraint is not None:
        params["structured_outputs"] = structured_outputs(request.constraint)
    return params


def structured_outputs(constraint: Constraint) -> dict[str, Any]:
    """vLLM's ``StructuredOutputsParams`` for the constraint: ``json`` or ``grammar`` (see above)."""
    if constraint.json_schema is not None:
        return {"json": constraint.json_schema}
    return {"grammar": constraint.grammar}


def _generate_body(request: GenerateRequest, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"request_id": request.request_id, "token_ids": id_list(request.input_ids),
                            "sampling_params": _sampling(request), "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _completions_body(request: GenerateRequest, stream: bool, model: str | None) -> dict[str, Any]:
    body = {"prompt": id_list(request.input_ids), "return_token_ids": True, "stream": stream,
            "request_id": request.request_id, **_sampling(request)}
    if model is not None:
        body["model"] = model
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


_decoder = msgspec.json.Decoder(_Output)


def _decode(data: bytes | str) -> _Output:
    try:
        output = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EngineError(f"{LABEL} sent a body that does not decode: {exc}") from exc
    if output.error is not None:
        raise EngineError(f"{LABEL} reported an error: {output.error.message}")
    if output.object == "error":
        raise EngineError(f"{LABEL} reported an error: {output.message}")
    return output


class _Assembler:
    """Folds vLLM replies (one for ``generate``, delta events for ``stream``) into a result."""

    def __init__(self, return_logprob: bool, *, chat_logprobs: bool) -> None:
        self._return_logprob = return_logprob
        self._chat = chat_logprobs
        self._ids: list[int] = []
        self._logprobs: list[float] = []
        self._finish: FinishReason | None = None
        self._usage: int | None = None

    def feed(self, data: bytes | str) -> GenerateChunk | None:
        output = _decode(data)
        if output.usage is not None:
            self._usage = output.usage.completion_tokens
        if not output.choices:
            if output.usage is None:
                raise EngineError(f"{LABEL} response has no choices")
            return None
        choice = output.choices[0]
        if choice.token_ids is None:
            raise EngineError(f"{LABEL} response lacks token_ids (is the server too old for return_token_ids?)")
        logprobs = self._logprobs_of(choice) if self._return_logprob else None
        self._ids.extend(choice.token_ids)
        self._logprobs.extend(logprobs or ())
        if choice.finish_reason is not None:
            self._finish = _finish(choice.finish_reason)
        if not choice.token_ids:
            return None
        return GenerateChunk(token_ids=tuple(choice.token_ids), logprobs=None if logprobs is None else tuple(logprobs))

    def _logprobs_of(self, choice: _Choice) -> list[float]:
        ids = choice.token_ids or []
        found = choice.logprobs or _Logprobs()
        if self._chat:
            names, values = [c.token for c in found.content or ()], [c.logprob for c in found.content or ()]
        else:
            names, values = found.tokens or [], found.token_logprobs or []
        if len(values) != len(ids):
            raise EngineError(f"{LABEL} sent {len(values)} log probs for {len(ids)} tokens")
        named = [name.removeprefix("token_id:") for name in names]
        if any(n != str(token) for n, token in zip(named, ids, strict=False) if n.isascii() and n.isdigit()):
            raise EngineError(f"{LABEL} log probs name other tokens than token_ids")
        if any(value is None for value in values):
            raise EngineError(f"{LABEL} sent a token without its log prob")
        return [float(value) for value in values if value is not None]

    def result(self) -> GenerateResult:
        if self._finish is None:
            raise EngineError(f"{LABEL} output ended without a finish reason")
        if self._usage is not None and self._usage != len(self._ids):
            raise EngineError(f"{LABEL} reported {self._usage} completion tokens but sent {len(self._ids)}")
        return GenerateResult(
            token_ids=tuple(self._ids),
            logprobs=tuple(self._logprobs) if self._return_logprob else None,
            finish_reason=self._finish,
        )


def _finish(reason: str) -> FinishReason:
    try:
        return _FINISH[reason]
    except KeyError:
        raise EngineError(f"{LABEL} finished with {reason!r}") from None


__all__ = ["NO_IMAGES", "VLLMEngine", "structured_outputs"]
