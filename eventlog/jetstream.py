"""The log's port on JetStream (:class:`eventlog.port.LogPort`): :class:`JetStreamLog`'s writes, with the
reads, durable consumers and KV buckets of :mod:`eventlog.reader`, :mod:`eventlog.consumer` and
:mod:`eventlog.kv`, on one nats-py client. Its in-memory twin is ``rollbus.testing.memory_log.InMemoryLog``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from eventlog.consumer import JetStreamConsumers
from eventlog.kv import KvStore
from eventlog.pieces import PieceStore, open_pieces
from eventlog.port import Delivery, Subscription
from eventlog.publisher import JetStreamLog
from eventlog.reader import (
    LogMessage,
    SessionLog,
    decode_msg,
    iter_envelopes,
    last_stream_seq,
    load_state,
    read_session,
)
from schemas.errors import LogUnavailable
from schemas.events import AnyEvent
from schemas.log import LogConfig
from session.fold import SessionState


class JetStreamPort(JetStreamLog):
    """The event log on JetStream through ``nc``: append and publish as :class:`JetStreamLog`, and read."""

    def __init__(self, nc: Client, cfg: LogConfig, *, timeout: float = 5.0, attempts: int = 4) -> None:
        super().__init__(nc, cfg, timeout=timeout, attempts=attempts)
        self._consumers = JetStreamConsumers(self._js)
        self._pieces: PieceStore | None = None

    @property
    def cfg(self) -> LogConfig:
        return self._cfg

    async def subscribe(
        self, stream: str, subject: str, durable: str, *, ack_wait: float, max_ack_pending: int
    ) -> Subscription:
        return await self._consumers.subscribe(
            stream, subject, durable, ack_wait=ack_wait, max_ack_pending=max_ack_pending
        )

    async def decode(self, msg: Delivery) -> list[AnyEvent]:
        return await decode_msg(self._js, self._cfg, msg)

    async def read_session(self, session_id: str, *, until: int | None = None) -> SessionLog:
        return await read_session(self._js, self._cfg, session_id, until=until)

    async def load_state(self, session_id: str, *, until: int | None = None) -> tuple[SessionState, int]:
        return await load_state(self._js, self._cfg, session_id, until=until)

    async def last_stream_seq(self, session_id: str) -> int:
        return await last_stream_seq(self._js, self._cfg, self._cfg.session_filter(session_id), self._timeout)

    async def last_message(self, subject: str) -> LogMessage | None:
        try:
            msg = await asyncio.wait_for(self._js.get_last_msg(self._cfg.stream, subject), self._timeout)
        except NotFoundError:
            return None
        except (TimeoutError, NatsError) as exc:
            raise LogUnavailable(f"JetStream did not answer a last-message lookup ({exc!r})") from exc
        return LogMessage(msg.subject or subject, int(msg.seq or 0), 0, msg.data or b"", msg.headers)

    async def envelopes(self, session_id: str) -> AsyncIterator[tuple[int, list[AnyEvent]]]:
        subject_filter = self._cfg.session_filter(session_id)
        last = await last_stream_seq(self._js, self._cfg, subject_filter, self._timeout)
        reading = iter_envelopes(self._js, self._cfg, subject_filter, last, self._timeout)
        async with contextlib.aclosing(reading):
            async for item in reading:
                yield item

    async def image(self, session_id: str, digest: str) -> bytes | None:
        if self._pieces is None:
            self._pieces = await open_pieces(self._js, self._cfg, timeout=self._timeout)
            if self._pieces is None:  # no bucket: nothing was ever stored
                return None
        return await self._pieces.get(session_id, bytes.fromhex(digest))

    def kv(self, bucket: str, *, timeout: float = 5.0) -> KvStore:
        return KvStore(self._js, bucket, timeout=timeout)
