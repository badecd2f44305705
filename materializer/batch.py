"""One batch of ended sessions into the sinks, exactly once. The order of the writes is the design:

1. **Markers first, as a filter.** A session with a marker is done; only its prompt's
   bookkeeping (step 6) is repeated, idempotently.
2. **Read, derive and check** the others from the log, each on its own (the same fold, the
   same derivation, the session's own metadata keys: :mod:`materializer.metadata`; so a
   redelivered session yields byte-identical records; :mod:`materializer.reading`). A session
   that cannot be materialized (its log does not fold, its records cannot be derived, the sinks
   cannot hold them: :mod:`materializer.validation`) is quarantined instead: it goes on through
   the steps below with no records, so it counts as a failed session of its prompt
   (:mod:`materializer.quarantine`).
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
5. **Parquet, markers, commit**: the Arrow table of every session's records but a duplicate's
   (late and stale sessions are kept in the dataset) is built *before* step 4's puts, so a
   session whose records the schema refuses is quarantined before any sink has them
   (:meth:`ParquetSink.fit` finds which). Then the quarantined sessions' events are appended to
   their logs, the file is staged, the markers written (the commit record, naming the session's
   attempt and the options its records were derived with; ``quarantined`` and no records for a
   quarantined session), and the file moved into the dataset (see :mod:`materializer.parquet`
   for the crash cases).
6. **Count the sessions** of the prompt's attempt into it (compare-and-set) and publish a
   status that moved forward, in the prompt's partition: ``publishing`` is recorded before
   the TransferQueue write and ``published`` after it. A retry that finds ``publishing``
   already set for a terminal status checks that the prompt key still exists, so a group a
   trainer already consumed (and cleared) is not brought back.

A crash anywhere leaves the batch unacknowledged; JetStream redelivers its signals and
every step above either finds its work done or redoes it with the same result. Several
materializer processes share the signals (one durable consumer); two that read one session
before either marked it (a redelivery while the first still works) both stage it, one marker
wins (created at revision 0), and the other leaves the session's rows out of its file before
committing it (:meth:`BatchWriter._settle`), so it is in the dataset once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import msgspec
import pyarrow as pa

from materializer.ledger import Markers, PromptLedger
from materializer.metrics import MaterializerMetrics
from materializer.parquet import ParquetSink, StagedBatch
from materializer.prompts import TERMINAL, PromptProgress, SessionOutcome
from materializer.quarantine import Quarantine, QuarantineLog
from materializer.reading import Ended, Orphan, SessionReader, StateLoader
from materializer.records import RecordOptions
from materializer.vision import ImageFetch
from reward.scorer import RewardScorer
from schemas.errors import FoldError
from schemas.records import MaterializedMarker, TrajectoryRecord, record_digest

if TYPE_CHECKING:  # importing it loads torch, Ray and TransferQueue
    from materializer.transfer_queue import TransferQueueSink

__all__ = ["BatchWriter", "Ended", "StateLoader"]

log = logging.getLogger(__name__)

_TO_TRANSFER_QUEUE = ("new", "known")  # the verdicts whose records go to TransferQueue
Plan = list[tuple[Ended, str]]  # each session of the batch with its verdict
QUARANTINED = "quarantined"  # the marker status of a quarantined session (no records, a failed session)


class _Entry(msgspec.Struct, kw_only=True):
    progress: PromptProgress
    revision: int  # 0: not stored yet


class BatchWriter:
    def __init__(self, *, load: StateLoader, markers: Markers, ledger: PromptLedger, parquet: ParquetSink,
                 tq: TransferQueueSink | None = None, options: RecordOptions = RecordOptions(),
                 rollout_n: int = 1, scorer: RewardScorer | None = None, quarantine: QuarantineLog | None = None,
                 metrics: MaterializerMetrics | None = None, images: ImageFetch | None = None) -> None:
        """``quarantine``: the log a quarantined session's event goes to (None: its marker alone says it);
        ``metrics``: where the quarantined sessions are counted (besides :attr:`quarantined`); ``images``: where
        the images of sessions with a processor come from (:mod:`materializer.vision`)."""
        self.markers = markers
        self._ledger = ledger
        self._parquet = parquet
        self._tq = tq
        self._rollout_n = rollout_n
        self._quarantine_log = quarantine
        self._metrics = metrics
        self._reader = SessionReader(load=load, quarantine=quarantine, options=options, rollout_n=rollout_n,
                                     partition=tq.partition if tq is not None else "", padding=parquet.padding,
                                     scorer=scorer, images=images)
        self.sessions = 0  # sessions this writer ended (markers written)
        self.records = 0
        self.quarantined: Counter[str] = Counter()  # sessions this writer quarantined, by stage

    @property
    def sinks(self) -> tuple[str, ...]:
        return (self._parquet.name, self._tq.name) if self._tq is not None else (self._parquet.name,)

    def _partition(self, progress: PromptProgress) -> str:
        """The TransferQueue partition of a prompt's key and trajectories."""
        return progress.partition or (self._tq.partition if self._tq is not None else "")

    async def write(self, session_ids: list[str], *, reject: Mapping[str, str] | None = None) -> list[str]:
        """Materialize the sessions; returns those that could not be read now (to retry later).
        ``reject``: sessions to quarantine instead, with the reason (their write failed alone)."""
        await self.recover()  # a batch that failed part-way (in this process or a previous one)
        session_ids = list(dict.fromkeys(session_ids))
        known = await self.markers.get_many(session_ids)
        ended, orphans, failed = await self._reader.read_all([s for s in session_ids if s not in known], reject or {})
        entries = await self._register(ended, known)
        plan = _admit(entries, ended, partition=self._partition if self._tq is not None else None)
        plan, table = await self._fit(plan)
        await self._put_records(entries, plan)
        await self._quarantine([e for e, _ in plan], orphans)
        await self._commit(plan, table, orphans)
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
            await self._settle(staged, found)
            log.warning("committed batch %s left staged by an interrupted write", staged.name)

    async def _settle(self, staged: StagedBatch, found: dict[str, MaterializedMarker]) -> None:
        """Write a staged batch's missing markers (``found``: those that exist), then commit it. A session
        whose marker names another file was written by another materializer that raced on it (both read it
        before either marked it): its rows leave this file first, so it is in the dataset once."""
        missing = [m for m in staged.markers if m.session_id not in found]
        won = await asyncio.gather(*(self.markers.create_marker(m) for m in missing))
        final = {**found, **{m.session_id: w or m for m, w in zip(missing, won, strict=True)}}
        lost = {m.session_id for m in staged.markers if final[m.session_id].parquet_file != staged.name}
        if lost:
            log.warning("batch %s: %d sessions were written by another materializer first; left out", staged.name,
                        len(lost))
            if await asyncio.to_thread(self._parquet.drop, staged.name, lost) is None:
                return
        await asyncio.to_thread(self._parquet.commit, staged.name)

    async def _register(self, ended: list[Ended], known: dict[str, MaterializedMarker]) -> dict[str, _Entry]:
        """Every prompt of the batch with its progress, at the newest attempt the batch has for it;
        new and restarted prompts stored (and tagged running)."""
        uids = [e.state.uid for e in ended] + [m.uid for m in known.values() if _of_a_prompt(m)]
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

    async def _put_records(self, entries: dict[str, _Entry], plan: Plan) -> None:
        """The records of the sessions TransferQueue takes, in their prompts' partitions."""
        if self._tq is None:
            return
        by_partition: dict[str, list[TrajectoryRecord]] = {}
        for e, verdict in plan:
            if verdict in _TO_TRANSFER_QUEUE and e.records:
                by_partition.setdefault(self._partition(entries[e.state.uid].progress), []).extend(e.records)
        for partition, records in by_partition.items():
            await self._tq.put_records(records, partition)

    async def _fit(self, plan: Plan) -> tuple[Plan, pa.Table | None]:
        """The Arrow table of what Parquet gets (every session's records but a duplicate's), built before any
        sink is written; a session whose records the schema refuses is quarantined instead."""
        written = [i for i, (e, v) in enumerate(plan) if e.records and v != "duplicate"]
        if not written:
            return plan, None
        table, refused = await asyncio.to_thread(self._parquet.fit, [plan[i][0].records for i in written])
        plan = list(plan)
        for j, reason in refused.items():
            e, verdict = plan[written[j]]
            plan[written[j]] = (e.quarantined(Quarantine("parquet", f"the Parquet schema refused it: {reason}")),
                                verdict)
        return plan, table

    async def _quarantine(self, ended: list[Ended], orphans: list[Orphan]) -> None:
        """The newly quarantined sessions' events on their logs (before their markers): one log line each."""
        pending = [(e.session_id, e.quarantine) for e in ended if e.quarantine is not None and not e.quarantine.logged]
        pending += [(o.session_id, o.quarantine) for o in orphans]
        await asyncio.gather(*(self._set_aside(session_id, quarantine) for session_id, quarantine in pending))

    async def _set_aside(self, session_id: str, quarantine: Quarantine) -> None:
        outcome = "no log"
        if self._quarantine_log is not None:
            try:
                outcome = await self._quarantine_log.record(session_id, quarantine)
            except FoldError as exc:  # the log cannot say where it ends: the marker alone will say it
                log.warning("session %s: no session_quarantined event (%s)", session_id, exc)
        if outcome == "found":  # appended before a crash: counted then
            log.info("session %s: quarantined already (%s)", session_id, quarantine.reason)
            return
        log.error("session %s quarantined (%s): %s; not materialized, counted as a failed session of its prompt",
                  session_id, quarantine.stage, quarantine.reason)
        self.quarantined[quarantine.stage] += 1
        if self._metrics is not None:
            self._metrics.quarantine(quarantine.stage)

    def _marker(self, e: Ended, verdict: str) -> MaterializedMarker:
        written = verdict != "duplicate"
        status = "duplicate" if not written else QUARANTINED if e.quarantine is not None else e.state.status
        return MaterializedMarker(
            session_id=e.session_id, stream_seq=e.stream_seq,
            digests={r.key: record_digest(r) for r in e.records} if written else {},
            sinks=(self.sinks if verdict in _TO_TRANSFER_QUEUE else (self._parquet.name,)) if e.records else (),
            status=status, uid=e.state.uid,
            session_index=e.state.session_index, attempt=e.attempt, reward=e.reward.reward if e.reward else None,
            reward_source=e.reward.source if e.reward else None,
            reward_extra_info=dict(e.reward.extra) if e.reward else {}, options=e.keys.options)

    async def _commit(self, plan: Plan, table: pa.Table | None, orphans: list[Orphan]) -> None:
        """Stage the batch's records (``table``: see :meth:`_fit`), write every marker (the commit record),
        move the file into the dataset."""
        with_records = [(e, v) for e, v in plan if e.records and v != "duplicate"]
        markers = [self._marker(e, v) for e, v in plan if not e.records or v == "duplicate"]
        markers += [MaterializedMarker(session_id=o.session_id, stream_seq=0, digests={}, status=QUARANTINED)
                    for o in orphans]
        staged = None
        if with_records:
            records = [r for e, _ in with_records for r in e.records]
            staged = await asyncio.to_thread(self._parquet.stage, records,
                                             [self._marker(e, v) for e, v in with_records], table=table)
            self.records += len(records)
        await asyncio.gather(*(self.markers.create_marker(m) for m in markers))
        if staged is not None:  # its markers (now naming the staged file), then the commit
            await self._settle(staged, {})
        self.sessions += len(plan) + len(orphans)
        if self._metrics is not None:
            self._metrics.records.inc(len(records) if with_records else 0)
            self._metrics.sessions.inc(len(plan) + len(orphans))

    async def _count(self, entries: dict[str, _Entry], plan: Plan,
                     known: dict[str, MaterializedMarker]) -> None:
        """Add the batch's sessions to their prompts (those of the prompt's attempt) and publish the statuses
        that moved forward."""
        by_uid: dict[str, list[tuple[int, SessionOutcome, int]]] = {}
        for e, verdict in plan:
            if verdict != "duplicate":
                by_uid.setdefault(e.state.uid, []).append(
                    (e.state.session_index, SessionOutcome(e.session_id, bool(e.records)), e.attempt))
        for m in known.values():
            if m.status != "duplicate" and _of_a_prompt(m):
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


def _of_a_prompt(marker: MaterializedMarker) -> bool:
    """Not the marker of a quarantined session whose log never said which prompt it was of."""
    return bool(marker.uid) or marker.status != QUARANTINED


def _newest(ended: list[Ended]) -> dict[str, Ended]:
    """Per prompt, the first session (in batch order) of the newest attempt the batch holds."""
    newest: dict[str, Ended] = {}
    for e in ended:
        had = newest.get(e.state.uid)
        if had is None or e.attempt > had.attempt:
            newest[e.state.uid] = e
    return newest


def _admit(entries: dict[str, _Entry], ended: list[Ended], *,
           partition: Callable[[PromptProgress], str] | None) -> Plan:
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
