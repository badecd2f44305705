"""Appending a session's events to JetStream, under the log rules.

* An append is one envelope (one message) per call, split only when it would exceed
  the payload limit; ``Nats-Msg-Id = <session_id>:<first seq>`` so a retry is a no-op.
* The per-session expected-last-subject-sequence check (filtered on the session's
  subjects) makes a stale writer fail with :class:`OwnershipLost` instead of
  interleaving.
* Every publish goes through nats-py's public ``Client`` API (:class:`eventlog.acks.AckedPublisher`,
  chosen over ``js.publish`` by ``ops/bench/append_path.py``) and is bounded by a timer. A publish
  that timed out may still have been stored, so it is retried with the same headers. JetStream
  checks the expected last sequence before its duplicate window, so a retry of a stored
  publish is refused as "wrong last sequence": then the session's last message is read,
  and if it is this very envelope (same ``Nats-Msg-Id``) the retry succeeded after all.
* A single event too large for one message has its largest values moved to the object
  store first (:mod:`schemas.blobs`), and is refused (413) only if it still does not fit
  (the one splitting rule for every writer: :func:`schemas.log.fit_envelopes`).

Errors
------

What nats-py raises (or reports as the client's last error) on the append path is mapped
to the domain's errors once, in :data:`APPEND_ERRORS` and :data:`REFUSALS` (as httpx's
``map_httpcore_exceptions`` maps httpcore's); in short::

    PublishRejected 10071 (wrong last sequence)  OwnershipLost, unless the read-back finds this envelope
                                                 (LogUnavailable when the read-back is not answered)
    PublishRejected 10054 (over max_msg_size)    PayloadTooLarge
    PublishRejected with code 503                retried (JetStream temporarily unavailable)
    PublishRejected, any other                   LogUnavailable at once
    MaxPayloadError (over the server's max)      PayloadTooLarge
    PublishRefused (a permissions violation)     LogUnavailable at once
    msgspec.DecodeError (not an acknowledgement) LogUnavailable at once
    ConnectionClosedError, ...DrainingError      LogUnavailable at once (the client is closing)
    TimeoutError, NoResponders, OutboundBufferLimitError, ConnectionReconnectingError, OSError
                                                 retried with the same Nats-Msg-Id, ``attempts`` times
    any other nats-py error                      LogUnavailable at once
    not connected, and the client's last error is a refusal (REFUSALS: credentials refused,
    expired or revoked; TLS required or failed)  LogUnavailable at once, naming it

No responders (no stream takes the subject) is retried: JetStream answers so while it starts
(after a server restart, before it has restored its streams); a log that was never provisioned
fails after the attempts, with that in the message.

A dead connection is the client's to detect: its pings (``ping_interval`` and
``max_outstanding_pings``, set in :func:`stack.provision.connect`) find a half-open link
within seconds and it reconnects. A publish waiting on the dead link then fails at once
(:class:`eventlog.acks.AckedPublisher` sees its connection gone) and its retry goes out on the new
connection, buffered by nats-py while it reconnects.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import msgspec
from nats.aio.client import Client
from nats.errors import (
    AuthorizationError,
    ConnectionClosedError,
    ConnectionDrainingError,
    ConnectionReconnectingError,
    InvalidUserCredentialsError,
    MaxPayloadError,
    OutboundBufferLimitError,
    SecureConnFailedError,
    SecureConnRequiredError,
    SecureConnWantedError,
    StaleConnectionError,
)
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_incrementing

from eventlog.acks import Ack, AckedPublisher
from eventlog.retrying import replay_first
from schemas import blobs, envelope
from schemas.errors import (
    LogUnavailable,
    NoResponders,
    OwnershipLost,
    PayloadTooLarge,
    PublishRefused,
    PublishRejected,
    RollbusError,
)
from schemas.events import SCHEMA_VERSION, Event
from schemas.log import (
    HDR_MSG_ID,
    LogConfig,
    append_headers,
    fit_envelopes,
)

log = logging.getLogger(__name__)

WRONG_LAST_SEQUENCE = 10071  # JSStreamWrongLastSequenceErrF
MESSAGE_TOO_LARGE = 10054  # JSStreamMessageExceedsMaximumErr: over the stream's max_msg_size
SERVICE_UNAVAILABLE = 503  # the API error's code: "JetStream system temporarily unavailable"

# What an error on the append path means: the domain error the append fails with at once,
# or None: transient, retried with the same Nats-Msg-Id. The first row that matches wins.
Outcome = Callable[[BaseException], RollbusError | None]
Kinds = type[BaseException] | tuple[type[BaseException], ...]


def _rejected(exc: BaseException) -> RollbusError | None:
    error = exc.error if isinstance(exc, PublishRejected) else None
    if error is not None and error.err_code == MESSAGE_TOO_LARGE:
        return PayloadTooLarge(f"JetStream refused the envelope: {error.description}")
    if error is not None and error.code == SERVICE_UNAVAILABLE:
        return None
    return LogUnavailable(f"JetStream rejected the append: {exc}")


def _transient(exc: BaseException) -> None:
    return None


APPEND_ERRORS: tuple[tuple[Kinds, Outcome], ...] = (
    (PublishRejected, _rejected),  # (but wrong last sequence is the retry loop's: it needs the read-back)
    (MaxPayloadError, lambda exc: PayloadTooLarge(
        "an envelope is over the NATS server's max_payload; lower the log's max_event_bytes or raise max_payload")),
    (PublishRefused, lambda exc: LogUnavailable(f"NATS refused the append: {exc}")),
    (msgspec.DecodeError, lambda exc: LogUnavailable(
        f"JetStream's reply to the append is not an acknowledgement: {exc}")),
    ((ConnectionClosedError, ConnectionDrainingError), lambda exc: LogUnavailable(
        f"the NATS connection is closed ({exc})")),
    ((TimeoutError, NoResponders, OutboundBufferLimitError, ConnectionReconnectingError, StaleConnectionError,
      OSError), _transient),  # (TimeoutError: nats-py's too, which subclasses it)
    (NatsError, lambda exc: LogUnavailable(f"NATS refused the append: {exc!r}")),
)
_CAUGHT = tuple(kind for kinds, _ in APPEND_ERRORS for kind in (kinds if isinstance(kinds, tuple) else (kinds,)))

# Errors of the client's (re)connects that no retry of an append overcomes: (type, or a phrase of
# nats-py's lower-cased text of the server's -ERR), and what to tell the operator.
REFUSALS: tuple[tuple[type[BaseException] | str, str], ...] = (
    (AuthorizationError, "the NATS server refused the edge's credentials"),
    (InvalidUserCredentialsError, "the edge's NATS credentials file is invalid"),
    ("authorization violation", "the NATS server refused the edge's credentials"),
    ("authentication expired", "the edge's NATS credentials have expired"),
    ("authentication revoked", "the edge's NATS credentials were revoked"),
    (SecureConnRequiredError, "the NATS server requires TLS"),
    ("tls required", "the NATS server requires TLS"),
    (SecureConnWantedError, "the edge requires TLS and the NATS server does not offer it"),
    (SecureConnFailedError, "the TLS handshake with the NATS server failed"),
    (ssl.SSLError, "the TLS handshake with the NATS server failed"),
)


RETRY_WAIT_S = 0.05  # an append's retries wait 0.05 s, 0.1 s, 0.15 s, ...


# Not in schemas.errors with every other exception, and no RollbusError: a private signal from one attempt to
# JetStreamLog.publish's retry loop, raised and caught inside that class only. Were it a RollbusError, an
# ``except RollbusError`` could take a retry signal for a failure.
class _Again(Exception):
    """An attempt of :meth:`JetStreamLog.publish` that may be retried (the failure is its ``__cause__``)."""


def append_outcome(exc: BaseException) -> RollbusError | None:
    """The domain error an append fails with at once for ``exc`` (one of :data:`APPEND_ERRORS`' kinds),
    or None when it is retried."""
    return next(outcome(exc) for kinds, outcome in APPEND_ERRORS if isinstance(exc, kinds))


def refusal(error: BaseException | None) -> str | None:
    """Why the NATS server refuses the client for good, when ``error`` (its last) says so."""
    if error is None:
        return None
    text = str(error).lower()
    for match, meaning in REFUSALS:
        if (match in text) if isinstance(match, str) else isinstance(error, match):
            return f"{meaning} ({error})"
    return None


class Appended(msgspec.Struct, frozen=True, kw_only=True):
    """The log's acknowledgement of an append: where the last envelope landed."""

    stream: str
    stream_seq: int
    duplicate: bool
    envelopes: int


class EventLog(Protocol):
    """The seam the edge writes through (JetStream in production, in-memory in unit tests)."""

    async def append(self, session_id: str, events: Sequence[Event], expected_last: int) -> Appended: ...

    async def put_pieces(self, session_id: str, pieces: Mapping[bytes, bytes]) -> None:
        """Store values (sha256 digest -> bytes) of the session in the object store, for events appended after
        to reference by digest (an image's bytes: :class:`schemas.events.ImageRef`)."""
        ...


class JetStreamLog:
    """The event log on JetStream, written through the nats-py client ``nc``."""

    def __init__(self, nc: Client, cfg: LogConfig, *, timeout: float = 5.0, attempts: int = 4) -> None:
        """``timeout``: how long one attempt waits for its acknowledgement; ``attempts``: how many
        an append makes, with the same ``Nats-Msg-Id``, before it fails with :class:`LogUnavailable`."""
        self._nc = nc
        self._js = nc.jetstream()
        self._publisher = AckedPublisher(nc)
        self._cfg = cfg
        self._timeout = timeout
        self._attempts = attempts

    async def append(self, session_id: str, events: Sequence[Event], expected_last: int) -> Appended:
        """Append events (consecutive, of one session) after stream sequence ``expected_last``: in
        envelopes under the limit (:func:`schemas.log.fit_envelopes`), their object-store values first."""
        fitted = fit_envelopes(events, self._cfg.max_event_bytes)
        pieces = {name: data for fit in fitted for name, data in fit.pieces.items()}
        if pieces:
            await self._store_pieces(pieces)
        for fit in fitted[:-1]:
            expected_last = (await self._publish(session_id, fit.events, fit.payload, expected_last,
                                                 len(fit.pieces))).seq
        last = fitted[-1]
        ack = await self._publish(session_id, last.events, last.payload, expected_last, len(last.pieces))
        return Appended(stream=ack.stream, stream_seq=ack.seq, duplicate=ack.duplicate, envelopes=len(fitted))

    async def put_pieces(self, session_id: str, pieces: Mapping[bytes, bytes]) -> None:
        """Store values by digest in the pieces bucket, under ``<session_id>/<sha256 hex>`` (:mod:`schemas.blobs`),
        before the events that reference them are appended. One the bucket holds already (named by its digest: the
        same bytes) is left as it is, so a reader of it never meets it being rewritten (an edge that took the
        session over stores again what it did not see stored)."""
        await self._store_pieces({blobs.object_name(session_id, digest): data for digest, data in pieces.items()},
                                 keep_stored=True)

    async def _store_pieces(self, pieces: Mapping[str, bytes], *, keep_stored: bool = False) -> None:
        """Put ``pieces`` (object name -> bytes) in the pieces bucket; ``keep_stored``: leave one it holds already."""
        try:
            store = await asyncio.wait_for(self._js.object_store(self._cfg.pieces_bucket), self._timeout)
            for name, data in pieces.items():
                if keep_stored:
                    try:
                        await asyncio.wait_for(store.get_info(name), self._timeout)
                        continue
                    except NotFoundError:  # (ObjectNotFoundError and ObjectDeletedError are NotFoundErrors)
                        pass
                await asyncio.wait_for(store.put(name, data), self._timeout + len(data) / 10e6)
        except (TimeoutError, NatsError) as exc:
            raise LogUnavailable(f"could not store a piece in the object store: {exc!r}") from exc

    async def _publish(self, session_id: str, batch: Sequence[Event], payload: bytes, expected_last: int,
                       moved: int = 0) -> Ack:
        headers = append_headers(self._cfg, session_id, batch[0].seq, batch[-1].seq, expected_last,
                                 schema=SCHEMA_VERSION, blobs=moved)
        return await self.publish(self._cfg.subject(session_id, envelope.kind_of(batch)), payload, headers,
                                  session_id=session_id)

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str], *,
                      session_id: str | None = None) -> Ack:
        """Publish one message as it is, under the append's rules: acknowledged, retried with the same
        headers (so the same ``Nats-Msg-Id``), errors mapped as :data:`APPEND_ERRORS` says. With an
        expected-last-sequence header, a refusal is :class:`OwnershipLost`, unless ``session_id``'s
        last message is this very one (a retry of a stored attempt). Every writer of the log
        publishes through here: the edge's appends, the quarantine, an import, the ready signals."""
        try:  # the first try outside tenacity: this is every append's path
            return await self._try(subject, payload, headers, session_id, 1)
        except _Again as again:
            failure: _Again = again
        if self._attempts > 1:
            retrying = AsyncRetrying(stop=stop_after_attempt(self._attempts), retry=retry_if_exception_type(_Again),
                                     wait=wait_incrementing(start=RETRY_WAIT_S, increment=RETRY_WAIT_S), reraise=True)
            try:
                return await replay_first(retrying, failure, lambda attempt: self._try(subject, payload, headers,
                                                                                       session_id, attempt))
            except _Again as again:
                failure = again
        self._refuse_if_refused()
        last = failure.__cause__
        why = ("no stream takes the subject: JetStream is not ready, or the log is not provisioned"
               if isinstance(last, NoResponders) else f"the last failure: {last!r}")
        raise LogUnavailable(f"JetStream did not acknowledge the append to {subject} in {self._attempts} attempts "
                             f"of {self._timeout}s ({why})") from last

    async def _try(self, subject: str, payload: bytes, headers: dict[str, str], session_id: str | None,
                   attempt: int) -> Ack:
        """One attempt of :meth:`publish`; :class:`_Again` (its ``__cause__`` the failure) when it may be retried."""
        self._refuse_if_refused()
        try:
            return await self._publisher.publish(subject, payload, headers, self._timeout)
        except PublishRejected as exc:
            if exc.error.err_code != WRONG_LAST_SEQUENCE:
                failure, last = append_outcome(exc), exc
            elif attempt > 1 and session_id is not None and headers.get(HDR_MSG_ID) and \
                    (stored := await self._stored_last(session_id, headers[HDR_MSG_ID])):
                return stored  # the timed-out attempt was stored
            else:
                raise OwnershipLost(f"session {session_id or subject} was appended to by another writer") from exc
        except _CAUGHT as exc:
            failure, last = append_outcome(exc), exc
        if failure is not None:
            raise failure from last
        log.warning("append to %s failed (attempt %d/%d): %r", subject, attempt, self._attempts, last)
        raise _Again from last

    def _refuse_if_refused(self) -> None:
        """Fail at once while the client is cut off by a refusal (bad credentials, TLS): no retry helps."""
        if not self._nc.is_connected and (why := refusal(self._nc.last_error)) is not None:
            raise LogUnavailable(f"NATS is unavailable: {why}")

    async def close(self) -> None:
        await self._publisher.close()

    async def _stored_last(self, session_id: str, message_id: str) -> Ack | None:
        """The session's last message as an acknowledgement, if it carries ``message_id``; a read-back
        JetStream does not answer is :class:`LogUnavailable` (whether the append was stored is unknown,
        so it is not taken for another writer's)."""
        try:
            last = await asyncio.wait_for(
                self._js.get_last_msg(self._cfg.stream, self._cfg.session_filter(session_id)), self._timeout)
        except NotFoundError:
            return None
        except (NatsError, TimeoutError) as exc:
            raise LogUnavailable(f"could not read back the last message of session {session_id}: {exc!r}") from exc
        if last.headers is None or last.headers.get(HDR_MSG_ID) != message_id or last.seq is None:
            return None
        return Ack(stream=self._cfg.stream, seq=last.seq, duplicate=True)
