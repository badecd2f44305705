"""One batch of ended sessions into the sinks, exactly once. The order of the writes is the design:

1. **Markers first, as a filter.** A session with a marker is done; only its prompt's
   bookkeeping (step 6) is repeated, idempotently.
2. **Read and derive** the others from the log (the same fold, the same derivation, the
   session's own metadata keys: :mod:`materializer.metadata`; so a redelivered session
   yields byte-identical records).
3. **Register prompts** at the newest attempt the batch holds for them. A prompt seen for
   the first time gets its progress record (KV, created with revision 0); one whose stored
   progress is of an older attempt starts again (compare-and-set; the older attempt's
   trajectories are not touched: verl cleared them before it re-issued the uid, and a
   destructive clear here could not be fenced against a concurrent writer). Either way,
   with TransferQueue, its key ``{uid}`` is tagged ``running`` in the prompt's partition,
   so it exists before any of its trajectories (and so a missing prompt key later means a
   trainer consumed it, never that it was not written).
4. **Verdicts, then TransferQueue trajectories**: each session against its prompt's
   progress and the sessions before it in the batch (new, known, duplicate, late, or stale:
   of an older attempt). New and known sessions' records go to their prompt's partition
   (one put per partition and field set), under deterministic keys; a redelivered batch
   overwrites the same keys with the same values. The prompt is not terminal yet (its
   sessions count only at step 6), so no trainer has taken the group.
5. **Parquet, markers, commit**: stage the file (every session's records but a duplicate's:
   late and stale sessions are kept in the dataset), write the markers (the commit record,
   naming the session's attempt and the options its records were derived with), move the
   file into the dataset (see :mod:`materializer.parquet` for the crash cases).
6. **Count the sessions** of the prompt's attempt into it (compare-and-set) and publish a
   status that moved forward, in the prompt's partition: ``publishing`` is recorded before
   the TransferQueue write and ``published`` after it. A retry that finds ``publishing``
   already set for a terminal status checks that the prompt key still exists, so a group a
   trainer already consumed (and cleared) is not brought back.

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
from materializer.metadata import SessionKeys, read_keys
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
_TO_TRANSFER_QUEUE = ("new", "known")  # the verdicts whose records go to TransferQueue


class NotEnded(FoldError):
    """A ready signal for a session the log does not show ended (yet)."""


class Ended(msgspec.Struct, frozen=True, kw_only=True):
    """A session that ended, read from the log, with its records."""

    state: SessionState
    stream_seq: int
    records: list[TrajectoryRecord]
    reward: RewardDecision | None
    keys: SessionKeys  # what its metadata decides

    @property
    def session_id(self) -> str:
        return self.state.session_id

    @property
    def attempt(self) -> int:
        return self.keys.attempt


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

    def _partition(self, progress: PromptProgress) -> str:
        """The TransferQueue partition of a prompt's key and trajectories."""
        return progress.partition or (self._tq.partition if self._tq is not None else "")

    async def write(self, session_ids: list[str]) -> list[str]:
        """Materialize the sessions; returns those that could not be read now (to retry later)."""
        await self.recover()  # a batch that failed part-way (in this process or a previous one)
        session_ids = list(dict.fromkeys(session_ids))
        known = await self.markers.get_many(session_ids)
        ended, failed = await self._read_all([s for s in session_ids if s not in known])
        entries = await self._register(ended, known)
        plan = _admit(entries, ended, partition=self._partition if self._tq is not None else None)
        await self._put_records(entries, plan)
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
        default_partition = self._tq.partition if self._tq is not None else ""
        keys = read_keys(state, rollout_n=self._rollout_n, partition=default_partition, options=self._options)
        if state.status != "finalized":
            return Ended(state=state, stream_seq=stream_seq, records=[], reward=None, keys=keys)
        records, reward = await derive_scored(state, keys.options, self._scorer)
        return Ended(state=state, stream_seq=stream_seq, records=records, reward=reward, keys=keys)

    async def _register(self, ended: list[Ended], known: dict[str, MaterializedMarker]) -> dict[str, _Entry]:
        """Every prompt of the batch with its progress, at the newest attempt the batch has for it;
        new and restarted prompts stored (and tagged running)."""
        uids = [e.state.uid for e in ended] + [m.uid for m in known.values()]
        entries = {uid: _Entry(progress=p, revision=rev) for uid, (p, rev) in (await self._ledger.load(uids)).items()}
        restarted = []
        for uid, e in _newest(ended).items():
            fresh = e.keys.progress(uid)
            entry = entries.get(uid)
            if entry is None:
                entries[uid] = _Entry(progress=fresh, revision=0)
            elif (progress := entry.progress.for_attempt(fresh)) is not entry.progress:
                log.warning("prompt %s: attempt %d replaces attempt %d (%d of %d sessions ended); it starts again",
                            uid, progress.attempt, entry.progress.attempt, len(entry.progress.outcomes),
                            entry.progress.expected)
                entry.progress = progress
                restarted.append(entry)
        for uid in uids:  # markers written before a crash, by a version without prompt progress
            entries.setdefault(uid, _Entry(progress=PromptProgress(uid=uid, expected=self._rollout_n), revision=0))
        untagged = [x for x in entries.values() if self._tq is not None and not x.progress.published]
        await self._put_statuses([(x.progress, "running") for x in untagged])
        for entry in untagged:
            entry.progress = msgspec.structs.replace(entry.progress, published="running")
        stored = [*untagged, *restarted, *(x for x in entries.values() if x.revision == 0)]
        for entry in {id(x): x for x in stored}.values():
            entry.revision = await self._ledger.save(entry.progress, entry.revision)
        return entries

    async def _put_statuses(self, statuses: list[tuple[PromptProgress, str]]) -> None:
        """Prompt keys' statuses, one put per partition."""
        if self._tq is None:
            return
        by_partition: dict[str, dict[str, tuple[str, int]]] = {}
        for progress, status in statuses:
            by_partition.setdefault(self._partition(progress), {})[progress.uid] = (status, progress.global_steps)
        for partition, tags in by_partition.items():
            await self._tq.put_prompt_statuses(tags, partition)

    async def _put_records(self, entries: dict[str, _Entry], plan: list[tuple[Ended, str]]) -> None:
        """The records of the sessions TransferQueue takes, in their prompts' partitions."""
        if self._tq is None:
            return
        by_partition: dict[str, list[TrajectoryRecord]] = {}
        for e, verdict in plan:
            if verdict in _TO_TRANSFER_QUEUE and e.records:
                by_partition.setdefault(self._partition(entries[e.state.uid].progress), []).extend(e.records)
        for partition, records in by_partition.items():
            await self._tq.put_records(records, partition)

    def _marker(self, e: Ended, verdict: str) -> MaterializedMarker:
        written = verdict != "duplicate"
        return MaterializedMarker(
            session_id=e.session_id, stream_seq=e.stream_seq,
            digests={r.key: record_digest(r) for r in e.records} if written else {},
            sinks=(self.sinks if verdict in _TO_TRANSFER_QUEUE else (self._parquet.name,)) if e.records else (),
            status="duplicate" if not written else e.state.status, uid=e.state.uid,
            session_index=e.state.session_index, attempt=e.attempt, reward=e.reward.reward if e.reward else None,
            reward_source=e.reward.source if e.reward else None,
            reward_extra_info=dict(e.reward.extra) if e.reward else {}, options=msgspec.structs.asdict(e.keys.options))

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
        """Add the batch's sessions to their prompts (those of the prompt's attempt) and publish the statuses
        that moved forward."""
        by_uid: dict[str, list[tuple[int, SessionOutcome, int]]] = {}
        for e, verdict in plan:
            if verdict != "duplicate":
                by_uid.setdefault(e.state.uid, []).append(
                    (e.state.session_index, SessionOutcome(e.session_id, bool(e.records)), e.attempt))
        for m in known.values():
            if m.status != "duplicate":
                by_uid.setdefault(m.uid, []).append(
                    (m.session_index, SessionOutcome(m.session_id, m.succeeded), m.attempt))
        retries: set[str] = set()
        for uid, entry in entries.items():
            progress = entry.progress
            for index, outcome, attempt in by_uid.get(uid, []):
                progress = progress.with_outcome(index, outcome, attempt)
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
        await self._put_statuses([(x.progress, x.progress.publishing) for uid, x in pending.items()
                                  if uid not in consumed])
        for entry in pending.values():
            done = msgspec.structs.replace(entry.progress, published=entry.progress.publishing, publishing="")
            entry.revision = await self._ledger.save(done, entry.revision)
            entry.progress = done

    async def _consumed(self, pending: dict[str, _Entry], retries: set[str]) -> set[str]:
        """Prompts whose terminal status may already be out and whose key is gone: a trainer took them."""
        suspects = {uid for uid in retries if pending[uid].progress.publishing in TERMINAL}
        if not suspects or self._tq is None:
            return set()
        partitions = {self._partition(pending[uid].progress) for uid in suspects}
        present = {p: await self._tq.listing(p) for p in sorted(partitions)}
        gone = {uid for uid in suspects if uid not in present[self._partition(pending[uid].progress)]}
        for uid in gone:
            log.warning("prompt %s: its %s status was written before a restart and consumed since; not rewritten",
                        uid, pending[uid].progress.publishing)
        return gone


