"""Request bodies: their Content-Encoding decoded with a bound on what they inflate to, and the time
they may take to arrive (edge.routes.encoding, edge.routes.handling.receive_body)."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import tracemalloc
from collections.abc import Callable

import brotli
import pytest
import zstandard

from edge.routes.encoding import decode_body
from edge.routes.handling import Message, check_utf8, receive_body
from edge.settings import BodyLimits
from schemas.errors import MalformedRequest, PayloadTooLarge

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hé " * 2000}]}).encode()
LIMIT = 1 << 20

COMPRESS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "zstd": lambda data: zstandard.ZstdCompressor().compress(data),
    "br": brotli.compress,
}


@pytest.mark.parametrize("coding", [*COMPRESS, "GZip", "x-gzip"])
def test_each_coding_is_decoded(coding: str) -> None:
    packed = COMPRESS[coding.lower().removeprefix("x-")](BODY)
    assert len(packed) < len(BODY) // 10 and decode_body(packed, coding, LIMIT) == BODY


def test_identity_none_and_stacked_codings() -> None:
    assert decode_body(BODY, None, LIMIT) == BODY and decode_body(BODY, "identity", LIMIT) == BODY
    assert decode_body(brotli.compress(gzip.compress(BODY)), "gzip, br", LIMIT) == BODY  # applied in this order
    with pytest.raises(MalformedRequest, match="at most 2"):
        decode_body(BODY, "gzip, gzip, gzip", LIMIT)


def test_several_gzip_members_and_zstd_frames_are_one_body() -> None:
    halves = BODY[:1000], BODY[1000:]
    assert decode_body(b"".join(gzip.compress(h) for h in halves), "gzip", LIMIT) == BODY
    zstd = zstandard.ZstdCompressor()
    assert decode_body(b"".join(zstd.compress(h) for h in halves), "zstd", LIMIT) == BODY


@pytest.mark.parametrize("coding", ["deflate", "compress", "zstd;q=1", "a" * 100])
def test_a_coding_not_served_is_400(coding: str) -> None:
    with pytest.raises(MalformedRequest, match="not supported") as refused:
        decode_body(BODY, coding, LIMIT)
    assert len(refused.value.message) < 120  # the client's header is not echoed at length


@pytest.mark.parametrize("coding", list(COMPRESS))
def test_a_truncated_or_corrupt_body_is_400(coding: str) -> None:
    packed = COMPRESS[coding](os.urandom(4000))  # incompressible: its end is data, not padding
    for broken in (packed[: len(packed) - 8], b"not compressed at all", packed + b"junk"):
        with pytest.raises(MalformedRequest):
            decode_body(broken, coding, LIMIT)


@pytest.mark.parametrize("coding", ["gzip", "zstd"])
def test_a_changed_byte_is_400_where_the_coding_has_a_checksum(coding: str) -> None:
    packed = gzip.compress(BODY) if coding == "gzip" else zstandard.ZstdCompressor(write_checksum=True).compress(BODY)
    changed = bytearray(packed)
    changed[len(changed) // 2] ^= 0xFF
    with pytest.raises(MalformedRequest):
        decode_body(bytes(changed), coding, LIMIT)


MiB = 1 << 20


@pytest.fixture(scope="module")
def bombs() -> dict[str, bytes]:
    """64 MiB of zeros in each coding, a few hundred KiB at most: gzip and zstd as 64 members (frames) of one
    MiB each (zstd's streamed, so not declaring its size), br as one stream."""
    gzip_mib = gzip.compress(b"\0" * MiB)
    packer = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    zstd_mib = packer.compress(b"\0" * MiB) + packer.flush()
    return {"gzip": gzip_mib * 64, "zstd": zstd_mib * 64, "br": brotli.compress(b"\0" * 64 * MiB, quality=1)}


@pytest.mark.parametrize("coding", list(COMPRESS))
def test_a_compression_bomb_is_413_before_it_is_inflated(coding: str, bombs: dict[str, bytes]) -> None:
    bomb = bombs[coding]
    assert len(bomb) < 512 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLarge, match="inflates past"):
            decode_body(bomb, coding, LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * LIMIT  # a few times the limit, never the 64 MiB


def test_a_zstd_frame_that_declares_its_size_is_bounded_too() -> None:
    declared = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    assert zstandard.frame_content_size(declared) == 64 << 20
    with pytest.raises(PayloadTooLarge):
        decode_body(declared, "zstd", LIMIT)


def test_a_body_at_the_limit_passes_and_one_byte_more_does_not() -> None:
    exact = b"x" * LIMIT
    for coding, compress in COMPRESS.items():
        assert decode_body(compress(exact), coding, LIMIT) == exact
        with pytest.raises(PayloadTooLarge):
            decode_body(compress(exact + b"x"), coding, LIMIT)


# --- the time a body may take -----------------------------------------------------------------------


def test_the_time_allowed_is_a_base_plus_the_size_at_the_minimum_rate() -> None:
    limits = BodyLimits(max_bytes=1000, silence_s=30, base_s=2, min_rate=100)
    assert limits.time_allowed(500) == 7 and limits.time_allowed(0) == 2
    assert limits.time_allowed(None) == 12  # chunked: as if the largest body allowed


def trickle(data: bytes, every_s: float) -> Callable[[], asyncio.Future[Message]]:
    """An ASGI ``receive`` that hands over ``data`` a byte at a time, ``every_s`` apart."""
    sent = 0

    async def receive() -> Message:
        nonlocal sent
        await asyncio.sleep(every_s)
        sent += 1
        return {"type": "http.request", "body": data[sent - 1:sent], "more_body": sent < len(data)}

    return receive  # type: ignore[return-value]


async def test_a_body_that_trickles_is_refused_at_its_deadline_though_never_silent() -> None:
    limits = BodyLimits(max_bytes=1000, silence_s=30, base_s=0.2, min_rate=100)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(MalformedRequest, match="too slowly") as refused:
        await receive_body(trickle(b"x" * 40, 0.05), {"content-length": "40"}, limits)  # 2 s to send; 0.6 s allowed
    assert 0.5 < loop.time() - started < 1.5
    assert " of 40 bytes in 0.6 s" in refused.value.message


async def test_a_body_at_the_minimum_rate_arrives_and_is_decoded() -> None:
    packed = gzip.compress(b'{"a": 1}')
    limits = BodyLimits(max_bytes=1000, silence_s=30, base_s=1.0, min_rate=1000)
    got = await receive_body(trickle(packed, 0.002), {"content-length": str(len(packed)), "content-encoding": "gzip"},
                             limits)
    assert got == b'{"a": 1}'


async def test_a_chunked_body_is_bounded_by_the_largest_body_at_the_rate() -> None:
    limits = BodyLimits(max_bytes=20, silence_s=30, base_s=0.1, min_rate=100)  # 0.3 s for any chunked body
    with pytest.raises(MalformedRequest, match="too slowly"):
        await receive_body(trickle(b"x" * 20, 0.05), {}, limits)


async def test_a_body_that_is_not_utf8_is_400_even_where_the_json_decoder_would_skip_it() -> None:
    # msgspec skips an unknown field's name unchecked and keeps the tools as raw bytes to echo back: a
    # stray byte there reached a Responses answer (found by the fuzz test)
    raw = b'{"tools": [{"type": "web_search", "\xffexternal_web_access": false}]}'
    limits = BodyLimits(max_bytes=1000, silence_s=30, base_s=1.0, min_rate=1000)
    with pytest.raises(MalformedRequest, match="not valid UTF-8: invalid start byte at byte 35"):
        await receive_body(trickle(raw, 0), {}, limits)
    packed = gzip.compress(raw)  # checked after the coding is undone
    with pytest.raises(MalformedRequest, match="not valid UTF-8"):
        await receive_body(trickle(packed, 0), {"content-encoding": "gzip"}, limits)


def test_utf8_bodies_pass_whole_and_truncated_or_surrogate_sequences_do_not() -> None:
    for good in (b"{}", rb'{"a": "caf\u00e9 \ud83d\ude00"}', '{"a": "café ☃ 😀"}'.encode()):
        assert check_utf8(good) is good
    for bad in ('{"a": "😀"}'.encode()[:-3], b'{"a": "\xed\xa0\x80"}', b"\xc0\xaf"):
        with pytest.raises(MalformedRequest, match="not valid UTF-8"):
            check_utf8(bad)


async def test_a_body_that_goes_silent_is_refused_after_the_silence_not_before() -> None:
    """Parts 0.05 s apart for 0.4 s, then nothing: the body's one timer moves on while parts come (a silence of
    0.3 s is never reached by them) and fires 0.3 s after the last."""
    limits = BodyLimits(max_bytes=1000, silence_s=0.3, base_s=30, min_rate=100)
    loop = asyncio.get_running_loop()
    sent = 0

    async def receive() -> Message:
        nonlocal sent
        sent += 1
        await asyncio.sleep(0.05 if sent <= 8 else 60)
        return {"type": "http.request", "body": b"x", "more_body": True}

    started = loop.time()
    with pytest.raises(MalformedRequest, match=r"stalled: nothing arrived for 0\.3 s"):
        await receive_body(receive, {}, limits)
    assert sent == 9 and 0.65 < loop.time() - started < 2.0


async def test_a_cancellation_from_elsewhere_while_a_body_arrives_stays_a_cancellation() -> None:
    """Shutdown cancelling the reading task is not taken for a stalled body, before the body's timer fires or
    together with it; and the timer does not outlive the read."""
    limits = BodyLimits(max_bytes=1000, silence_s=0.1, base_s=30, min_rate=100)

    async def never() -> Message:
        await asyncio.sleep(60)
        raise AssertionError("unreachable")

    for after in (0.02, 0.1):  # before the silence is up, and at the moment it is
        reading = asyncio.ensure_future(receive_body(never, {}, limits))
        await asyncio.sleep(after)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
    loop = asyncio.get_running_loop()

    def armed() -> int:  # the loop's timers not cancelled (asyncio's own list of them)
        return sum(not handle.cancelled() for handle in loop._scheduled)  # type: ignore[attr-defined]

    before = armed()
    assert await receive_body(trickle(b"{}", 0), {}, limits) == b"{}"
    assert armed() == before
