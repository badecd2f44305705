"""Compressed request bodies: ``Content-Encoding`` ``gzip``, ``zstd`` and ``br``, decoded with a bound.

An agent may compress what it sends (``Content-Encoding: zstd``, ``gzip``, ``br``; ``identity``
and ``x-gzip`` are understood too). Each coding is inflated a piece at a time and the output
counted as it comes, so a small body that would inflate past the limit (a compression bomb) is
refused (413) as soon as it passes it, never inflated whole: zlib and brotli are asked for at most
:data:`CHUNK` bytes a call; zstd, which cannot be, is fed its input a slice at a time, each slice
short enough that it cannot inflate past another ``limit`` bytes (a zstd block of at most 128 KiB
needs at least 4 bytes) and a frame's window is held to the limit. Codings listed together
(``gzip, br``) are undone in reverse order, at most :data:`MAX_CODINGS` of them. A coding not
listed here, or a body that does not decode in its coding or ends early, is 400.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Iterator

import brotli
import zstandard

from schemas.errors import MalformedRequest, PayloadTooLarge

CHUNK = 256 * 1024  # output asked for a call
MAX_CODINGS = 2
IN_THREAD = 16 * 1024  # a compressed body larger than this is decoded off the event loop
_ZSTD_BLOCK = 128 * 1024  # the most a zstd block inflates to ...
_ZSTD_MIN_BLOCK = 4  # ... from at least this many bytes (an RLE block: 3 bytes of header, 1 of data)
_ZSTD_WINDOW_LOG = 23  # the window of zstd's levels up to 19 (8 MiB); a frame asking more (--long, --ultra) is 400

Inflate = Callable[[bytes, int], Iterator[bytes]]


def _gunzip(data: bytes, limit: int) -> Iterator[bytes]:
    """gzip members, one after another (RFC 1952 allows several)."""
    inflater = zlib.decompressobj(wbits=31)
    while True:
        try:
            out = inflater.decompress(data, CHUNK)
        except zlib.error as exc:
            raise MalformedRequest(f"the gzip request body does not decode: {exc}") from None
        yield out
        data = inflater.unconsumed_tail
        if inflater.eof:
            data = inflater.unused_data
            if not data:
                return
            inflater = zlib.decompressobj(wbits=31)
        elif not data and not out:
            raise MalformedRequest("the gzip request body ends before its end")


def _unzstd(data: bytes, limit: int) -> Iterator[bytes]:
    """zstd frames, one after another, fed in slices that each inflate to at most about ``limit`` bytes."""
    window = 1 << max(_ZSTD_WINDOW_LOG, (limit - 1).bit_length())  # enough for any level's frame of ``limit`` bytes
    dctx = zstandard.ZstdDecompressor(max_window_size=window)
    step = max(64, limit // _ZSTD_BLOCK * _ZSTD_MIN_BLOCK)
    view = memoryview(data)
    inflater, fed, at = dctx.decompressobj(write_size=CHUNK), False, 0
    while at < len(view):
        piece = view[at:at + step]
        try:
            out = inflater.decompress(piece)
        except zstandard.ZstdError as exc:
            raise MalformedRequest(f"the zstd request body does not decode: {exc}") from None
        yield out
        at, fed = at + len(piece), True
        if inflater.eof:  # a frame ended: the rest of the slice starts the next one
            at -= len(inflater.unused_data)
            inflater, fed = dctx.decompressobj(write_size=CHUNK), False
    if fed:
        raise MalformedRequest("the zstd request body ends before its end")


def _unbrotli(data: bytes, limit: int) -> Iterator[bytes]:
    inflater = brotli.Decompressor()
    try:
        yield inflater.process(data, output_buffer_limit=CHUNK)
        while not inflater.is_finished():
            out = inflater.process(b"", output_buffer_limit=CHUNK)
            if not out:
                raise MalformedRequest("the br request body ends before its end")
            yield out
    except brotli.error as exc:
        raise MalformedRequest(f"the br request body does not decode: {exc}") from None


INFLATERS: dict[str, Inflate] = {"gzip": _gunzip, "x-gzip": _gunzip, "zstd": _unzstd, "br": _unbrotli}


def codings(content_encoding: str | None) -> list[str]:
    """The codings ``Content-Encoding`` lists, in the order they were applied; 400 for one not served."""
    listed = [c.strip().lower() for c in (content_encoding or "").split(",")]
    applied = [c for c in listed if c and c != "identity"]
    for coding in applied:
        if coding not in INFLATERS:
            raise MalformedRequest(f"Content-Encoding {coding[:40]!r} is not supported (gzip, zstd, br)")
    if len(applied) > MAX_CODINGS:
        raise MalformedRequest(f"Content-Encoding lists {len(applied)} codings (at most {MAX_CODINGS})")
    return applied


def decode_body(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """``body`` with its codings undone; 413 once it inflates past ``limit`` bytes."""
    for coding in reversed(codings(content_encoding)):
        parts: list[bytes] = []
        size = 0
        for part in INFLATERS[coding](body, limit):
            size += len(part)
            if size > limit:
                raise PayloadTooLarge(f"the request body inflates past {limit} bytes ({coding})")
            parts.append(part)
        body = b"".join(parts)
    return body


async def decoded(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """:func:`decode_body`, off the event loop for a large body (zlib, zstd and brotli release the GIL)."""
    if content_encoding is None:
        return body
    if len(body) > IN_THREAD:
        return await asyncio.to_thread(decode_body, body, content_encoding, limit)
    return decode_body(body, content_encoding, limit)
