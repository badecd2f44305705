"""Re-materialization: every finalized session of the log into a new Parquet dataset, no rollout rerun.

One pass over the whole log (an ordered consumer up to the last message that existed when
it began): each session is folded as its envelopes go by, and when it is finalized its
records are derived with the given options (a session's metadata may override them, as in
the live materializer: :func:`materializer.metadata.record_options`) and scorer, and buffered; every
``sessions_per_file`` sessions become one ``part-*.parquet`` file. Events after a session
ended (a late reward, kept for audit) change nothing, as in the live materializer. Aborted
sessions have no records; sessions still open when the pass ends are counted, not written.
Nothing is written to the markers or to TransferQueue: the live bookkeeping is untouched.

Quarantined sessions (:mod:`materializer.quarantine`) are read again like the others (their
``session_quarantined`` event comes after their end): this is the explicit retry. One that
still cannot be materialized (its log does not fold, its records cannot be derived, the sinks
cannot hold them: :mod:`materializer.validation`) is logged, counted in ``errors`` and left
out, and the rest of its file is written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
from nats.js.client import JetStreamContext

from eventlog.pieces import PieceStore, open_pieces
from eventlog.reader import iter_envelopes, last_stream_seq
from materializer.metadata import record_options
from materializer.parquet import ParquetSink
from materializer.reading import DATA_ERRORS
from materializer.records import RecordOptions, derive_scored
from materializer.validation import bounded, session_problem
from materializer.vision import VisionInputs
from reward.scorer import RewardScorer
from schemas.errors import FoldError
from schemas.events import AnyEvent
from schemas.log import LogConfig
from schemas.records import MaterializedMarker, TrajectoryRecord, record_digest
from session.fold import SessionState, fold

log = logging.getLogger(__name__)


class Progress(msgspec.Struct, kw_only=True):
    position: int = 0  # stream sequence read up to
    last: int = 0  # stream sequence the pass ends at
    sessions: int = 0  # finalized sessions written
    aborted: int = 0
    errors: int = 0  # sessions whose log does not fold, or whose records cannot be derived or held
    records: int = 0
    files: int = 0
    open: int = 0  # sessions still open when the pass ended
    started: float = 0.0


Reporter = Callable[[Progress], None]


class Rematerializer:
    def __init__(self, sink: ParquetSink, *, options: RecordOptions = RecordOptions(),
                 scorer: RewardScorer | None = None, sessions_per_file: int = 4096) -> None:
        self._sink = sink
        self._options = options
        self._scorer = scorer
        self._per_file = sessions_per_file
        self._states: dict[str, SessionState] = {}
        self._ended: set[str] = set()
        self._records: list[TrajectoryRecord] = []
        self._markers: list[MaterializedMarker] = []
        self._vision = VisionInputs(self._image)  # the images of sessions with a processor, from the object store
        self._pieces: PieceStore | None = None
        self._log: tuple[JetStreamContext, LogConfig] | None = None
        self.progress = Progress()

    async def _image(self, session_id: str, digest: str) -> bytes | None:
        if self._pieces is None and self._log is not None:
            self._pieces = await open_pieces(*self._log)
        return await self._pieces.get(session_id, bytes.fromhex(digest)) if self._pieces is not None else None

    async def run(self, js: JetStreamContext, cfg: LogConfig, report: Reporter | None = None,
                  every: float = 1.0) -> Progress:
        progress = self.progress
        self._log = (js, cfg)
        progress.started = time.monotonic()
        progress.last = await last_stream_seq(js, cfg, cfg.subjects)
        shown = progress.started
        async for seq, events in iter_envelopes(js, cfg, cfg.subjects, progress.last):
            progress.position = seq
            await self._apply(events)
            if len(self._markers) >= self._per_file:
                await self._flush()
            if report is not None and time.monotonic() - shown >= every:
                shown = time.monotonic()
                report(progress)
        await self._flush()
        progress.open = len(self._states)
        if report is not None:
            report(progress)
        return progress

    async def _apply(self, events: list[AnyEvent]) -> None:
        session_id = events[0].session_id
        if session_id in self._ended:
            return  # after the end: audit only
        try:
            state = fold(events, self._states.get(session_id))
        except FoldError as exc:
            self._end(session_id)
            self._skip(session_id, f"its log does not fold: {exc}")
            return
        if state is None or state.status == "open":
            if state is not None:
                self._states[session_id] = state
            return
        self._end(session_id)
        if state.status == "aborted":
            self.progress.aborted += 1
            return
        options = record_options(state, self._options)
        try:
            records, reward = await derive_scored(state, options, self._scorer)
            records = await self._vision.attach(state, records)
        except (FoldError, *DATA_ERRORS) as exc:
            self._skip(session_id, f"its records cannot be derived: {exc!r}")
            return
        problem = session_problem(records, self._sink.padding)
        if problem is not None:
            self._skip(session_id, f"the sinks cannot hold it: {problem}")
            return
        self.progress.sessions += 1
        if records:
            self._records += records
            self._markers.append(MaterializedMarker(
                session_id=session_id, stream_seq=self.progress.position, uid=state.uid,
                session_index=state.session_index, digests={r.key: record_digest(r) for r in records},
                sinks=(self._sink.name,), reward=reward.reward, reward_source=reward.source,
                reward_extra_info=dict(reward.extra), options=options))

    def _skip(self, session_id: str, reason: str) -> None:
        log.error("session %s cannot be materialized (%s); skipped", session_id, bounded(reason))
        self.progress.errors += 1

    def _end(self, session_id: str) -> None:
        self._states.pop(session_id, None)
        self._ended.add(session_id)

    async def _flush(self) -> None:
        if not self._records:
            return
        records, markers = self._records, self._markers
        self._records, self._markers = [], []
        by_session: dict[str, list[TrajectoryRecord]] = {}
        for record in records:
            by_session.setdefault(record.session_id, []).append(record)
        table, refused = await asyncio.to_thread(self._sink.fit, [by_session[m.session_id] for m in markers])
        for index, reason in refused.items():
            self._skip(markers[index].session_id, f"the Parquet schema refused it: {reason}")
            self.progress.sessions -= 1
        if refused:
            markers = [m for i, m in enumerate(markers) if i not in refused]
            records = [r for m in markers for r in by_session[m.session_id]]
        if not markers:
            return
        staged = await asyncio.to_thread(self._sink.stage, records, markers, table=table)
        await asyncio.to_thread(self._sink.commit, staged.name)
        self.progress.records += len(records)
        self.progress.files += 1
