"""One batch of ended sessions into the sinks, exactly once. The order of the writes is the design:

1. **Markers first, as a filter.** A session with a marker is done; only its prompt's
   bookkeeping (step 6) is repeated, idempotently.
2. **Read and derive** the others from the log (the same fold, the same derivation, so a
   redelivered session yields byte-identical records).
3. **Register prompts.** A prompt seen for the first time gets its progress record (KV,
   created with revision 0) and, with TransferQueue, its key ``{uid}`` tagged ``running``,
   so it exists before any of its trajectories (and so a missing prompt key later means a
   trainer consumed it, never that it was not written).
4. **TransferQueue trajectories**: deterministic keys; a redelivered batch overwrites the
   same keys with the same values. The prompt is not terminal yet (its sessions count only
   at step 6), so no trainer has taken the group.
5. **Parquet, markers, commit**: stage the file, write the markers (the commit record), move
   the file into the dataset (see :mod:`materializer.parquet` for the crash cases).
6. **Count the sessions** into their prompts (compare-and-set) and publish a status that
   moved forward: ``publishing`` is recorded before the TransferQueue write and
   ``published`` after it. A retry that finds ``publishing`` already set for a terminal
   status checks that the prompt key still exists, so a group a trainer already consumed
   (and cleared) is not brought back.

A crash anywhere leaves the batch unacknowledged; JetStream redelivers its signals and
every step above either finds its work done or redoes it with the same result.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec

from materializer.ledger import Markers, PromptLedger
from materializer.parquet import ParquetSink
from materializer.prompts import TERMINAL, PromptProgress, SessionOutcome
from materializer.records import RecordOptions, derive_scored
from reward.precedence import RewardDecision
from reward.scorer import RewardScorer
from schemas.errors import FoldError, RollbusError
from schemas.records import MaterializedMarker, TrajectoryRecord, record_digest
from session_projector.fold import SessionState

if TYPE_CHECKING:  # importing it loads torch, Ray and TransferQueue
    from materializer.transfer_queue import TransferQueueSink

log = logging.getLogger(__name__)

StateLoader = Callable[[str], Awaitable[tuple[SessionState, int]]]


class NotEnded(FoldError):
    """A ready signal for a session the log does not show ended (yet)."""


class Ended(msgspec.Struct, frozen=True, kw_only=True):
    """A session that ended, read from the log, with its records."""

    state: SessionState
    stream_seq: int
    records: list[TrajectoryRecord]
    reward: RewardDecision | None

    @property
    def session_id(self) -> str:
        return self.state.session_id


class _Entry(msgspec.Struct, kw_only=True):
    progress: PromptProgress
    revision: int  # 0: not stored yet


class BatchWriter:
    def __init__(self, *, load: StateLoader, markers: Markers, ledger: PromptLedger, parquet: ParquetSink,
                 tq: TransferQueueSink | None = None, options: RecordOptions = RecordOptions(),
                 rollout_n: int = 1, scorer: RewardScorer | None = None) -> None:
        self._load = load
        self.markers = markers
        self._ledger = ledger
        self._parquet = parquet
        self._tq = tq
        self._options = options
        self._rollout_n = rollout_n
        self._scorer = scorer
        self._reads = asyncio.Semaphore(16)
        self.sessions = 0  # sessions this writer ended (markers written)
        self.records = 0

    @property
    def sinks(self) -> tuple[str, ...]:
        return (self._parquet.name, self._tq.name) if self._tq is not None else (self._parquet.name,)

    async def write(self, session_ids: list[str]) -> list[str]:
        """Materialize the sessions; returns those that could not be read now (to retry later)."""
        await self.recover()  # a batch that failed part-way (in this process or a previous one)
        session_ids = list(dict.fromkeys(session_ids))
        known = await self.markers.get_many(session_ids)
        ended, failed = await self._read_all([s for s in session_ids if s not in known])
        entries = await self._register(ended, known)
        plan = _admit(entries, ended, transfer_queue=self._tq is not None)
        fresh = [e.records for e, verdict in plan if verdict in ("new", "known")]
        if self._tq is not None and fresh:
            await self._tq.put_records([r for records in fresh for r in records])
        await self._commit(plan)
        await self._count(entries, plan, known)
        return failed

    async def recover(self) -> None:
        """Commit the staged Parquet batches some of whose markers exist (their missing markers written
        first); discard the others, whose sessions were never acknowledged and come back."""
        for staged in await asyncio.to_thread(self._parquet.staged):
            found = await self.markers.get_many(staged.session_ids)
            if not any(m.parquet_file == staged.name for m in found.values()):
                log.warning("discarding uncommitted batch %s (%d sessions)", staged.name, len(staged.markers))
                await asyncio.to_thread(self._parquet.discard, staged.name)
                continue
            missing = [m for m in staged.markers if m.session_id not in found]
            await asyncio.gather(*(self.markers.create_marker(m) for m in missing))
            await asyncio.to_thread(self._parquet.commit, staged.name)
            log.warning("committed batch %s left staged by an interrupted write", staged.name)

    async def _read_all(self, session_ids: list[str]) -> tuple[list[Ended], list[str]]:
        results = await asyncio.gather(*(self._read(s) for s in session_ids), return_exceptions=True)
        ended, failed = [], []
        for session_id, result in zip(session_ids, results, strict=True):
            if isinstance(result, Ended):
                ended.append(result)
            elif isinstance(result, RollbusError):
                log.warning("session %s: %s; will retry", session_id, result)
                failed.append(session_id)
            else:
                raise result  # a bug, not a bad session: fail the batch loudly
        return ended, failed

    async def _read(self, session_id: str) -> Ended:
        async with self._reads:
            state, stream_seq = await self._load(session_id)
        if state.status == "open":
            raise NotEnded(f"session {session_id} has not ended")
        if state.status != "finalized":
            return Ended(state=state, stream_seq=stream_seq, records=[], reward=None)
        records, reward = await derive_scored(state, self._options, self._scorer)
        return Ended(state=state, stream_seq=stream_seq, records=records, reward=reward)

    async def _register(self, ended: list[Ended], known: dict[str, MaterializedMarker]) -> dict[str, _Entry]:
        """Every prompt of the batch with its progress; new prompts stored (and tagged running)."""
        uids = [e.state.uid for e in ended] + [m.uid for m in known.values()]
        entries = {uid: _Entry(progress=p, revision=rev) for uid, (p, rev) in (await self._ledger.load(uids)).items()}
        for e in ended:
            if e.state.uid not in entries:
                entries[e.state.uid] = _Entry(progress=self._new_progress(e.state), revision=0)
        for uid in uids:  # markers written before a crash, by a version without prompt progress
            entries.setdefault(uid, _Entry(progress=PromptProgress(uid=uid, expected=self._rollout_n), revision=0))
        untagged = [x for x in entries.values() if self._tq is not None and not x.progress.published]
        if self._tq is not None and untagged:
            await self._tq.put_prompt_statuses({x.progress.uid: ("running", x.progress.global_steps) for x in untagged})
        for entry in untagged:
            entry.progress = msgspec.structs.replace(entry.progress, published="running")
        for entry in {id(x): x for x in [*untagged, *(x for x in entries.values() if x.revision == 0)]}.values():
            entry.revision = await self._ledger.save(entry.progress, entry.revision)
        return entries

    def _new_progress(self, state: SessionState) -> PromptProgress:
        expected = state.metadata.get("rollout_n", self._rollout_n)
        if not isinstance(expected, int) or isinstance(expected, bool) or expected < 1:
            log.warning("session %s: rollout_n=%r is not a positive integer; using %d", state.session_id, expected,
                        self._rollout_n)
            expected = self._rollout_n
        steps = state.metadata.get("global_steps", 0)
        return PromptProgress(uid=state.uid, expected=expected, global_steps=steps if isinstance(steps, int) else 0)

    def _marker(self, e: Ended, verdict: str) -> MaterializedMarker:
        written = verdict != "duplicate"
        return MaterializedMarker(
            session_id=e.session_id, stream_seq=e.stream_seq,
            digests={r.key: record_digest(r) for r in e.records} if written else {},
            sinks=(self.sinks if verdict in ("new", "known") else (self._parquet.name,)) if e.records else (),
            status="duplicate" if not written else e.state.status, uid=e.state.uid,
            session_index=e.state.session_index, reward=e.reward.reward if e.reward else None,
            reward_source=e.reward.source if e.reward else None,
            reward_extra_info=dict(e.reward.extra) if e.reward else {}, options=msgspec.structs.asdict(self._options))

    async def _commit(self, plan: list[tuple[Ended, str]]) -> None:
        """Stage the batch's records, write every marker (the commit record), move the file into the dataset."""
        with_records = [(e, v) for e, v in plan if e.records and v != "duplicate"]
        markers = [self._marker(e, v) for e, v in plan if not e.records or v == "duplicate"]
        staged = None
        if with_records:
            records = [r for e, _ in with_records for r in e.records]
            staged = await asyncio.to_thread(self._parquet.stage, records,
                                             [self._marker(e, v) for e, v in with_records])
            markers += staged.markers  # now naming the staged file
            self.records += len(records)
        await asyncio.gather(*(self.markers.create_marker(m) for m in markers))
        if staged is not None:
            await asyncio.to_thread(self._parquet.commit, staged.name)
        self.sessions += len(plan)

    async def _count(self, entries: dict[str, _Entry], plan: list[tuple[Ended, str]],
                     known: dict[str, MaterializedMarker]) -> None:
        """Add the batch's sessions to their prompts and publish the statuses that moved forward."""
        by_uid: dict[str, list[tuple[int, SessionOutcome]]] = {}
        for e, verdict in plan:
            if verdict != "duplicate":
                by_uid.setdefault(e.state.uid, []).append(
                    (e.state.session_index, SessionOutcome(e.session_id, bool(e.records))))
        for m in known.values():
            if m.status != "duplicate":
                by_uid.setdefault(m.uid, []).append((m.session_index, SessionOutcome(m.session_id, m.succeeded)))
        retries: set[str] = set()
        for uid, entry in entries.items():
            progress = entry.progress
            for index, outcome in by_uid.get(uid, []):
                progress = progress.with_outcome(index, outcome)
            status = progress.to_publish() if self._tq is not None else ""
            if status and status == entry.progress.publishing:
                retries.add(uid)  # an earlier attempt may have written it
            progress = msgspec.structs.replace(progress, publishing=status)
            if progress != entry.progress:
                entry.revision = await self._ledger.save(progress, entry.revision)
                entry.progress = progress
        await self._publish(entries, retries)

    async def _publish(self, entries: dict[str, _Entry], retries: set[str]) -> None:
        pending = {uid: x for uid, x in entries.items() if x.progress.publishing}
        if self._tq is None or not pending:
            return
        consumed = await self._consumed(pending, retries)
        statuses = {uid: (x.progress.publishing, x.progress.global_steps) for uid, x in pending.items()
                    if uid not in consumed}
        await self._tq.put_prompt_statuses(statuses)
        for entry in pending.values():
            done = msgspec.structs.replace(entry.progress, published=entry.progress.publishing, publishing="")
            entry.revision = await self._ledger.save(done, entry.revision)
            entry.progress = done

    async def _consumed(self, pending: dict[str, _Entry], retries: set[str]) -> set[str]:
        """Prompts whose terminal status may already be out and whose key is gone: a trainer took them."""
        suspects = {uid for uid in retries if pending[uid].progress.publishing in TERMINAL}
        if not suspects or self._tq is None:
            return set()
        present = await self._tq.listing()
        gone = {uid for uid in suspects if uid not in present}
        for uid in gone:
            log.warning("prompt %s: its %s status was written before a restart and consumed since; not rewritten",
                        uid, pending[uid].progress.publishing)
        return gone


def _admit(entries: dict[str, _Entry], ended: list[Ended], *, transfer_queue: bool) -> list[tuple[Ended, str]]:
    """Each session's verdict, in batch order: a second session with one index, or one past the
    prompt's expected count, is seen against the sessions admitted before it in the same batch."""
    working = {uid: entry.progress for uid, entry in entries.items()}
    plan = []
    for e in ended:
        progress = working[e.state.uid]
        verdict = progress.admits(e.state.session_index, e.session_id)
        if verdict == "new":
            working[e.state.uid] = progress.with_outcome(e.state.session_index,
                                                         SessionOutcome(e.session_id, bool(e.records)))
        elif verdict == "duplicate":
            log.error("session %s: prompt %s already has a session with index %d; its records are not written",
                      e.session_id, e.state.uid, e.state.session_index)
        elif verdict == "late" and transfer_queue:  # without TransferQueue, prompt status is not published
            log.error("session %s: prompt %s already has its %d sessions; records go to Parquet only",
                      e.session_id, e.state.uid, progress.expected)
        plan.append((e, verdict))
    return plan
