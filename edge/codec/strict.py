"""Strict JSON decoding of request bodies into typed structs, errors as 400s."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from schemas.errors import MalformedRequest

T = TypeVar("T")

# One decoder per type: ``msgspec.json.decode(body, type=...)`` rebuilds a generic type's
# decoding plan on every call.
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


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
