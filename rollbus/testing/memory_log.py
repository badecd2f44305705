"""The event log in memory: what :class:`eventlog.publisher.JetStreamLog` and the log's readers
(:mod:`eventlog.reader`) do, for unit tests that need no NATS.

:class:`InMemoryLog` keeps what JetStream would keep: one stream of messages (subject, headers,
payload), each payload encoded by the real envelope codec (:mod:`schemas.envelope`), and an object
store for large values (:mod:`schemas.blobs`). ``tests/contract/log_contract.py`` runs one suite
against both logs, so that they cannot drift apart. Its append follows JetStream's rules, in
JetStream's order:

* stream sequence numbers count every message of every session, from 1;
* ``expected_last`` must be the stream sequence of the session's last message (0: none), else
  :class:`OwnershipLost`, and nothing is stored. JetStream checks it *before* its duplicate window,
  so a retry with the ``expected_last`` of the first try is refused as well: a retry after a lost
  acknowledgement succeeds only inside :class:`JetStreamLog` (which reads the stored message back;
  :meth:`InMemoryLog.lose_next_ack` plays that);
* a message whose ``Nats-Msg-Id`` (``<session_id>:<first seq>``) is stored already is not stored
  again: it is acknowledged as a duplicate, with the stream sequence it was stored at;
* an append over ``LogConfig.max_event_bytes`` is split into envelopes that fit; a single event that
  does not fit has its largest values moved to the object store (header ``Rollbus-Blobs``), and is
  refused with :class:`PayloadTooLarge` (nothing stored) if it still does not fit: the one rule both
  logs follow, :func:`schemas.log.fit_envelopes`.

Where it differs: the duplicate window never closes (JetStream forgets a ``Nats-Msg-Id`` after
``LogConfig.duplicate_window_s``), and the transport's failures (timeouts, no responders, refused
credentials) do not happen unless a test asks for one (:meth:`InMemoryLog.fail_next`).

The read side mirrors :mod:`eventlog.reader`: :meth:`InMemoryLog.read_session`,
:meth:`InMemoryLog.load_state` (a :data:`edge.live.Loader`) and :meth:`InMemoryLog.last_stream_seq`
(a :data:`edge.live.Position`).

It is an :class:`eventlog.port.LogPort`, as :class:`eventlog.jetstream.JetStreamPort` is: besides the
appends, a second stream for the ready signals (:meth:`InMemoryLog.publish`, deduplicated by
``Nats-Msg-Id``), durable consumers with JetStream's ack, nak and redelivery rules
(:mod:`rollbus.testing.memory_consumer`), and KV buckets (:class:`rollbus.testing.memory_kv.InMemoryKv`),
so that the projector and the materializer run on it unchanged. :func:`in_memory_service` builds an
edge service on it the way :func:`stack.runtime.build_edge_service` builds one on JetStream.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence

import msgspec

from edge.assemble import build_edge
from edge.engines.base import Engine
from edge.service import EdgeService
from edge.settings import Clock, EdgeSettings
from edge.tokens.incremental import TemplateCodec
from edge.tokens.parsers.base import ToolParser
from eventlog.acks import Ack
from eventlog.port import Delivery
from eventlog.publisher import Appended
from eventlog.reader import LogMessage, SessionLog, decode_message
from rollbus.testing.memory_consumer import (
    DurableConsumer,
    MemorySubscription,
    Signal,
    StoredMessage,
    subject_matches,
)
from rollbus.testing.memory_kv import InMemoryKv
from schemas import blobs, envelope
from schemas.errors import (
    FoldError,
    LogUnavailable,
    OwnershipLost,
    PayloadTooLarge,
    RollbusError,
    SessionNotFound,
)
from schemas.events import SCHEMA_VERSION, AnyEvent, Event
from schemas.log import (
    HDR_BLOBS,
    HDR_EXPECTED_LAST_SUBJECT_SEQ,
    HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT,
    HDR_MSG_ID,
    HDR_SCHEMA,
    MAX_PAYLOAD,
    Envelope,
    LogConfig,
    append_headers,
    check_session_id,
    fit_envelopes,
    msg_id,
)
from session.fold import SessionState, fold

__all__ = ["InMemoryLog", "StoredMessage", "in_memory_service"]


class _Ack(msgspec.Struct, frozen=True):
    seq: int
    duplicate: bool


class _Failure(msgspec.Struct, frozen=True):
    error: RollbusError
    stored: bool


class InMemoryLog:
    """An :class:`eventlog.publisher.EventLog` and its readers, in memory (see the module's docstring)."""

    def __init__(self, cfg: LogConfig | None = None, *, redelivery_delay: float | None = None,
                 max_wait: float | None = None) -> None:
        """``redelivery_delay``: seconds after which a nak'ed message is delivered again, whatever delay the
        nak asked for (None: the nak's own), so that a test of a redelivery takes milliseconds; ``max_wait``:
        the longest a fetch waits for a message, whatever timeout it asked for (None: its own), so that a
        consumer loop notices its stop within milliseconds."""
        self.cfg = cfg if cfg is not None else LogConfig()
        self.messages: list[StoredMessage] = []  # the stream, in order
        self.ready: list[StoredMessage] = []  # the ready stream, in order
        self.pieces: dict[str, bytes] = {}  # the object store: object name -> value
        self.buckets: dict[str, InMemoryKv] = {}
        self.consumers: dict[tuple[str, str], DurableConsumer] = {}  # (stream, durable) -> consumer
        self._sessions: dict[str, list[StoredMessage]] = {}
        self._stored_ids: dict[str, int] = {}  # Nats-Msg-Id -> stream seq (the duplicate window)
        self._ready_ids: dict[str, int] = {}
        self._arrived = Signal()
        self._redelivery_delay = redelivery_delay
        self._max_wait = max_wait
        self._lose_ack = False
        self._failure: _Failure | None = None

    # --- faults -------------------------------------------------------------------------

    def lose_next_ack(self) -> None:
        """The next append's first acknowledgement is lost after the message was stored: as
        :class:`JetStreamLog` recovers from that (its retry is refused, the read-back finds its
        message), the append succeeds, reported as a duplicate."""
        self._lose_ack = True

    def fail_next(self, error: RollbusError, *, stored: bool = False) -> None:
        """The next append raises ``error`` (e.g. :class:`LogUnavailable`: no acknowledgement came),
        its first envelope stored first when ``stored`` (the outcome the edge cannot know)."""
        self._failure = _Failure(error, stored)

    # --- the append path ----------------------------------------------------------------

    async def append(self, session_id: str, events: Sequence[Event], expected_last: int) -> Appended:
        """Append events (consecutive, of one session) after stream sequence ``expected_last``."""
        fitted = fit_envelopes(events, self.cfg.max_event_bytes)
        for fit in fitted:
            self.pieces.update(fit.pieces)  # stored before the envelopes, as JetStreamLog does
        failure, self._failure = self._failure, None
        if failure is not None:
            if failure.stored:
                self._publish(session_id, fitted[0], expected_last)
            raise failure.error
        ack = _Ack(expected_last, False)
        for fit in fitted:
            ack = self._publish(session_id, fit, ack.seq)
        return Appended(stream=self.cfg.stream, stream_seq=ack.seq, duplicate=ack.duplicate, envelopes=len(fitted))

    async def put_pieces(self, session_id: str, pieces: Mapping[bytes, bytes]) -> None:
        """Store values by digest in the object store, as :meth:`JetStreamLog.put_pieces` does."""
        for digest, data in pieces.items():
            self.pieces[blobs.object_name(session_id, digest)] = data

    def _publish(self, session_id: str, fit: Envelope, expected_last: int) -> _Ack:
        """What JetStream does with one publish: the expected-last check, then the duplicate window."""
        batch, payload = fit.events, fit.payload
        if len(payload) > MAX_PAYLOAD:  # the stream's max_msg_size (only with a max_event_bytes above it)
            raise PayloadTooLarge(f"JetStream refused the envelope: {len(payload)} bytes (max_msg_size {MAX_PAYLOAD})")
        lost, self._lose_ack = self._lose_ack, False
        if self.last_seq(session_id) != expected_last:
            raise OwnershipLost(f"session {session_id} was appended to by another writer")
        message_id = msg_id(session_id, batch[0].seq)
        stored = self._stored_ids.get(message_id)
        if stored is not None:
            return _Ack(stored, True)
        headers = append_headers(self.cfg, session_id, batch[0].seq, batch[-1].seq, expected_last,
                                 schema=SCHEMA_VERSION, blobs=len(fit.pieces))
        message = StoredMessage(seq=len(self.messages) + 1, subject=self.cfg.subject(session_id,
                                envelope.kind_of(batch)), headers=headers, data=payload)
        self.messages.append(message)
        self._sessions.setdefault(session_id, []).append(message)
        self._stored_ids[message_id] = message.seq
        self._arrived.notify()
        return _Ack(message.seq, lost)

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str], *,
                      session_id: str | None = None) -> Ack:
        """One message as it is, on the ready stream (a ready signal), deduplicated by its ``Nats-Msg-Id``;
        on the log's stream, an append of one envelope (its headers say the session and expected last)."""
        if subject_matches(self.cfg.subjects, subject):
            return self._publish_raw(subject, payload, headers)
        if not subject_matches(self.cfg.ready_subjects, subject):
            raise LogUnavailable(f"no stream takes {subject} (the log is not provisioned for it)")
        message_id = headers.get(HDR_MSG_ID)
        if message_id is not None and message_id in self._ready_ids:
            return Ack(stream=self.cfg.ready_stream, seq=self._ready_ids[message_id], duplicate=True)
        message = StoredMessage(seq=len(self.ready) + 1, subject=subject, headers=dict(headers), data=payload)
        self.ready.append(message)
        if message_id is not None:
            self._ready_ids[message_id] = message.seq
        self._arrived.notify()
        return Ack(stream=self.cfg.ready_stream, seq=message.seq)

    def _publish_raw(self, subject: str, payload: bytes, headers: dict[str, str]) -> Ack:
        """A message on the log's stream under JetStream's rules: expected last subject sequence, then
        the duplicate window."""
        session_id = self.cfg.session_of(subject)
        expected = headers.get(HDR_EXPECTED_LAST_SUBJECT_SEQ)
        if expected is not None:
            scope = headers.get(HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT, subject)
            last = max((m.seq for m in self.messages if subject_matches(scope, m.subject)), default=0)
            if last != int(expected):
                raise OwnershipLost(f"session {session_id} was appended to by another writer")
        message_id = headers.get(HDR_MSG_ID)
        if message_id is not None and message_id in self._stored_ids:
            return Ack(stream=self.cfg.stream, seq=self._stored_ids[message_id], duplicate=True)
        message = StoredMessage(seq=len(self.messages) + 1, subject=subject, headers=dict(headers), data=payload)
        self.messages.append(message)
        self._sessions.setdefault(session_id, []).append(message)
        if message_id is not None:
            self._stored_ids[message_id] = message.seq
        self._arrived.notify()
        return Ack(stream=self.cfg.stream, seq=message.seq)

    # --- consumers and KV -----------------------------------------------------------------

    async def subscribe(self, stream: str, subject: str, durable: str, *, ack_wait: float,
                        max_ack_pending: int) -> MemorySubscription:
        """Bind to the durable consumer (created now, or updated: ``ack_wait``, ``max_ack_pending``)."""
        streams = {self.cfg.stream: self.messages, self.cfg.ready_stream: self.ready}
        if stream not in streams:
            raise LogUnavailable(f"no stream {stream}")
        consumer = self.consumers.get((stream, durable))
        if consumer is None:
            consumer = self.consumers[(stream, durable)] = DurableConsumer(
                streams[stream], subject, ack_wait=ack_wait, max_ack_pending=max_ack_pending,
                arrived=self._arrived, redelivery_delay=self._redelivery_delay)
        consumer.ack_wait, consumer.max_ack_pending = ack_wait, max_ack_pending
        return MemorySubscription(consumer, self._arrived, max_wait=self._max_wait)

    async def image(self, session_id: str, digest: str) -> bytes | None:
        return self.pieces.get(blobs.object_name(session_id, bytes.fromhex(digest)))

    def kv(self, bucket: str, *, timeout: float = 5.0) -> InMemoryKv:
        """The bucket (made on first use: a provisioned log has them all)."""
        return self.buckets.setdefault(bucket, InMemoryKv(bucket))

    async def close(self) -> None:
        return None

    # --- the read side ------------------------------------------------------------------

    def last_seq(self, session_id: str) -> int:
        """Stream sequence of the session's last message; 0 when it has none."""
        stored = self._sessions.get(session_id)
        return stored[-1].seq if stored else 0

    async def last_stream_seq(self, session_id: str) -> int:
        """:meth:`last_seq`, as a :data:`edge.live.Position`."""
        return self.last_seq(session_id)

    async def decode(self, msg: Delivery) -> list[AnyEvent]:
        """A delivered message's events (as ``reader.decode_msg``)."""
        return self._decode(StoredMessage(seq=0, subject=msg.subject, headers=msg.headers or {}, data=msg.data))

    def _decode(self, message: StoredMessage) -> list[AnyEvent]:
        """A message's events, values kept in the object store put back (as ``reader.decode_msg``)."""
        if HDR_BLOBS not in message.headers:
            return decode_message(message.data, message.headers)
        session_id = self.cfg.session_of(message.subject)
        values = {}
        for digest in blobs.references(message.data):
            value = self.pieces.get(blobs.object_name(session_id, digest))
            if value is None:
                raise FoldError(f"session {session_id}: a piece of its log is missing from the object store")
            values[digest] = value
        return blobs.decode_with(message.data, values, int(message.headers.get(HDR_SCHEMA, SCHEMA_VERSION)))

    async def read_session(self, session_id: str, *, until: int | None = None) -> SessionLog:
        """Every event of a session, in order (up to stream seq ``until`` when given); raises
        :class:`SessionNotFound` when it has none."""
        check_session_id(session_id)
        last = until if until is not None else self.last_seq(session_id)
        if last == 0:
            raise SessionNotFound(f"no session {session_id!r}", param="session_id")
        events = [event for message in self._sessions.get(session_id, ()) if message.seq <= last
                  for event in self._decode(message)]
        return SessionLog(events=events, last_stream_seq=last)

    async def last_message(self, subject: str) -> LogMessage | None:
        """The stream's last message on ``subject`` (a filter); None when there is none."""
        found = next((m for m in reversed(self.messages) if subject_matches(subject, m.subject)), None)
        return None if found is None else LogMessage(found.subject, found.seq, 0, found.data, dict(found.headers))

    async def envelopes(self, session_id: str) -> AsyncIterator[tuple[int, list[AnyEvent]]]:
        """(stream seq, events) of each of the session's envelopes, up to its last one now."""
        for message in list(self._sessions.get(session_id, ())):
            yield message.seq, self._decode(message)

    async def load_state(self, session_id: str, *, until: int | None = None) -> tuple[SessionState, int]:
        """A session rebuilt from the log alone, and the stream sequence it was read up to (a
        :data:`edge.live.Loader`)."""
        session_log = await self.read_session(session_id, until=until)
        state = fold(session_log.events)
        if state is None:  # pragma: no cover - read_session never returns an empty log
            raise SessionNotFound(f"no session {session_id!r}")
        return state, session_log.last_stream_seq


def in_memory_service(engine: Engine, *, log: InMemoryLog | None = None, settings: EdgeSettings | None = None,
                      codec: tuple[TemplateCodec, ToolParser] | None = None, clock: Clock = time.time) -> EdgeService:
    """An :class:`EdgeService` on an in-memory log, wired by :func:`edge.assemble.build_edge` as
    :func:`stack.runtime.build_edge_service` wires one on JetStream, less what needs NATS: no leases (the log's
    sequence check alone keeps one writer per session), no session index, no projections (a summary is a
    replay), no metrics.

    ``log``: a log shared with other services (an edge restarted, or another one); ``codec``: the codec and
    parser for ``settings.tokenizer`` / ``tool_format`` when already loaded (else :func:`load_codec`)."""
    settings = settings if settings is not None else EdgeSettings()
    log = log if log is not None else InMemoryLog(settings.log)
    return build_edge(settings, log, engine, codec=codec, clock=clock)