def _newest(ended: list[Ended]) -> dict[str, Ended]:
    """Per prompt, the first session (in batch order) of the newest attempt the batch holds."""
    newest: dict[str, Ended] = {}
    for e in ended:
        had = newest.get(e.state.uid)
        if had is None or e.attempt > had.attempt:
            newest[e.state.uid] = e
    return newest


def _admit(entries: dict[str, _Entry], ended: list[Ended], *,
           partition: Callable[[PromptProgress], str] | None) -> list[tuple[Ended, str]]:
    """Each session's verdict, in batch order: a second session with one index, or one past the
    prompt's expected count, is seen against the sessions admitted before it in the same batch;
    a session of an older attempt than its prompt's (registered at the batch's newest) is stale.
    ``partition``: a prompt's TransferQueue partition (None: no TransferQueue)."""
    transfer_queue = partition is not None
    working = {uid: entry.progress for uid, entry in entries.items()}
    plan = []
    for e in ended:
        progress = working[e.state.uid]
        verdict = progress.admits(e.state.session_index, e.session_id, e.attempt)
        if verdict == "new":
            working[e.state.uid] = progress.with_outcome(e.state.session_index,
                                                         SessionOutcome(e.session_id, bool(e.records)), e.attempt)
            if partition is not None and e.keys.partition != partition(progress):
                log.warning("session %s: tq_partition %r differs from its prompt's %r; its records go with the "
                            "prompt", e.session_id, e.keys.partition, partition(progress))
        elif verdict == "duplicate":
            log.error("session %s: prompt %s already has a session with index %d; its records are not written",
                      e.session_id, e.state.uid, e.state.session_index)
        elif verdict == "late" and transfer_queue:  # without TransferQueue, prompt status is not published
            log.error("session %s: prompt %s already has its %d sessions; records go to Parquet only",
                      e.session_id, e.state.uid, progress.expected)
        elif verdict in ("stale", "newer"):  # "newer" cannot happen: the prompt is registered at the newest
            log.warning("session %s: attempt %d of prompt %s, which is at attempt %d; records go to Parquet only",
                        e.session_id, e.attempt, e.state.uid, progress.attempt)
        plan.append((e, verdict))
    return plan
