"""How the edge answers each error: one table keyed by exception class, resolved along the MRO.

The domain's errors (:mod:`schemas.errors`) carry no HTTP: :data:`ERRORS` gives each class its
status, OpenAI's ``error.type`` and ``error.code``, Anthropic's ``error.type``, and whether the
error's ``retry_after`` hint is answered as ``Retry-After`` (and ``retry-after-ms``, which the
openai and anthropic SDKs honour). A class that is not in the table answers as its nearest
ancestor that is (as httpx's ``map_httpcore_exceptions`` does), so a new subclass needs a row
only when it should answer differently from its parent. In short::

    class                     status  OpenAI type / code                               Anthropic type
    RollbusError              500     api_error / internal_error                       api_error
    MalformedRequest          400     invalid_request_error / invalid_request_error    invalid_request_error
      ContextTooLong          400     invalid_request_error / context_length_exceeded  invalid_request_error
      IdempotencyKeyReused    400     invalid_request_error / idempotency_key_reused   invalid_request_error
      ChatTemplateError       400     invalid_request_error / chat_template_error      invalid_request_error
      TemplateNotIncremental  400     invalid_request_error / template_not_incremental invalid_request_error
      ImageRefused            400     invalid_request_error / invalid_image            invalid_request_error
    Unauthorized              401     authentication_error / authentication_error      authentication_error
    SessionNotFound           404     not_found_error / not_found_error                not_found_error
    ResponseNotFound          404     not_found_error / not_found_error                not_found_error
    RouteNotFound             404     not_found_error / not_found_error                not_found_error
    MethodNotAllowed          405     invalid_request_error / method_not_allowed       invalid_request_error
    SessionClosed             409     conflict_error / session_closed                  invalid_request_error
    Conflict                  409     conflict_error / conflict                        invalid_request_error
      OwnershipLost           409     conflict_error / ownership_lost                  invalid_request_error
      SessionOwned            409     conflict_error / session_owned_elsewhere         invalid_request_error +R
      RevisionConflict        409     conflict_error / conflict                        invalid_request_error
    PayloadTooLarge           413     invalid_request_error / request_too_large        request_too_large
      ImageTooLarge           413     invalid_request_error / image_too_large          request_too_large
    CapacityExceeded          429     rate_limit_error / rate_limit_error              rate_limit_error      +R
    EngineError               502     api_error / engine_error                         api_error
      EngineRefused           400     invalid_request_error / invalid_request_error    invalid_request_error
      EngineUnavailable       503     api_error / engine_unavailable                   overloaded_error
      EngineTimeout           504     api_error / engine_timeout                       api_error
    LogUnavailable            503     api_error / log_unavailable                      overloaded_error      +R
    SinkUnavailable           503     api_error / sink_unavailable                     overloaded_error
    FoldError                 500     api_error / fold_error                           api_error
      OutOfOrderEvent         500     api_error / out_of_order_event                   api_error

(+R: with ``Retry-After`` when the error has a ``retry_after``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from schemas.errors import (
    CapacityExceeded,
    ChatTemplateError,
    Conflict,
    ContextTooLong,
    EngineError,
    EngineRefused,
    EngineTimeout,
    EngineUnavailable,
    FoldError,
    IdempotencyKeyReused,
    ImageRefused,
    ImageTooLarge,
    LogUnavailable,
    MalformedRequest,
    MethodNotAllowed,
    OutOfOrderEvent,
    OwnershipLost,
    PayloadTooLarge,
    ResponseNotFound,
    RevisionConflict,
    RollbusError,
    RouteNotFound,
    SessionClosed,
    SessionNotFound,
    SessionOwned,
    SinkUnavailable,
    TemplateNotIncremental,
    Unauthorized,
)


@dataclass(frozen=True, slots=True)
class HttpError:
    """How one class of error is answered."""

    status: int
    code: str  # OpenAI's error.code
    openai_type: str  # OpenAI's error.type
    anthropic_type: str  # Anthropic's error.type
    retry_after: bool = False  # answer the error's retry_after hint as Retry-After


def _bad(code: str) -> HttpError:
    return HttpError(400, code, "invalid_request_error", "invalid_request_error")


def _conflict(code: str, *, retry_after: bool = False) -> HttpError:
    return HttpError(409, code, "conflict_error", "invalid_request_error", retry_after)


def _server(status: int, code: str, anthropic_type: str = "api_error") -> HttpError:
    return HttpError(status, code, "api_error", anthropic_type)


ERRORS: dict[type[RollbusError], HttpError] = {
    RollbusError: _server(500, "internal_error"),
    MalformedRequest: _bad("invalid_request_error"),
    ContextTooLong: _bad("context_length_exceeded"),
    IdempotencyKeyReused: _bad("idempotency_key_reused"),
    ChatTemplateError: _bad("chat_template_error"),
    TemplateNotIncremental: _bad("template_not_incremental"),
    ImageRefused: _bad("invalid_image"),
    Unauthorized: HttpError(401, "authentication_error", "authentication_error", "authentication_error"),
    SessionNotFound: HttpError(404, "not_found_error", "not_found_error", "not_found_error"),
    ResponseNotFound: HttpError(404, "not_found_error", "not_found_error", "not_found_error"),
    RouteNotFound: HttpError(404, "not_found_error", "not_found_error", "not_found_error"),
    MethodNotAllowed: HttpError(405, "method_not_allowed", "invalid_request_error", "invalid_request_error"),
    SessionClosed: _conflict("session_closed"),
    Conflict: _conflict("conflict"),
    OwnershipLost: _conflict("ownership_lost"),
    RevisionConflict: _conflict("conflict"),  # (a lost compare-and-set that reached a client: try again)
    SessionOwned: _conflict("session_owned_elsewhere", retry_after=True),
    PayloadTooLarge: HttpError(413, "request_too_large", "invalid_request_error", "request_too_large"),
    ImageTooLarge: HttpError(413, "image_too_large", "invalid_request_error", "request_too_large"),
    CapacityExceeded: HttpError(429, "rate_limit_error", "rate_limit_error", "rate_limit_error", retry_after=True),
    EngineError: _server(502, "engine_error"),
    EngineRefused: _bad("invalid_request_error"),
    EngineUnavailable: _server(503, "engine_unavailable", "overloaded_error"),
    EngineTimeout: _server(504, "engine_timeout"),
    LogUnavailable: HttpError(503, "log_unavailable", "api_error", "overloaded_error", retry_after=True),
    SinkUnavailable: _server(503, "sink_unavailable", "overloaded_error"),
    FoldError: _server(500, "fold_error"),
    OutOfOrderEvent: _server(500, "out_of_order_event"),
}


def http_error(exc: RollbusError) -> HttpError:
    """How ``exc`` is answered: the row of its class, or of its nearest ancestor that has one."""
    for cls in type(exc).__mro__:
        row = ERRORS.get(cls)
        if row is not None:
            return row
    return ERRORS[RollbusError]  # pragma: no cover - RollbusError is in every such MRO


def retry_after_headers(exc: RollbusError, row: HttpError) -> dict[str, str]:
    """``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms`` when ``row`` answers the
    error's hint and it has one; else nothing."""
    if not row.retry_after or exc.retry_after is None:
        return {}
    return {"Retry-After": str(math.ceil(exc.retry_after)), "retry-after-ms": str(math.ceil(exc.retry_after * 1000))}
