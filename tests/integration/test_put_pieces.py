"""The edge's image bytes on JetStream: ``JetStreamLog.put_pieces`` stores each value under its session and digest
in the pieces bucket, readable through ``eventlog.pieces``; a value the bucket holds already is not rewritten."""

from __future__ import annotations

import hashlib

from nats.aio.client import Client

from eventlog.pieces import open_pieces
from eventlog.publisher import JetStreamLog
from schemas import blobs
from schemas.log import LogConfig
from tests.images import noise_png, png

SID = "0123456789abcdef0123456789abcdef"


async def test_pieces_are_stored_by_session_and_digest_once(nc: Client, log_config: LogConfig) -> None:
    log = JetStreamLog(nc, log_config)
    small, large = png(8, 8), noise_png(200, 200)  # the larger spans several object chunks
    digests = {hashlib.sha256(v).digest(): v for v in (small, large)}
    await log.put_pieces(SID, digests)
    store = await nc.jetstream().object_store(log_config.pieces_bucket)
    first = {name: (await store.get_info(name)).nuid for name in (blobs.object_name(SID, d) for d in digests)}
    await log.put_pieces(SID, digests)  # again (an edge that took the session over): left as it is
    assert {name: (await store.get_info(name)).nuid for name in first} == first
    pieces = await open_pieces(nc.jetstream(), log_config)
    assert pieces is not None
    assert [await pieces.get(SID, d) for d in digests] == [small, large]
    assert await pieces.get("f" * 32, next(iter(digests))) is None  # another session's name
