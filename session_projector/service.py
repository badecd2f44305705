"""The projector service: keeps a projection per session, and signals "ready to materialize".

It reads every envelope of the log with a durable consumer, in batches. The envelopes of
one session in a batch are folded together onto the session's stored projection (the one
fold, on a released state: see :mod:`session_projector.projections`) and written back
once, compare-and-set on the KV revision; then they are acked. A session's envelopes are
acked or nak'ed together, independently of the other sessions in the batch.

* Redelivery: an envelope whose events the projection already holds (``seq`` at or below
  the stored one) is skipped.
* A gap (the projection is missing, or behind the envelope by more than the envelope
  itself: a lost bucket, a message redelivered late) is closed by rebuilding the session
  from the log up to that envelope, so the projector never needs to have seen a session
  from its start, and it holds no session in memory beyond a small cache of released
  states.
* For every session that ends (``session_finalized`` or ``session_aborted``; a session
  ends once) it publishes one ready signal to the ready stream, deduplicated by
  ``Nats-Msg-Id = ready:<session_id>``, after the projection is written (a redelivered
  end publishes a duplicate the server drops). The materializer writes the records of a
  finalized session and counts an aborted one as a failed session of its prompt.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import msgspec

from eventlog.consumer import pull_batches, settle
from eventlog.lag import Watched
from eventlog.port import Delivery, LogPort
from observability.registry import Metrics
from schemas.events import AnyEvent, SessionAborted, SessionFinalized
from schemas.log import HDR_MSG_ID, LogConfig, ReadySignal
from session.fold import SessionState, fold
from session_projector.metrics import ProjectorMetrics
from session_projector.projections import ProjectionStore, project

log = logging.getLogger(__name__)


class Projector:
    def __init__(self, log: LogPort, *, durable: str = "rollbus-projections",
                 batch: int = 256, cache: int = 1024, metrics: Metrics | None = None) -> None:
        """``log``: the log it reads, publishes ready signals to and keeps projections in
        (:class:`eventlog.jetstream.JetStreamPort`, or the in-memory log); ``metrics``: where envelopes,
        rebuilds, ready signals and retried sessions are counted (a registry of its own when None)."""
        self._log = log
        self._cfg = cfg = log.cfg
        self._durable = durable
        self._batch = batch
        self._metrics = (metrics if metrics is not None else Metrics()).group(ProjectorMetrics)
        self.store = ProjectionStore(log.kv(cfg.projections_bucket), cache=cache)
        self.rebuilt = 0  # sessions rebuilt from the log to close a gap (observability, tests)

    @property
    def watched(self) -> Watched:
        """Its durable consumer, for its lag (``observability.lag.watch_lag``)."""
        return Watched(name="projector", stream=self._cfg.stream, durable=self._durable, subject=self._cfg.subjects)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            async for msgs in pull_batches(self._log, stream=self._cfg.stream, durable=self._durable,
                                           subject=self._cfg.subjects, stop=stop, batch=self._batch):
                for group in _by_session(self._cfg, msgs):
                    if await settle(group, self._project(group)):
                        self._metrics.envelopes.inc(len(group))
                    else:
                        self._metrics.retried.inc()
        finally:
            await self._log.close()

    async def _project(self, msgs: Sequence[Delivery]) -> None:
        session_id = self._cfg.session_of(msgs[0].subject)
        envelopes = [(msg.metadata.sequence.stream, await self._log.decode(msg)) for msg in msgs]
        projection, revision = await self.store.get(session_id)
        start = projection.state if projection is not None else None
        state, stream_seq = start, projection.stream_seq if projection is not None else 0
        for position, events in envelopes:
            state, stream_seq = await self._apply(session_id, state, stream_seq, position, events)
        if state is not None and state is not start:
            await self.store.put(project(state, stream_seq), revision)
        for position, events in envelopes:
            if any(isinstance(e, SessionFinalized | SessionAborted) for e in events):
                await self._signal(ReadySignal(session_id=session_id, stream_seq=position))

    async def _apply(self, session_id: str, state: SessionState | None, stream_seq: int, position: int,
                     events: list[AnyEvent]) -> tuple[SessionState | None, int]:
        if state is not None and events[-1].seq <= state.seq:
            return state, stream_seq  # already folded in: a redelivery
        expected = 1 if state is None else state.seq + 1
        if events[0].seq > expected:
            log.info("session %s: projection at #%d, envelope starts at #%d; rebuilding from the log",
                     session_id, expected - 1, events[0].seq)
            self.rebuilt += 1
            self._metrics.rebuilds.inc()
            rebuilt, _ = await self._log.load_state(session_id, until=position)
            return rebuilt, position
        return fold(events, state), position

    async def _signal(self, ready: ReadySignal) -> None:
        subject = self._cfg.ready_subject(ready.session_id)
        headers = {HDR_MSG_ID: f"ready:{ready.session_id}"}
        await self._log.publish(subject, msgspec.json.encode(ready), headers)
        self._metrics.ready.inc()
        log.info("session %s ready to materialize", ready.session_id)


def _by_session(cfg: LogConfig, msgs: Sequence[Delivery]) -> list[list[Delivery]]:
    """The batch's messages grouped by session, each group in stream order."""
    groups: dict[str, list[Delivery]] = {}
    for msg in msgs:
        groups.setdefault(cfg.session_of(msg.subject), []).append(msg)
    return list(groups.values())
