"""The log's object store of pieces (:mod:`schemas.blobs`): values too large for one message, kept per
session by digest in ``LogConfig.pieces_bucket``, as an export reads them and an import restores them.

Every call is bounded; what nats-py raises is mapped here, once::

    the bucket does not exist                      open_pieces returns None (the caller says what that means)
    a piece that is not stored                     PieceStore.get returns None
    TimeoutError, any other nats-py error, OSError LogUnavailable
"""

from __future__ import annotations

import asyncio

from nats.errors import Error as NatsError
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from schemas import blobs
from schemas.errors import LogUnavailable
from schemas.log import LogConfig


class PieceStore:
    """The pieces' object store, bound: bounded reads and writes, errors mapped (see the module docstring)."""

    def __init__(self, store: ObjectStore, bucket: str, timeout: float) -> None:
        self._store = store
        self.bucket = bucket
        self.timeout = timeout

    async def get(self, session_id: str, digest: bytes) -> bytes | None:
        """The piece's bytes; None when the store does not hold it."""
        try:
            found = await asyncio.wait_for(self._store.get(blobs.object_name(session_id, digest)), self.timeout)
        except NotFoundError:
            return None
        except (TimeoutError, NatsError, OSError) as exc:  # (nats-py's TimeoutError subclasses both)
            raise LogUnavailable(f"the object store did not answer ({exc!r})") from exc
        return found.data or b""

    async def put(self, session_id: str, digest: bytes, data: bytes) -> None:
        """Store the piece (the same name and bytes twice store it once); the bound grows with its size."""
        try:
            await asyncio.wait_for(self._store.put(blobs.object_name(session_id, digest), data),
                                   self.timeout + len(data) / 10e6)
        except (TimeoutError, NatsError, OSError) as exc:
            raise LogUnavailable(f"could not store a piece in the object store ({exc!r})") from exc


async def open_pieces(js: JetStreamContext, cfg: LogConfig, *, timeout: float = 30.0) -> PieceStore | None:
    """The log's piece store, bound now; None when the bucket does not exist (provisioning creates it)."""
    try:
        store = await asyncio.wait_for(js.object_store(cfg.pieces_bucket), timeout)
    except NotFoundError:
        return None
    except (TimeoutError, NatsError, OSError) as exc:
        raise LogUnavailable(f"JetStream did not open the object store {cfg.pieces_bucket}") from exc
    return PieceStore(store, cfg.pieces_bucket, timeout)
