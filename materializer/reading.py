"""Step 2 of a batch (:mod:`materializer.batch`): each ended session read from the log, its records
derived and checked, on its own.

Every session of the batch comes out as one of

- an :class:`Ended` session with its records (none for an aborted one);
- an :class:`Ended` session with a :class:`~materializer.quarantine.Quarantine` instead of records,
  when it cannot be materialized: its log does not fold (``unreadable``; what does fold of it, at
  least its opening, still names its prompt), its derivation raised a data error
  (``underivable``: an image missing from the object store, a processor that cannot be loaded here,
  too), the sinks cannot hold its records (``invalid``), or the caller rejected it
  (``write``, with the caller's reason); or when its log already says it was quarantined;
- an :class:`Orphan`: a quarantined session of which not even the opening is readable (it counts
  in no prompt);
- a session to retry later (a transient failure, or no end in the log yet).

No failure of one session reaches another: only a bug (an exception that is not a data error)
fails the whole batch, and the service then narrows the batch down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

import msgspec

from materializer.metadata import SessionKeys, read_keys
from materializer.padding import Padding
from materializer.quarantine import TRANSIENT, Quarantine, QuarantineLog
from materializer.records import RecordOptions, derive_scored
from materializer.validation import bounded, session_problem
from materializer.vision import ImageFetch, VisionInputs
from reward.precedence import RewardDecision
from reward.scorer import RewardScorer
from schemas.errors import FoldError, NotEnded, SessionNotFound
from schemas.records import TrajectoryRecord
from session.fold import SessionState

log = logging.getLogger(__name__)

StateLoader = Callable[[str], Awaitable[tuple[SessionState, int]]]
# What bad data makes pure code raise (a derivation that meets values it cannot take).
DATA_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, ArithmeticError, LookupError, UnicodeError,
                                            msgspec.EncodeError)


class Ended(msgspec.Struct, frozen=True, kw_only=True):
    """A session that ended, read from the log, with its records (or why it has none: ``quarantine``)."""

    state: SessionState
    stream_seq: int
    records: list[TrajectoryRecord]
    reward: RewardDecision | None
    keys: SessionKeys  # what its metadata decides
    quarantine: Quarantine | None = None

    @property
    def session_id(self) -> str:
        return self.state.session_id

    @property
    def attempt(self) -> int:
        return self.keys.attempt

    def quarantined(self, quarantine: Quarantine) -> Ended:
        return msgspec.structs.replace(self, records=[], quarantine=quarantine)


class Orphan(msgspec.Struct, frozen=True, kw_only=True):
    """A quarantined session whose log does not even yield its opening (or that has no log)."""

    session_id: str
    quarantine: Quarantine


class SessionReader:
    def __init__(self, *, load: StateLoader, quarantine: QuarantineLog | None, options: RecordOptions,
                 rollout_n: int, partition: str, padding: Padding | None, scorer: RewardScorer | None,
                 images: ImageFetch | None = None) -> None:
        """``images``: where the images of sessions with a processor are fetched from (the log's object store)."""
        self._load = load
        self._vision = VisionInputs(images)
        self._log = quarantine
        self._options = options
        self._rollout_n = rollout_n
        self._partition = partition
        self._padding = padding
        self._scorer = scorer
        self._reads = asyncio.Semaphore(16)

    async def read_all(self, session_ids: list[str], reject: Mapping[str, str]
                       ) -> tuple[list[Ended], list[Orphan], list[str]]:
        """(ended, orphans, to retry); ``reject``: sessions to quarantine (stage ``write``) with these reasons."""
        results = await asyncio.gather(*(self._read(s, reject.get(s)) for s in session_ids), return_exceptions=True)
        ended: list[Ended] = []
        orphans: list[Orphan] = []
        failed: list[str] = []
        for session_id, result in zip(session_ids, results, strict=True):
            if isinstance(result, Ended):
                ended.append(result)
            elif isinstance(result, Orphan):
                orphans.append(result)
            elif isinstance(result, (*TRANSIENT, NotEnded)):
                log.warning("session %s: %s; will retry", session_id, result)
                failed.append(session_id)
            else:
                raise result  # a bug, not a bad session: fail the batch loudly (the service narrows it down)
        return ended, orphans, failed

    def _keys(self, state: SessionState) -> SessionKeys:
        return read_keys(state, rollout_n=self._rollout_n, partition=self._partition, options=self._options)

    async def _read(self, session_id: str, rejected: str | None) -> Ended | Orphan:
        async with self._reads:
            try:
                state, stream_seq = await self._load(session_id)
            except SessionNotFound as exc:
                return Orphan(session_id=session_id, quarantine=Quarantine("unreadable", bounded(str(exc))))
            except FoldError as exc:
                return await self._unreadable(session_id, exc)
        if state.status == "open":
            raise NotEnded(f"session {session_id} has not ended")
        ended = Ended(state=state, stream_seq=stream_seq, records=[], reward=None, keys=self._keys(state))
        if state.quarantined is not None:  # a redelivery: the log's word stands
            return ended.quarantined(Quarantine("", state.quarantined, logged=True))
        if rejected is not None:
            return ended.quarantined(Quarantine("write", bounded(rejected)))
        if state.status != "finalized":
            return ended
        try:
            records, reward = await derive_scored(state, ended.keys.options, self._scorer)
            records = await self._vision.attach(state, records)
        except (FoldError, *DATA_ERRORS) as exc:
            return ended.quarantined(Quarantine("underivable", bounded(f"its records cannot be derived: {exc!r}")))
        problem = session_problem(records, self._padding)
        if problem is not None:
            return ended.quarantined(Quarantine("invalid", f"the sinks cannot hold it: {problem}"))
        return msgspec.structs.replace(ended, records=records, reward=reward)

    async def _unreadable(self, session_id: str, exc: FoldError) -> Ended | Orphan:
        quarantine = Quarantine("unreadable", bounded(f"its log does not fold: {exc}"))
        opening = await self._log.opening(session_id) if self._log is not None else None
        if opening is None:
            return Orphan(session_id=session_id, quarantine=quarantine)
        return Ended(state=opening, stream_seq=0, records=[], reward=None, keys=self._keys(opening),
                     quarantine=quarantine)
