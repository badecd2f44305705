"""Appending a session's events to JetStream, under the log rules.

* An append is one envelope (one message) per call, split only when it would exceed
  the payload limit; ``Nats-Msg-Id = <session_id>:<first seq>`` so a retry is a no-op.
* The per-session expected-last-subject-sequence check (filtered on the session's
  subjects) makes a stale writer fail with :class:`OwnershipLost` instead of
  interleaving.
* Every publish is bounded by a timer (:class:`edge.acks.AckedPublisher`). A publish that
  timed out may still have been stored, so it is retried with the same headers. JetStream
  checks the expected last sequence before its duplicate window, so a retry of a stored
  publish is refused as "wrong last sequence": then the session's last message is read,
  and if it is this very envelope (same ``Nats-Msg-Id``) the retry succeeded after all.
* A single event too large for one message has its largest values moved to the object
  store first (:mod:`schemas.blobs`), and is refused (413) only if it still does not fit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

import msgspec
from nats.errors import ConnectionClosedError, MaxPayloadError, OutboundBufferLimitError
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.client import JetStreamContext

from edge.acks import Ack, AckedPublisher, NoResponders, PublishRejected
from edge.nats_direct import DirectPublisher, direct_publisher
from schemas import blobs, envelope
from schemas.errors import LogUnavailable, OwnershipLost, PayloadTooLarge
from schemas.events import SCHEMA_VERSION, Event
from schemas.log import (
    HDR_BLOBS,
    HDR_EXPECTED_LAST_SUBJECT_SEQ,
    HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT,
    HDR_MSG_ID,
    HDR_SCHEMA,
    HDR_SEQ,
    LogConfig,
    msg_id,
)

log = logging.getLogger(__name__)

WRONG_LAST_SEQUENCE = 10071


class Appended(msgspec.Struct, frozen=True, kw_only=True):
    """The log's acknowledgement of an append: where the last envelope landed."""

    stream: str
    stream_seq: int
    duplicate: bool
    envelopes: int


class EventLog(Protocol):
    """The seam the edge writes through (JetStream in production, in-memory in unit tests)."""

    async def append(self, session_id: str, events: Sequence[Event], expected_last: int) -> Appended: ...


