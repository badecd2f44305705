"""Reading sessions back from the log (replay, recovery, materialization).

A session's events are read with an ordered consumer filtered on its subjects, from the
start up to the last message that existed when the read began (found first with a
direct "last message by subject" lookup, which also tells whether the session exists).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

import msgspec
from nats.aio.msg import Msg
from nats.errors import (
    ConnectionClosedError,
    ConnectionDrainingError,
    ConnectionReconnectingError,
    NoRespondersError,
    OutboundBufferLimitError,
    StaleConnectionError,
)
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError, ServiceUnavailableError

from schemas import blobs, envelope
from schemas.errors import FoldError, LogUnavailable, SessionNotFound
from schemas.events import SCHEMA_VERSION, AnyEvent
from schemas.log import HDR_BLOBS, HDR_SCHEMA, LogConfig, check_session_id
from session.fold import SessionState, fold

# What "JetStream is not there right now" looks like from nats-py (its timeouts are TimeoutErrors): a read
# that meets one is LogUnavailable (503), never taken for an answer (no session, someone else's lease).
UNAVAILABLE: tuple[type[Exception], ...] = (
    TimeoutError, NoRespondersError, ServiceUnavailableError, ConnectionClosedError, ConnectionDrainingError,
    ConnectionReconnectingError, StaleConnectionError, OutboundBufferLimitError)


class SessionLog(msgspec.Struct, frozen=True, kw_only=True):
    events: list[AnyEvent]
    last_stream_seq: int  # where the session's last envelope sits in the stream


def decode_message(data: bytes, headers: dict[str, str] | None) -> list[AnyEvent]:
    """An envelope that holds all of its values (see :func:`decode_msg` for any envelope)."""
    version = int((headers or {}).get(HDR_SCHEMA, SCHEMA_VERSION))
    return envelope.decode(data, version)


async def decode_msg(js: JetStreamContext, cfg: LogConfig, msg: Msg, timeout: float = 30.0) -> list[AnyEvent]:
    """A log message's events; values kept in the object store (:mod:`schemas.blobs`) fetched."""
    headers = msg.headers
    if not headers or HDR_BLOBS not in headers:
        return decode_message(msg.data, headers)
    session_id = cfg.session_of(msg.subject)
    values: dict[bytes, bytes] = {}
    try:
        store = await asyncio.wait_for(js.object_store(cfg.pieces_bucket), timeout)
        for digest in blobs.references(msg.data):
            if digest not in values:
                found = await asyncio.wait_for(store.get(blobs.object_name(session_id, digest)), timeout)
                values[digest] = found.data or b""
    except NotFoundError as exc:
        raise FoldError(f"session {session_id}: a piece of its log is missing from the object store") from exc
    except UNAVAILABLE as exc:
        raise LogUnavailable("the object store did not answer") from exc
    return blobs.decode_with(msg.data, values, int(headers.get(HDR_SCHEMA, SCHEMA_VERSION)))


async def last_stream_seq(js: JetStreamContext, cfg: LogConfig, subject_filter: str, timeout: float = 5.0) -> int:
    """Stream sequence of the last message matching the filter; 0 when there is none."""
    try:
        msg = await asyncio.wait_for(js.get_last_msg(cfg.stream, subject_filter), timeout)
    except NotFoundError:
        return 0
    except UNAVAILABLE as exc:
        raise LogUnavailable("JetStream did not answer a last-message lookup") from exc
    return int(msg.seq or 0)


async def iter_envelopes(
    js: JetStreamContext, cfg: LogConfig, subject_filter: str, until: int, timeout: float = 5.0, *, start: int = 1
) -> AsyncIterator[tuple[int, list[AnyEvent]]]:
    """(stream seq, events) of every message matching the filter, from stream seq ``start`` to ``until``.

    An ordered push consumer delivers into a local buffer from its callback (no per-message
    task, unlike ``next_msg``); the callback waits while the buffer is full, which holds back
    the consumer's flow control, so a slow reader never piles the stream up in memory.
    """
    async with contextlib.aclosing(iter_messages(js, cfg, subject_filter, until, timeout, start=start)) as messages:
        async for seq, msg in messages:  # (aclosing: a reader that stops early unsubscribes at once)
            yield seq, await decode_msg(js, cfg, msg)


