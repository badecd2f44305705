"""SGLang's native ``/generate`` API (placement, health, retries, aborts: :mod:`edge.engines.http`).

Request (``GenerateReqInput``, sglang ``python/sglang/srt/managers/io_struct.py``)::

    {"input_ids": [...], "rid": "<request_id>", "return_logprob": true, "stream": false,
     "sampling_params": {"max_new_tokens", "temperature", "top_p", "top_k", "stop",
                         "stop_token_ids", "skip_special_tokens": false, "no_stop_trim": true},
     "image_data"?: ["data:image/png;base64,...", ...]}

``image_data`` (only when the turn has images) holds the images whose pad tokens are in ``input_ids``
(expanded, as verl's prompt ids hold them), in order, as data URLs, which SGLang's image loader decodes.

Response (``TokenizerManager._handle_batch_output``)::

    {"text"?: "...", "output_ids": [...],
     "meta_info": {"id", "finish_reason": {"type": "stop"|"length"|"abort", ...} | null,
                   "prompt_tokens", "completion_tokens", "weight_version"?,
                   "output_token_logprobs"?: [[logprob, token_id, text_or_null], ...]}}

A turn under a :class:`~edge.engines.base.Constraint` adds one of SGLang's constraint parameters to
``sampling_params``: ``json_schema`` (the schema as JSON text) when the whole reply is one JSON
value, which every grammar backend takes; else ``ebnf``, the grammar in llguidance's Lark
dialect (JSON schemas inline as ``%json``), which needs the server started with
``--grammar-backend llguidance`` (SGLang's default backend, xgrammar, refuses it).

``weight_version`` (the server's ``--weight-version``, updated with the weights) is kept
on the turn's ``turn_completed`` event.

Streaming is SSE: ``data: {<same shape>}`` events, then ``data: [DONE]``; a failure
mid-stream arrives as ``data: {"error": {"message": ...}}``. SGLang refuses an input it
cannot take (longer than the context, bad sampling parameters: its ``ValueError``) with a
400 ``{"error": {"message"}}``, or, streaming, with that error as the first event: both
are :class:`~schemas.errors.EngineRefused` (answered 400 to the agent). By default ``output_ids``
and ``output_token_logprobs`` are cumulative; with the server's
``--incremental-streaming-output`` they are deltas. ``completion_tokens`` is cumulative
either way, so :class:`_Assembler` tells the two apart per event and needs no setting.

Aborts: ``POST /abort_request {"rid": ...}``; the request then ends with finish ``abort``.
"""

from __future__ import annotations

import base64
from collections import OrderedDict

import msgspec

from edge.engines.base import Constraint, FinishReason, GenerateChunk, GenerateRequest, GenerateResult, id_list
from edge.engines.http import Call, HttpEngine, new_items, refusal
from edge.engines.pool import session_of
from schemas.errors import EngineError, EngineRefused

_FINISH_TYPES: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
LABEL = "SGLang"


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


class SGLangEngine(HttpEngine):
    """Client for one or more SGLang servers (see :mod:`edge.engines.http` for the shared rules)."""

    name = "sglang"
    label = LABEL

    def url_for(self, request_id: str) -> str | None:
        """The server the request's session is placed on (``None`` before its first request)."""
        return self.pool.server_of(session_of(request_id))

    def _generate_call(self, url: str, request: GenerateRequest, *, stream: bool) -> Call:
        return Call(f"{url}/generate", payload(request, stream=stream))

    def _assembler(self, url: str, request: GenerateRequest) -> _Assembler:
        return _Assembler(request.return_logprob)

    def _abort_call(self, url: str, request_id: str) -> Call:
        return Call(f"{url}/abort_request", msgspec.json.encode({"rid": request_id}))


def constraint_params(constraint: Constraint | None) -> dict[str, str]:
    """SGLang's sampling parameter for the constraint: ``json_schema`` (text) or ``ebnf`` (see above)."""
    if constraint is None:
        return {}
    if constraint.json_schema is not None:
        return {"json_schema": msgspec.json.encode(constraint.json_schema).decode()}
    return {"ebnf": constraint.grammar}