class JetStreamLog:
    def __init__(self, js: JetStreamContext, cfg: LogConfig, *, timeout: float = 5.0, attempts: int = 4,
                 direct: bool = False) -> None:
        """``direct``: publish on a connection of the log's own (:mod:`edge.nats_direct`, where the
        server's URL allows it; the edge's choice), to be closed with :meth:`close`."""
        nc = js._nc  # nats-py exposes the context's client only privately
        self._direct = direct_publisher(nc) if direct else None
        self._publisher: DirectPublisher | AckedPublisher = self._direct or AckedPublisher(nc)
        self._js = js
        self._cfg = cfg
        self._timeout = timeout
        self._attempts = attempts

    async def append(self, session_id: str, events: Sequence[Event], expected_last: int) -> Appended:
        """Append events (consecutive, of one session) after stream sequence ``expected_last``."""
        payload = envelope.encode(events)
        if len(payload) <= self._cfg.max_event_bytes:
            ack = await self._publish(session_id, events, payload, expected_last)
            return Appended(stream=ack.stream, stream_seq=ack.seq, duplicate=ack.duplicate, envelopes=1)
        batches = await self._fitted(events, payload)
        for batch, batch_payload, moved in batches[:-1]:
            expected_last = (await self._publish(session_id, batch, batch_payload, expected_last, moved)).seq
        batch, batch_payload, moved = batches[-1]
        ack = await self._publish(session_id, batch, batch_payload, expected_last, moved)
        return Appended(stream=ack.stream, stream_seq=ack.seq, duplicate=ack.duplicate, envelopes=len(batches))

    async def _fitted(self, events: Sequence[Event], payload: bytes) -> list[tuple[Sequence[Event], bytes, int]]:
        """Envelopes under the limit, in order: split, and a single oversized event's largest values
        stored in the object store (how many, the third item); an event that still does not fit is
        refused."""
        limit = self._cfg.max_event_bytes
        if len(payload) <= limit:
            return [(events, payload, 0)]
        if len(events) > 1:
            middle = len(events) // 2
            return [*await self._fitted(events[:middle], envelope.encode(events[:middle])),
                    *await self._fitted(events[middle:], envelope.encode(events[middle:]))]
        event, moved = blobs.externalize(events[0], limit)
        payload = envelope.encode([event])
        if len(payload) > limit:
            raise PayloadTooLarge(f"one {type(event).__name__} event is {len(payload)} bytes (limit {limit})")
        await self._store_pieces(moved)
        return [([event], payload, len(moved))]

    async def _store_pieces(self, pieces: dict[str, bytes]) -> None:
        try:
            store = await asyncio.wait_for(self._js.object_store(self._cfg.pieces_bucket), self._timeout)
            for name, data in pieces.items():
                await asyncio.wait_for(store.put(name, data), self._timeout + len(data) / 10e6)
        except (TimeoutError, NatsError) as exc:
            raise LogUnavailable(f"could not store a large piece in the object store: {exc!r}") from exc

    async def _publish(self, session_id: str, batch: Sequence[Event], payload: bytes, expected_last: int,
                       moved: int = 0) -> Ack:
        headers = {
            HDR_MSG_ID: msg_id(session_id, batch[0].seq),
            HDR_EXPECTED_LAST_SUBJECT_SEQ: str(expected_last),
            HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT: self._cfg.session_filter(session_id),
            HDR_SCHEMA: str(SCHEMA_VERSION),
            HDR_SEQ: f"{batch[0].seq}-{batch[-1].seq}",
        }
        if moved:
            headers[HDR_BLOBS] = str(moved)
        subject = self._cfg.subject(session_id, envelope.kind_of(batch))
        for attempt in range(1, self._attempts + 1):
            try:
                return await self._publisher.publish(subject, payload, headers, self._timeout)
            except PublishRejected as exc:
                if exc.error.err_code == WRONG_LAST_SEQUENCE:
                    if attempt > 1 and (stored := await self._stored_last(session_id, headers[HDR_MSG_ID])):
                        return stored  # the timed-out attempt was stored
                    raise OwnershipLost(f"session {session_id} was appended to by another writer") from exc
                raise LogUnavailable(f"JetStream rejected the append: {exc.error.description}") from exc
            except (TimeoutError, NatsTimeoutError, NoResponders, OutboundBufferLimitError,
                    ConnectionResetError) as exc:
                log.warning("append to %s timed out (attempt %d/%d): %r", subject, attempt, self._attempts, exc)
                if attempt == self._attempts:
                    raise LogUnavailable("JetStream did not acknowledge the append") from exc
                await asyncio.sleep(0.05 * attempt)
            except ConnectionClosedError as exc:
                raise LogUnavailable("the NATS connection is closed") from exc
            except MaxPayloadError as exc:  # the server's max_payload is below the log's max_event_bytes
                raise PayloadTooLarge(f"an envelope of {len(payload)} bytes is over the NATS server's max_payload; "
                                      "lower the log's max_event_bytes or raise max_payload") from exc
        raise LogUnavailable("unreachable")  # pragma: no cover

    async def close(self) -> None:
        if self._direct is not None:
            await self._direct.close()

    async def _stored_last(self, session_id: str, message_id: str) -> Ack | None:
        """The session's last message as an acknowledgement, if it carries ``message_id``."""
        try:
            last = await self._js.get_last_msg(self._cfg.stream, self._cfg.session_filter(session_id))
        except (NatsError, TimeoutError) as exc:  # unknown: the caller treats the session as lost
            log.warning("could not read the last message of session %s: %r", session_id, exc)
            return None
        if last.headers is None or last.headers.get(HDR_MSG_ID) != message_id or last.seq is None:
            return None
        return Ack(stream=self._cfg.stream, seq=last.seq, duplicate=True)
