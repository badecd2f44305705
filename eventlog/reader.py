"""Reading sessions back from the log (replay, recovery, materialization).

Two ways to read, by what is read:

* **One session** (a filter on ``<prefix>.<session_id>.>``): JetStream's *direct get* in batches
  (the stream has ``allow_direct``): a request names the next stream sequence, the session's
  subjects, a batch size and the last sequence wanted, and the server answers up to a batch of
  stored messages and an end-of-batch status. It keeps no state on the server between two
  requests: no consumer is created, so any number of sessions can be read at once (a verl step
  ends a thousand sessions within a second; JetStream allows 1,000 consumers per stream by
  default, and an ephemeral consumer outlives its reader by seconds). nats-py has no batched
  direct get, so its request is published with the client's public ``publish`` and answered on
  an inbox subscription (:class:`_DirectReader`).
* **The whole stream** (replay of every session, export, re-materialization): one ordered push
  consumer per scan, which streams with flow control and costs a third of the client CPU a
  message of direct gets (whose answers carry six more headers to parse).

Either way a read runs from the start (or ``start``) up to the last message that existed when the
read began (found first with a "last message by subject" lookup, which also tells whether the
session exists). On a replicated stream a direct get may be answered by a replica that is behind;
a read that ends before that last message waits for the replica to catch up, then fails as
:class:`LogUnavailable` (transient): it never returns part of a session as if it were whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import msgspec
from nats.aio.client import Client
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
from nats.js.errors import NoStreamResponseError, NotFoundError, ServiceUnavailableError

from schemas import blobs, envelope
from schemas.errors import FoldError, LogUnavailable, SessionNotFound
from schemas.events import SCHEMA_VERSION, AnyEvent
from schemas.log import HDR_BLOBS, HDR_SCHEMA, LogConfig, check_session_id
from session.fold import SessionState, fold

# What "JetStream is not there right now" looks like from nats-py (its timeouts are TimeoutErrors): a read, or a
# KV write (a lease, a session index claim, a projection), that meets one is LogUnavailable (503, retryable),
# never taken for an answer (no session, someone else's lease). NoStreamResponseError is nats-py's no-responders
# for a JetStream publish (a KV put or update): no stream leader takes the subject, e.g. for the seconds a
# cluster elects one after a node died.
UNAVAILABLE: tuple[type[Exception], ...] = (
    TimeoutError, NoRespondersError, NoStreamResponseError, ServiceUnavailableError, ConnectionClosedError,
    ConnectionDrainingError, ConnectionReconnectingError, StaleConnectionError, OutboundBufferLimitError)


class SessionLog(msgspec.Struct, frozen=True, kw_only=True):
    events: list[AnyEvent]
    last_stream_seq: int  # where the session's last envelope sits in the stream


class Stored(Protocol):
    """What decoding needs of a log message: a delivered ``nats.aio.msg.Msg`` or a :class:`LogMessage`."""

    @property
    def subject(self) -> str: ...
    @property
    def data(self) -> bytes: ...
    @property
    def headers(self) -> dict[str, str] | None: ...


# The headers a direct get adds to the stored message's own (left out of LogMessage.headers).
_DIRECT_HEADERS = frozenset({"Nats-Stream", "Nats-Subject", "Nats-Sequence", "Nats-Time-Stamp", "Nats-Num-Pending",
                             "Nats-Last-Sequence", "Nats-UpTo-Sequence"})


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class LogMessage:
    """A stored message as read back: its subject, stream sequence, time (ns since the epoch), payload and
    its own headers (whichever way it was read)."""

    __slots__ = ("data", "headers", "seq", "subject", "time_ns")

    def __init__(self, subject: str, seq: int, time_ns: int, data: bytes, headers: dict[str, str] | None) -> None:
        self.subject = subject
        self.seq = seq
        self.time_ns = time_ns
        self.data = data
        self.headers = headers

    @property
    def timestamp(self) -> dt.datetime:
        return dt.datetime.fromtimestamp(self.time_ns / 1e9, dt.UTC)


def decode_message(data: bytes, headers: Mapping[str, str] | None) -> list[AnyEvent]:
    """An envelope that holds all of its values (see :func:`decode_msg` for any envelope)."""
    version = int((headers or {}).get(HDR_SCHEMA, SCHEMA_VERSION))
    return envelope.decode(data, version)


async def decode_msg(js: JetStreamContext, cfg: LogConfig, msg: Stored, timeout: float = 30.0) -> list[AnyEvent]:
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
    """Stream sequence of the last message matching the filter; 0 when there is none (asked of the stream's
    leader, so it is never behind)."""
    try:
        msg = await asyncio.wait_for(js.get_last_msg(cfg.stream, subject_filter), timeout)
    except NotFoundError:
        return 0
    except UNAVAILABLE as exc:
        raise LogUnavailable("JetStream did not answer a last-message lookup") from exc
    return int(msg.seq or 0)


async def next_message(js: JetStreamContext, cfg: LogConfig, subject_filter: str, seq: int,
                       timeout: float = 5.0) -> LogMessage | None:
    """The stream's first message matching the filter at or after stream sequence ``seq``; None when there is
    none (asked of the stream's leader)."""
    try:
        msg = await asyncio.wait_for(js.get_msg(cfg.stream, seq=seq, subject=subject_filter, next=True), timeout)
    except NotFoundError:
        return None
    except UNAVAILABLE as exc:
        raise LogUnavailable("JetStream did not answer a message lookup") from exc
    return LogMessage(msg.subject or subject_filter, int(msg.seq or 0), _time_ns(msg.time), msg.data or b"",
                      msg.headers)


def _time_ns(time: object) -> int:
    """A stored message's time in ns since the epoch: nats-py parses it into a datetime (to the microsecond)."""
    if isinstance(time, dt.datetime):
        return (time - _EPOCH) // dt.timedelta(microseconds=1) * 1000
    return parse_time_ns(str(time))


async def iter_envelopes(
    js: JetStreamContext, cfg: LogConfig, subject_filter: str, until: int, timeout: float = 5.0, *, start: int = 1
) -> AsyncIterator[tuple[int, list[AnyEvent]]]:
    """(stream seq, events) of every message matching the filter, from stream seq ``start`` to ``until``."""
    async with contextlib.aclosing(iter_messages(js, cfg, subject_filter, until, timeout, start=start)) as messages:
        async for seq, msg in messages:  # (aclosing: a reader that stops early unsubscribes at once)
            yield seq, await decode_msg(js, cfg, msg)


async def iter_messages(
    js: JetStreamContext, cfg: LogConfig, subject_filter: str, until: int, timeout: float = 5.0, *, start: int = 1
) -> AsyncIterator[tuple[int, LogMessage]]:
    """(stream seq, message) of every message matching the filter, undecoded, as :func:`iter_envelopes` reads
    them (an export copies them as they are): by direct gets for anything narrower than the whole stream,
    by an ordered consumer for the whole stream (see the module's docstring)."""
    if until <= 0 or start > until:
        return
    read = _scan if subject_filter == cfg.subjects else _DirectReader(js, cfg.stream, timeout).read
    async with contextlib.aclosing(read(js, cfg, subject_filter, until, timeout, start)) as messages:
        async for msg in messages:
            yield msg.seq, msg


async def _scan(js: JetStreamContext, cfg: LogConfig, subject_filter: str, until: int, timeout: float,
                start: int) -> AsyncIterator[LogMessage]:
    """The stream's messages through an ordered push consumer, delivered into a local buffer from its
    callback (no per-message task, unlike ``next_msg``); the callback waits while the buffer is full, which
    holds back the consumer's flow control, so a slow reader never piles the stream up in memory."""
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
            seq, time_ns = _delivered(msg)
            yield LogMessage(msg.subject, seq, time_ns, msg.data, msg.headers)
            if seq >= until:
                return
    finally:
        with contextlib.suppress(*UNAVAILABLE):  # a connection that is gone took the subscription with it
            await sub.unsubscribe()


def _delivered(msg: Msg) -> tuple[int, int]:
    """A delivered message's (stream sequence, time in ns), read off its ack subject (cheaper than
    ``msg.metadata``): ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>``,
    or with ``<domain>.<account hash>`` after ``$JS.ACK`` (and a trailing token) in the newer form."""
    tokens = (msg.reply or "").split(".")
    if len(tokens) == 9:
        return int(tokens[5]), int(tokens[7])
    if len(tokens) >= 11:
        return int(tokens[7]), int(tokens[9])
    meta = msg.metadata
    return int(meta.sequence.stream), int(meta.timestamp.timestamp() * 1e9)


def stream_seq(msg: Msg) -> int:
    """A delivered message's stream sequence (see :func:`_delivered`)."""
    return _delivered(msg)[0]


def parse_time_ns(text: str) -> int:
    """JetStream's RFC 3339 time with nanoseconds (``2026-12-02T06:27:36.626471178Z``) in ns since the epoch."""
    head, _, frac = text.rstrip("Z").partition(".")
    seconds = int(dt.datetime.fromisoformat(head).replace(tzinfo=dt.UTC).timestamp())
    return seconds * 1_000_000_000 + int(f"{frac[:9]:0<9}")


class _DirectReader:
    """A filter's messages by batched direct gets (``$JS.API.DIRECT.GET.<stream>``), answered on an inbox.

    The request is the JetStream API's documented JSON (``seq``, ``next_by_subj``, ``batch``, ``max_bytes``,
    ``up_to_seq``); the answers are the stored messages with ``Nats-Sequence``, ``Nats-Subject`` and
    ``Nats-Time-Stamp`` headers, then a ``204 EOB`` status (or ``404``: none at or past ``seq``). The next
    batch is asked for once this one is read, so at most a batch is held in memory."""

    BATCH = 256
    MAX_BYTES = 8 * 1024 * 1024  # a batch stops early past this many bytes (a message is at most 1 MiB)
    CATCH_UP_S = 0.05  # between tries while a replica that answered is behind the leader

    def __init__(self, js: JetStreamContext, stream: str, timeout: float) -> None:
        self._nc = client_of(js)
        self._api = f"{api_prefix(js)}.DIRECT.GET.{stream}"
        self._timeout = timeout

    async def read(self, js: JetStreamContext, cfg: LogConfig, subject_filter: str, until: int, timeout: float,
                   start: int) -> AsyncIterator[LogMessage]:
        answers = _Buffered(self._timeout)
        inbox = self._nc.new_inbox()
        try:
            sub = await self._nc.subscribe(inbox, cb=answers.put)
        except UNAVAILABLE as exc:
            raise LogUnavailable(f"could not open a reader on {subject_filter}") from exc
        try:
            seq, behind_since = start, None
            while seq <= until:
                got = 0
                async for msg in self._batch(answers, inbox, subject_filter, seq, until):
                    got += 1
                    seq = msg.seq + 1
                    yield msg
                if seq > until:
                    return
                behind_since = await self._wait_behind(behind_since, got, subject_filter, seq, until)
        finally:
            with contextlib.suppress(*UNAVAILABLE):
                await sub.unsubscribe()

    async def _batch(self, answers: _Buffered, inbox: str, subject_filter: str, seq: int, until: int
                     ) -> AsyncIterator[LogMessage]:
        request = msgspec.json.encode({"seq": seq, "next_by_subj": subject_filter, "batch": self.BATCH,
                                       "max_bytes": self.MAX_BYTES, "up_to_seq": until})
        try:
            await self._nc.publish(self._api, request, reply=inbox)
        except UNAVAILABLE as exc:
            raise LogUnavailable(f"could not read {subject_filter}") from exc
        while True:
            msg = await answers.get(subject_filter)
            headers = msg.headers or {}
            status = headers.get("Status") if not msg.data else None
            if status is not None:
                if status in ("204", "404"):  # the end of the batch; or nothing (more) at or past seq
                    return
                raise LogUnavailable(f"JetStream refused a read of {subject_filter}: {status} "
                                     f"{headers.get('Description', '')}".rstrip())
            stored = _stored_message(msg, headers)
            yield stored
            if stored.seq >= until:
                return

    async def _wait_behind(self, since: float | None, got: int, subject_filter: str, seq: int, until: int
                           ) -> float | None:
        """A batch that ended before ``until``: a full one is followed by the next at once; an early end means
        the replica that answered is behind (or the message at ``until`` went meanwhile): wait a moment and
        ask again, for at most the read's timeout. Returns when the wait began (None: not waiting)."""
        if got:
            return None
        loop = asyncio.get_running_loop()
        since = loop.time() if since is None else since
        if loop.time() - since > self._timeout:
            raise LogUnavailable(f"reading {subject_filter}: the log ends at stream seq {seq - 1}, before {until}")
        await asyncio.sleep(self.CATCH_UP_S)
        return since


def _stored_message(msg: Msg, headers: dict[str, str]) -> LogMessage:
    own = {k: v for k, v in headers.items() if k not in _DIRECT_HEADERS}
    return LogMessage(headers["Nats-Subject"], int(headers["Nats-Sequence"]),
                      parse_time_ns(headers["Nats-Time-Stamp"]), msg.data, own or None)


def client_of(js: JetStreamContext) -> Client:
    """The connection a JetStream context publishes on. nats-py keeps it as ``_nc`` and offers no public
    accessor; this is the one place rollbus reads it (a test fails here first if nats-py renames it)."""
    nc = getattr(js, "_nc", None)
    if not isinstance(nc, Client):
        raise TypeError("nats-py's JetStreamContext no longer keeps its connection as _nc: see eventlog.reader")
    return nc


def api_prefix(js: JetStreamContext) -> str:
    """The JetStream API subject prefix of the context (``$JS.API``, or ``$JS.<domain>.API``)."""
    prefix = getattr(js, "_prefix", None)
    if not isinstance(prefix, str):
        raise TypeError("nats-py's JetStreamContext no longer keeps its API prefix as _prefix: see eventlog.reader")
    return prefix


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
