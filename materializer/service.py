"""The materializer service: ready signals -> sessions rebuilt from the log -> records -> sinks.

It consumes the projector's ready signals (one per ended session) in batches: up to
``max_batch`` signals, waiting at most ``max_delay`` seconds after the first, so the
records of many sessions go to TransferQueue in few puts and to Parquet in one file.
Each batch is written by :class:`BatchWriter` (exactly once, see :mod:`materializer.batch`)
and only then acknowledged. On start, batches a previous process left in Parquet staging
are committed or discarded (:meth:`Materializer.recover`).

Scale-out: every materializer process pulls from the same durable consumer (``durable``), so
JetStream hands each ready signal to one of them, and one nobody acknowledged within ``ack_wait``
(its process died) to another: the work is shared by session with nothing to configure (no
partition count, no second copy of the signals in a work queue). A session two processes hold at
once is still written once: its marker is created at revision 0 and the loser drops its copy
(:mod:`materializer.batch`); each process stages Parquet in a directory of its own, and adopts a
dead one's (:mod:`materializer.parquet`). See ``docs/operations.md``.

Failures, by kind (:meth:`Materializer.write`):

- a session that cannot be materialized is quarantined within its batch, which is written
  (:mod:`materializer.quarantine`);
- a transient failure (:data:`~materializer.quarantine.TRANSIENT`: JetStream, TransferQueue or
  the scorer not answering) that stops the whole batch is retried after a backoff that doubles
  from ``retry_delay`` up to ``max_retry_delay`` (reset by the next batch written);
- any other failure of a whole batch (a bug that some session's data sets off) narrows it down:
  each half is written on its own, down to the single session whose write fails, which is
  quarantined (stage ``write``), so no batch is retried forever. A session that has a marker
  (its records are written) but whose prompt's bookkeeping still fails alone is logged and
  acknowledged. A session whose quarantine cannot be written either is not acknowledged: its
  signal is redelivered (after the consumer's nak delay) and tried again.

The invariant, for every ready signal: it is acknowledged only once the session has a marker
(records written, or quarantined), or when it is not a ready signal at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import msgspec

from eventlog.consumer import backoff, consume_batches
from eventlog.lag import Watched
from eventlog.port import Delivery, LogPort
from eventlog.retrying import until_stopped
from materializer.batch import BatchWriter
from materializer.ledger import Markers, PromptLedger
from materializer.metrics import MaterializerMetrics
from materializer.options import MaterializerOptions
from materializer.parquet import ParquetSink
from materializer.quarantine import TRANSIENT, QuarantineLog
from materializer.validation import bounded
from observability.registry import Metrics
from reward.scorer import RewardScorer
from schemas.log import ReadySignal

if TYPE_CHECKING:  # importing it loads torch, Ray and TransferQueue
    from materializer.transfer_queue import TransferQueueSink

log = logging.getLogger(__name__)

_ready = msgspec.json.Decoder(ReadySignal)


class Materializer:
    def __init__(self, log: LogPort, sink: ParquetSink, *,
                 options: MaterializerOptions = MaterializerOptions(), tq: TransferQueueSink | None = None,
                 scorer: RewardScorer | None = None, metrics: Metrics | None = None) -> None:
        """``log``: the log it consumes ready signals from, reads sessions from, appends quarantine events to
        and keeps its markers and prompt ledger in (:class:`eventlog.jetstream.JetStreamPort`, or the in-memory
        log); ``metrics``: where quarantined sessions are counted (e.g. the edge's ``/metrics``)."""
        self._log = log
        self._cfg = log.cfg
        self._sink = sink
        self._options = options
        self._tq = tq
        self._scorer = scorer
        self._metrics = metrics.group(MaterializerMetrics) if metrics is not None else None
        self._writer: BatchWriter | None = None
        self._stop = asyncio.Event()
        self._transient_failures = 0  # batches in a row that failed whole and transiently

    @property
    def materialized(self) -> int:
        """Sessions this process ended (marked), whatever they held."""
        return self._writer.sessions if self._writer is not None else 0

    async def writer(self) -> BatchWriter:
        if self._writer is None:
            markers = await Markers(self._log.kv(self._cfg.markers_bucket, timeout=10.0)).bind()
            ledger = await PromptLedger(self._log.kv(self._cfg.prompts_bucket, timeout=10.0)).bind()
            self._writer = BatchWriter(load=lambda sid: self._log.load_state(sid), markers=markers,
                                       ledger=ledger, parquet=self._sink, tq=self._tq,
                                       options=self._options.records, rollout_n=self._options.rollout_n,
                                       scorer=self._scorer, quarantine=QuarantineLog(self._log),
                                       metrics=self._metrics, images=self._log.image)
        return self._writer

    async def recover(self) -> None:
        """Commit or discard the Parquet batches a previous process left staged (see BatchWriter.recover)."""
        await (await self.writer()).recover()

    @property
    def watched(self) -> Watched:
        """Its durable consumer of ready signals, for its lag (``observability.lag.watch_lag``)."""
        return Watched(name="materializer", stream=self._cfg.ready_stream, durable=self._options.durable,
                       subject=self._cfg.ready_subjects)

    async def run(self, stop: asyncio.Event) -> None:
        self._stop = stop
        # a server that does not answer yet (stalled, restarting) is waited for; once stopped, the consumer returns
        await until_stopped(stop, TRANSIENT, self.recover, first=self._options.retry_delay,
                            most=self._options.max_retry_delay, logger=log, what="staged batches not recovered")
        o = self._options
        try:
            await consume_batches(self._log, stream=self._cfg.ready_stream, durable=o.durable,
                                  subject=self._cfg.ready_subjects, handler=self._on_batch, stop=stop,
                                  max_batch=o.max_batch, max_delay=o.max_delay, ack_wait=o.ack_wait)
        finally:
            await self._log.close()

    async def _on_batch(self, msgs: list[Delivery]) -> list[Delivery]:
        by_session: dict[str, list[Delivery]] = {}
        for msg in msgs:
            try:
                by_session.setdefault(_ready.decode(msg.data).session_id, []).append(msg)
            except msgspec.DecodeError:  # not a ready signal: retrying cannot help, so it is acknowledged
                log.error("%s: not a ready signal (%r); skipped", msg.subject, msg.data[:80])
        try:
            failed = await self.write(list(by_session))
        except TRANSIENT as exc:
            self._transient_failures += 1
            if self._metrics is not None:
                self._metrics.transient.inc()
            delay = backoff(self._transient_failures, self._options.retry_delay, self._options.max_retry_delay)
            log.warning("batch of %d sessions not written (%s); retrying in %.1fs", len(by_session), exc, delay)
            with contextlib.suppress(TimeoutError):  # a stop cuts the wait short
                await asyncio.wait_for(self._stop.wait(), delay)
            return msgs
        self._transient_failures = 0
        if failed:
            log.warning("materialized %d sessions; %d not written, will retry", len(by_session) - len(failed),
                        len(failed))
        else:
            log.info("materialized %d sessions", len(by_session))
        return [msg for session_id in failed for msg in by_session[session_id]]

    async def write(self, session_ids: list[str]) -> list[str]:
        """Write the sessions; returns those to retry. A transient failure of the whole batch is raised; any
        other failure narrows the batch down by halves, and a single session that fails alone is quarantined."""
        writer = await self.writer()
        try:
            return await writer.write(session_ids)
        except TRANSIENT:
            raise
        except Exception as exc:  # whatever it is, some session's data set it off: find which
            if len(session_ids) == 1:
                return await self._set_aside(session_ids[0], exc)
            log.error("a batch of %d sessions failed (%s); writing it in halves", len(session_ids), _short(exc))
        half = len(session_ids) // 2
        failed = []
        for part in (session_ids[:half], session_ids[half:]):
            try:
                failed += await self.write(part)
            except TRANSIENT as exc:
                log.warning("%d sessions not written (%s); will retry", len(part), exc)
                failed += part
        return failed

    async def _set_aside(self, session_id: str, exc: Exception) -> list[str]:
        """Quarantine a session whose write fails alone (or, if it is marked already, acknowledge it)."""
        writer = await self.writer()
        if await writer.markers.get_many([session_id]):
            log.error("session %s: its records are written, but its prompt's bookkeeping fails (%s); its ready "
                      "signal is acknowledged", session_id, _short(exc), exc_info=exc)
            return []
        log.error("session %s: its write fails on its own (%s)", session_id, _short(exc), exc_info=exc)
        try:
            return await writer.write([session_id], reject={session_id: f"its write failed: {_short(exc)}"})
        except TRANSIENT:
            raise
        except Exception as again:  # its signal stays unacknowledged: acknowledged means written
            log.error("session %s cannot even be quarantined (%s); its ready signal is redelivered", session_id,
                      _short(again), exc_info=again)
            return [session_id]

    async def materialize(self, session_id: str) -> int:
        """Materialize one ended session now; returns how many records it has in the dataset."""
        writer = await self.writer()
        await writer.write([session_id])
        marker = (await writer.markers.get_many([session_id])).get(session_id)
        return len(marker.digests) if marker is not None else 0


def _short(exc: BaseException) -> str:
    return bounded(f"{type(exc).__name__}: {exc}", 300)
