"""Envelopes: the unit the log stores. One NATS message holds one or more consecutive
events of one session (a turn's request, context, tokens and completion travel together,
so a turn costs one publish and one acknowledgement).

The payload is MessagePack: ``[event, ...]``. The ``Rollbus-Schema`` header says which
schema version wrote it; older versions are upgraded on read by the functions registered
in :data:`UPGRADERS`, keyed by ``(event type, version)``, each lifting a raw event map by
one version.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from schemas.errors import FoldError
from schemas.events import SCHEMA_VERSION, SUBJECT_KINDS, AnyEvent, Event, body_digest

Upgrader = Callable[[dict[str, Any]], dict[str, Any]]

# (event type tag, version it was written with) -> function returning the map at version + 1.
UPGRADERS: dict[tuple[str, int], Upgrader] = {}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[AnyEvent])
_raw_decoder = msgspec.msgpack.Decoder(list[dict[str, Any]])


def encode(events: Sequence[Event]) -> bytes:
    return _encoder.encode(events)


def decode(data: bytes, schema_version: int = SCHEMA_VERSION) -> list[AnyEvent]:
    """Decode an envelope, upgrading events written by older schema versions."""
    if schema_version == SCHEMA_VERSION:
        try:
            return _decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise FoldError(f"undecodable envelope: {exc}") from exc
    raw = _raw_decoder.decode(data)
    return [msgspec.convert(upgrade(item), AnyEvent) for item in raw]


def _request_v1(raw: dict[str, Any]) -> dict[str, Any]:
    """v1 kept a request's body whole (``body``, and ``body_digest`` once it was recorded); v2 stores
    parts (schemas/bodies.py): a v1 body is one part of its own."""
    lifted = {k: v for k, v in raw.items() if k != "body"}
    body = bytes(raw.get("body", b""))
    lifted["parts"] = [[body, 0, 0, 0]]
    lifted["body_size"] = len(body)
    lifted["body_digest"] = raw.get("body_digest") or body_digest(body)
    return lifted


UPGRADERS[("request_received", 1)] = _request_v1


def upgrade(raw: dict[str, Any]) -> dict[str, Any]:
    """Lift one raw event map to the current schema version."""
    version = int(raw.get("v", 1))
    while version < SCHEMA_VERSION:
        step = UPGRADERS.get((raw["type"], version))
        if step is not None:
            raw = step(raw)
        version += 1
        raw = {**raw, "v": version}
    if version > SCHEMA_VERSION:
        raise FoldError(f"event written by a newer schema (v{version}); upgrade rollbus")
    return raw


def kind_of(events: Sequence[Event]) -> str:
    """The subject kind of an envelope: that of its last event."""
    return SUBJECT_KINDS[type(events[-1])]