async def iter_messages(
    js: JetStreamContext, cfg: LogConfig, subject_filter: str, until: int, timeout: float = 5.0, *, start: int = 1
) -> AsyncIterator[tuple[int, Msg]]:
    """(stream seq, message) of every message matching the filter, undecoded, as :func:`iter_envelopes` reads
    them (an export copies them as they are)."""
    if until <= 0 or start > until:
        return
    reader = _Buffered(timeout)
    config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start) if start > 1 \
        else ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    try:
        sub = await asyncio.wait_for(js.subscribe(subject_filter, ordered_consumer=True, stream=cfg.stream,
                                                  config=config, cb=reader.put), timeout)
    except UNAVAILABLE as exc:
        raise LogUnavailable(f"could not open a reader on {subject_filter}") from exc
    try:
        while True:
            msg = await reader.get(subject_filter)
            seq = stream_seq(msg)
            yield seq, msg
            if seq >= until:
                return
    finally:
        with contextlib.suppress(*UNAVAILABLE):  # a connection that is gone took the subscription with it
            await sub.unsubscribe()


def stream_seq(msg: Msg) -> int:
    """A delivered message's stream sequence, read off its ack subject (cheaper than ``msg.metadata``).

    ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>``, or
    with ``<domain>.<account hash>`` after ``$JS.ACK`` (and a trailing token) in the newer form.
    """
    tokens = (msg.reply or "").split(".")
    if len(tokens) == 9:
        return int(tokens[5])
    if len(tokens) >= 11:
        return int(tokens[7])
    return int(msg.metadata.sequence.stream)


class _Buffered:
    """Messages handed over by a subscription callback, with a bound on how many wait."""

    HIGH, LOW = 1024, 256

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._buffer: deque[Msg] = deque()
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()

    async def put(self, msg: Msg) -> None:
        self._buffer.append(msg)
        self._ready.set()
        if len(self._buffer) >= self.HIGH:
            self._room.clear()
            await self._room.wait()

    async def get(self, what: str) -> Msg:
        if not self._buffer:
            self._ready.clear()
            try:
                async with asyncio.timeout(self._timeout):  # no task per wait, unlike wait_for
                    await self._ready.wait()
            except TimeoutError as exc:
                raise LogUnavailable(f"reading {what} stalled") from exc
        msg = self._buffer.popleft()
        if len(self._buffer) <= self.LOW:
            self._room.set()
        return msg


async def read_session(js: JetStreamContext, cfg: LogConfig, session_id: str, *, until: int | None = None
                       ) -> SessionLog:
    """Every event of a session, in order (up to stream seq ``until`` when given).

    Raises :class:`SessionNotFound` when it has none.
    """
    check_session_id(session_id)
    subject_filter = cfg.session_filter(session_id)
    last = until if until is not None else await last_stream_seq(js, cfg, subject_filter)
    if last == 0:
        raise SessionNotFound(f"no session {session_id!r}", param="session_id")
    events: list[AnyEvent] = []
    async for _, batch in iter_envelopes(js, cfg, subject_filter, last):
        events.extend(batch)
    return SessionLog(events=events, last_stream_seq=last)


async def load_state(js: JetStreamContext, cfg: LogConfig, session_id: str, *, until: int | None = None
                     ) -> tuple[SessionState, int]:
    """A session rebuilt from the log alone, and the stream sequence it was read up to."""
    session_log = await read_session(js, cfg, session_id, until=until)
    state = fold(session_log.events)
    if state is None:  # pragma: no cover - read_session never returns an empty log
        raise SessionNotFound(f"no session {session_id!r}")
    return state, session_log.last_stream_seq