def payload(request: GenerateRequest, *, stream: bool) -> bytes:
    sampling = request.sampling
    images = {"image_data": [data_url(image) for image in request.images]} if request.images else {}
    return msgspec.json.encode(
        {
            **images,
            "input_ids": id_list(request.input_ids),  # numpy ids too
            "sampling_params": {
                "max_new_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k if sampling.top_k > 0 else -1,
                "stop": list(sampling.stop),
                "stop_token_ids": list(sampling.stop_token_ids),
                "skip_special_tokens": False,
                "no_stop_trim": True,
                **constraint_params(request.constraint),
            },
            "return_logprob": request.return_logprob,
            "stream": stream,
            "rid": request.request_id,
        }
    )


_DATA_URLS: OrderedDict[bytes, str] = OrderedDict()  # the latest images' data URLs, most recent last
_DATA_URL_BYTES = 64 * 2**20  # what they may hold, roughly


def data_url(image: bytes) -> str:
    """An image's bytes as a data URL (its media type from its first bytes; PNG when none is recognized). The
    latest are kept: every turn of a chain sends the chain's images again."""
    url = _DATA_URLS.get(image)
    if url is not None:
        _DATA_URLS.move_to_end(image)
        return url
    url = f"data:{media_type(image)};base64,{base64.b64encode(image).decode()}"
    _DATA_URLS[image] = url
    while sum(len(key) + len(value) for key, value in _DATA_URLS.items()) > _DATA_URL_BYTES and len(_DATA_URLS) > 1:
        _DATA_URLS.popitem(last=False)
    return url


_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF87a", "image/gif"),
               (b"GIF89a", "image/gif"))


def media_type(image: bytes) -> str:
    if image[:4] == b"RIFF" and image[8:12] == b"WEBP":
        return "image/webp"
    return next((kind for head, kind in _SIGNATURES if image.startswith(head)), "image/png")


def _decode(data: bytes | str, *, first: bool = False) -> _Output:
    """``first``: nothing was received before (an error then is SGLang refusing the input)."""
    try:
        output = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EngineError(f"{LABEL} sent a body that does not decode: {exc}") from exc
    if output.error is not None and first:
        raise EngineRefused(refusal(LABEL, output.error.message))
    if output.error is not None:
        raise EngineError(f"{LABEL} reported an error: {output.error.message}")
    return output


class _Assembler:
    """Folds SGLang output events (one for ``generate``, many for ``stream``) into a result."""

    def __init__(self, return_logprob: bool) -> None:
        self._return_logprob = return_logprob
        self._ids: list[int] = []
        self._logprobs: list[float] = []
        self._finish: FinishReason | None = None
        self._weight_version: str | None = None
        self._fed = False

    def feed(self, data: bytes | str) -> GenerateChunk | None:
        output = _decode(data, first=not self._fed)
        self._fed = True
        meta = output.meta_info
        if output.output_ids is None or meta is None:
            raise EngineError(f"{LABEL} response lacks output_ids or meta_info")
        total = meta.completion_tokens
        ids = new_items(output.output_ids, len(self._ids), total, "output_ids", LABEL)
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
        entries = new_items(meta.output_token_logprobs or [], len(self._logprobs), total, "log probs", LABEL)
        if len(entries) != len(ids):
            raise EngineError(f"{LABEL} sent {len(entries)} log probs for {len(ids)} tokens")
        if [entry[1] for entry in entries] != ids:
            raise EngineError(f"{LABEL} log probs name other tokens than output_ids")
        return [entry[0] for entry in entries]

    def result(self) -> GenerateResult:
        if self._finish is None:
            raise EngineError(f"{LABEL} output ended without a finish reason")
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
        raise EngineError(f"{LABEL} sent an unknown finish reason {finish.type!r}") from None


__all__ = ["SGLangEngine", "constraint_params", "data_url", "media_type", "payload"]
