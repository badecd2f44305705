"""Pieces too large for one NATS message: kept in the JetStream object store, referenced by digest.

An event must fit NATS's payload limit (1 MiB). When one does not (a 3 MB tool result in a
request body, the prompt ids of a 1M-token chain, a very long turn's sampled tokens), the
writer moves its large ``bytes`` and ``str`` values (``MIN_BLOB`` bytes or more, the largest
first, until the event fits) into the object store bucket (``LogConfig.pieces_bucket``),
under the name ``<session_id>/<sha256 hex>``, and writes in their place a MessagePack
extension whose data is the 32-byte sha256 (code 1: the value was bytes; code 2: UTF-8
text). The envelope carries the header ``Rollbus-Blobs: <count>``; the objects are stored
before the envelope is published, so a reader never meets a reference it cannot resolve.

Readers decode such an envelope in two passes: :func:`references` lists what to fetch,
:func:`decode_with` decodes with the fetched values in place. Every other envelope is
decoded as before, at no extra cost. This module is pure; the fetching and storing is in
:func:`eventlog.reader.decode_msg` and :mod:`eventlog.publisher`.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from schemas.envelope import upgrade
from schemas.errors import FoldError
from schemas.events import SCHEMA_VERSION, AnyEvent, Event, RequestReceived

MIN_BLOB = 16 * 1024
BYTES, TEXT = 1, 2  # extension codes

_encoder = msgspec.msgpack.Encoder()


def object_name(session_id: str, digest: bytes) -> str:
    return f"{session_id}/{digest.hex()}"


def _sized(value: object) -> tuple[int, bytes] | None:
    """(extension code, raw bytes) of a value that may be moved out, else None."""
    if isinstance(value, bytes):
        return BYTES, value
    if isinstance(value, str):
        return TEXT, value.encode("utf-8", "surrogatepass")
    return None


def _candidates(value: object, path: tuple[Any, ...], out: list[tuple[int, tuple[Any, ...]]]) -> None:
    """Paths of the values in ``value`` that could be moved out, with their sizes."""
    if isinstance(value, msgspec.Struct):
        for name in value.__struct_fields__:
            _candidates(getattr(value, name), (*path, name), out)
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            _candidates(item, (*path, index), out)
    else:
        sized = _sized(value)
        if sized is not None and len(sized[1]) >= MIN_BLOB:
            out.append((len(sized[1]), path))


def _replaced(value: Any, path: tuple[Any, ...], new: object) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, msgspec.Struct):
        return msgspec.structs.replace(value, **{head: _replaced(getattr(value, head), rest, new)})
    items = list(value)
    items[head] = _replaced(items[head], rest, new)
    return type(value)(items) if isinstance(value, tuple) else items


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = getattr(value, step) if isinstance(value, msgspec.Struct) else value[step]
    return value


def externalize(event: Event, limit: int) -> tuple[Event, dict[str, bytes]]:
    """``event`` with its largest values replaced by references until it encodes under ``limit``
    bytes, and the values to store (object name -> bytes). Raises nothing: the caller checks the
    size of what comes back (an event of many small values cannot be helped)."""
    found: list[tuple[int, tuple[Any, ...]]] = []
    _candidates(event, (), found)
    found.sort(reverse=True)
    blobs: dict[str, bytes] = {}
    size = len(_encoder.encode(event))
    for length, path in found:
        if size <= limit:
            break
        code, data = _sized(_get(event, path))  # type: ignore[misc]
        digest = hashlib.sha256(data).digest()
        blobs[object_name(event.session_id, digest)] = data
        event = _replaced(event, path, msgspec.msgpack.Ext(code, digest))
        size -= length - 40
    return event, blobs


IMAGE_TEXT_HEADS = (b"iVBORw0KGgo", b"/9j/", b"UklGR", b"R0lGOD")
"""How the base64 text of a PNG, JPEG, WebP and GIF image begins (their signatures, encoded)."""
MIN_IMAGE_TEXT = 64


def move_image_texts(event: Event, pieces: dict[str, bytes]) -> Event:
    """``event`` with the images' base64 text its request body holds as parts of their own (the edge isolates the
    text of an image a request is the first to send: :func:`schemas.bodies.isolating`) replaced by references,
    as :func:`externalize` does; the moved values added to ``pieces`` (object name -> bytes). So the log's
    messages hold no image, only digests (from :data:`MIN_IMAGE_TEXT` bytes of text); another event is returned
    as it is."""
    if type(event) is not RequestReceived:
        return event
    for index, part in enumerate(event.parts):
        data = part.data
        if isinstance(data, bytes) and len(data) >= MIN_IMAGE_TEXT and data.startswith(IMAGE_TEXT_HEADS):
            digest = hashlib.sha256(data).digest()
            pieces[object_name(event.session_id, digest)] = data
            event = _replaced(event, ("parts", index, "data"), msgspec.msgpack.Ext(BYTES, digest))
    return event


def references(payload: bytes) -> list[bytes]:
    """The digests an envelope refers to."""
    found: list[bytes] = []

    def hook(code: int, data: memoryview) -> None:
        found.append(bytes(data))

    msgspec.msgpack.Decoder(ext_hook=hook).decode(payload)
    return found


class _Image(msgspec.Struct):
    digest: str


class _WithImages(msgspec.Struct):
    images: list[_Image] = []


_images_decoder = msgspec.msgpack.Decoder(list[_WithImages], ext_hook=lambda code, data: None)


def image_digests(payload: bytes) -> list[str]:
    """The digests (sha256 hex) of the images an envelope's events reference (``ImageRef``): pieces of the
    session too, stored under :func:`object_name` before the envelope. Cheap for an envelope with none."""
    if b"images" not in payload:
        return []
    return list(dict.fromkeys(image.digest for event in _images_decoder.decode(payload) for image in event.images))


def decode_with(payload: bytes, values: dict[bytes, bytes], schema_version: int = SCHEMA_VERSION) -> list[AnyEvent]:
    """Decode an envelope whose references are resolved by ``values`` (digest -> stored bytes)."""

    def hook(code: int, data: memoryview) -> bytes | str:
        digest = bytes(data)
        stored = values.get(digest)
        if stored is None:
            raise FoldError(f"piece {digest.hex()} is not in the object store")
        if hashlib.sha256(stored).digest() != digest:
            raise FoldError(f"piece {digest.hex()} in the object store does not match its digest")
        return stored.decode("utf-8", "surrogatepass") if code == TEXT else stored

    raw = msgspec.msgpack.Decoder(list[dict[str, Any]], ext_hook=hook).decode(payload)
    if schema_version != SCHEMA_VERSION:
        raw = [upgrade(item) for item in raw]
    return msgspec.convert(raw, list[AnyEvent])
