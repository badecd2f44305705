"""Quarantine: an ended session the materializer cannot materialize, set aside with its reason.

A session is quarantined when, on its own (whatever else its batch holds), it is

- ``unreadable``: its log does not fold (:class:`FoldError`: an inconsistent or corrupt log), or
  there is no log of it at all;
- ``underivable``: its records cannot be derived from its state (data the derivation cannot take);
- ``invalid``: the sinks cannot hold its records (:mod:`materializer.validation`);
- ``parquet``: the Parquet schema refused its records although they passed validation;
- ``write``: its batch failed, and so did its own write, alone (the service narrows a failed batch
  down by halves: :meth:`materializer.service.Materializer.write`).

Being quarantined is, in this order: a ``session_quarantined`` event on the session's log (its
stage and reason; the projector folds it, so ``rollbus sessions`` and ``GET /sessions/{id}``
show it); then its marker, with status ``quarantined`` and no records, which makes the session
done (never retried) and counts it as a failed session of its prompt; one log line and the
counter ``rollbus_materializer_quarantined_total{stage}``. The rest of its batch is written.

A crash between the event and the marker is safe: the redelivered session's log says it was
quarantined (its fold state's ``quarantined``), so it is quarantined again with that reason
(its marker written, no second event), whatever a new derivation would say; for a log that
does not fold, the event is found by its subject (``<prefix>.<session_id>.quarantined``).

Transient failures (:data:`TRANSIENT`) are never a reason: their batch is retried. They are
everything that says something of the servers and not of the session: JetStream, TransferQueue
or the reward scorer not answering, a concurrent writer, any error nats-py raises (a server
limit such as ``maximum consumers limit reached``, storage or memory refused, no leader, a
timeout) and any ``OSError`` (a full or read-only disk under the Parquet sink).
``rollbus materialize --from-log`` (:mod:`materializer.rematerialize`) reads every session again,
quarantined or not: that is the explicit retry, into a new dataset.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Literal

import msgspec
from nats.errors import Error as NatsError

from eventlog.port import LogPort
from eventlog.reader import LogMessage
from schemas import envelope
from schemas.errors import Conflict, FoldError, LogUnavailable, OwnershipLost, ScorerError, SinkUnavailable
from schemas.events import SCHEMA_VERSION, SUBJECT_KINDS, Event, SessionQuarantined
from schemas.log import HDR_BLOBS, HDR_SCHEMA, HDR_SEQ
from session.fold import SessionState, fold
from session.numbering import UNNUMBERED, numbered

STAGES = ("unreadable", "underivable", "invalid", "parquet", "write")
KIND = SUBJECT_KINDS[SessionQuarantined]
# Failures that say nothing about the session: retry later, never quarantine (a server's limit is never
# taken for a bad session). nats-py's errors include JetStream's API refusals (APIError: limits, leadership).
TRANSIENT: tuple[type[Exception], ...] = (LogUnavailable, SinkUnavailable, Conflict, ScorerError, NatsError, OSError)
Recorded = Literal["appended", "found", "no log"]


class Quarantine(msgspec.Struct, frozen=True):
    stage: str
    reason: str
    logged: bool = False  # the session's log already says so (a redelivery)


class QuarantineLog:
    """The session's log, for quarantine: what it says of an unreadable session, and the event."""

    def __init__(self, log: LogPort, *, clock: Callable[[], float] = time.time, attempts: int = 5) -> None:
        """``log``: the log it reads, and appends the event through."""
        self._log = log
        self._cfg = log.cfg
        self._clock = clock
        self._attempts = attempts

    async def opening(self, session_id: str) -> SessionState | None:
        """The session as far as its log folds (None: not even its opening), for its prompt's bookkeeping."""
        state = None
        with contextlib.suppress(FoldError):
            envelopes = self._log.envelopes(session_id)
            async with contextlib.aclosing(envelopes):  # type: ignore[type-var]
                async for _, events in envelopes:
                    for event in events:
                        state = fold([event], state)
        return state

    async def record(self, session_id: str, quarantine: Quarantine) -> Recorded:
        """Append the session's ``session_quarantined`` event unless its log has one (``"found"``) or there
        is no log (``"no log"``). Another writer appending meanwhile (a late reward) is waited out."""
        for _ in range(self._attempts):
            if await self._last(self._cfg.subject(session_id, KIND)) is not None:
                return "found"
            last = await self._last(self._cfg.session_filter(session_id))
            if last is None:
                return "no log"
            drafted = SessionQuarantined(session_id=session_id, seq=UNNUMBERED, time=self._clock(),
                                         stage=quarantine.stage, reason=quarantine.reason)
            (event,) = numbered([drafted], after=_last_seq(last))  # the session may not fold: its log's last number
            if await self._append(event, last.seq):
                return "appended"
        raise Conflict(f"session {session_id}: its log kept growing while it was being quarantined")

    async def _last(self, subject: str) -> LogMessage | None:
        return await self._log.last_message(subject)

    async def _append(self, event: Event, expected_last: int) -> bool:
        """False when the session's log moved past ``expected_last``."""
        try:
            await self._log.append(event.session_id, [event], expected_last)
        except OwnershipLost:
            return False
        return True


def _last_seq(msg: LogMessage) -> int:
    """The per-session sequence number of the last event of an envelope (its ``Rollbus-Seq`` header)."""
    headers = msg.headers or {}
    if HDR_SEQ in headers:
        return int(headers[HDR_SEQ].rpartition("-")[2])
    if HDR_BLOBS in headers:
        raise FoldError("the session's last envelope names no sequence numbers")
    version = int(headers.get(HDR_SCHEMA, SCHEMA_VERSION))
    return envelope.decode(msg.data, version)[-1].seq
