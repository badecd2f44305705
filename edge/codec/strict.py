"""Strict JSON decoding of request bodies into typed structs, errors as 400s."""

from __future__ import annotations

from typing import TypeVar

import msgspec

from schemas.errors import MalformedRequest

T = TypeVar("T")


def decode_strict(body: bytes, kind: type[T], *, empty_ok: bool = False) -> T:
    """``body`` decoded as ``kind``; an empty body is ``{}`` when ``empty_ok``."""
    if empty_ok and not body.strip():
        body = b"{}"
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise MalformedRequest(f"invalid request: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise MalformedRequest(f"request body is not valid JSON: {exc}") from exc
