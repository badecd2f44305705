"""Strict JSON decoding of request bodies into typed structs, errors as 400s; the bounds a
request's values must keep (nesting, integer widths, sampling ranges), each refusal naming
its field.

Nesting: msgspec (like CPython's ``json``) recurses once per level, so a body nested about a
thousand levels deep raises ``RecursionError`` whatever its type; every decoding of a body or of
a piece of one answers that as a 400. A free-form value that is kept (session metadata, reward
info, tool schemas and inputs, tool-call arguments) is further bounded to :data:`MAX_DEPTH`
levels (:mod:`schemas.values`), so that what handles it later (the MessagePack encoder, the chat template, the
materializer, each with its own stack) never meets a value nested near the limit. The bounds are
checked on the decoded values that are kept, never by a pass over the body's bytes in Python.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from schemas.errors import MalformedRequest
from schemas.values import INT32_MAX, MAX_DEPTH, check_free_form

T = TypeVar("T")

MAX_TEMPERATURE = 100.0
MAX_STOP = 16  # stop strings a request (or a session's defaults) may name
MAX_STOP_CHARS = 1024

# One decoder per type: ``msgspec.json.decode(body, type=...)`` rebuilds a generic type's
# decoding plan on every call.
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}
_any = msgspec.json.Decoder()

TOO_DEEP = "request body is nested too deeply"


def decode_strict(body: bytes, kind: type[T], *, empty_ok: bool = False) -> T:
    """``body`` decoded as ``kind``; an empty body is ``{}`` when ``empty_ok``."""
    if empty_ok and not body.strip():
        body = b"{}"
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise MalformedRequest(f"invalid request: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise MalformedRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise MalformedRequest(TOO_DEEP) from None


def check_json_text(text: str, where: str) -> None:
    """Refuse (400, naming ``where``) a string holding JSON nested deeper than :data:`MAX_DEPTH`
    (tool-call arguments, which the edge parses to compare and the chat template to render). A
    string with fewer brackets than that cannot be, and is not parsed."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return
    try:
        value = _any.decode(text)
    except RecursionError:
        raise MalformedRequest(f"{where} is nested more than {MAX_DEPTH} levels deep", param=where) from None
    except msgspec.DecodeError:
        return  # not JSON: kept as text
    check_free_form(value, where, ints=False)


# --- sampling ------------------------------------------------------------------------------------


def check_max_tokens(value: int | None, param: str) -> None:
    if value is not None and not 1 <= value <= INT32_MAX:
        raise MalformedRequest(f"{param} must be an integer from 1 to {INT32_MAX}", param=param)


def check_temperature(value: float | None, param: str) -> None:
    if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_TEMPERATURE):
        raise MalformedRequest(f"{param} must be a number from 0 to {MAX_TEMPERATURE:g}", param=param)


def check_top_p(value: float | None, param: str) -> None:
    if value is not None and not (math.isfinite(value) and 0 < value <= 1):
        raise MalformedRequest(f"{param} must be in (0, 1]", param=param)


def check_top_k(value: int | None, param: str) -> None:
    if value is not None and value != -1 and not 1 <= value <= INT32_MAX:
        raise MalformedRequest(f"{param} must be -1 (off) or an integer from 1 to {INT32_MAX}", param=param)


def check_stop(value: str | Sequence[str] | None, param: str) -> None:
    """At most :data:`MAX_STOP` strings of 1 to :data:`MAX_STOP_CHARS` characters (one string, or a list)."""
    if value is None:
        return
    if isinstance(value, str):
        if not 1 <= len(value) <= MAX_STOP_CHARS:
            raise MalformedRequest(f"{param} must be 1 to {MAX_STOP_CHARS} characters", param=param)
        return
    if len(value) > MAX_STOP:
        raise MalformedRequest(f"{param} takes at most {MAX_STOP} strings", param=param)
    for i, stop in enumerate(value):
        if not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise MalformedRequest(f"{param}[{i}] must be 1 to {MAX_STOP_CHARS} characters", param=f"{param}[{i}]")


def check_sampling(*, temperature: float | None, top_p: float | None, top_k: int | None, max_tokens: int | None,
                   stop: str | Sequence[str] | None, prefix: str = "", stop_param: str = "stop") -> None:
    """Every sampling value within its range; the first out of it refused, named ``prefix + field``."""
    check_temperature(temperature, f"{prefix}temperature")
    check_top_p(top_p, f"{prefix}top_p")
    check_top_k(top_k, f"{prefix}top_k")
    check_max_tokens(max_tokens, f"{prefix}max_tokens")
    check_stop(stop, f"{prefix}{stop_param}")
