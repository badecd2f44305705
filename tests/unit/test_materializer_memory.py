"""The materializer (with the projector) on the in-memory log and KV: no NATS, milliseconds.

The same services that run on JetStream (``tests/integration/test_materializer*.py``), given
:class:`rollbus.testing.memory_log.InMemoryLog`, whose consumers follow JetStream's ack and redelivery rules.
What is checked is the exactly-once contract: each ended session's records are written once, whatever is
delivered twice, and a ready signal is acknowledged only after its session's output is written."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec

from materializer.parquet import ParquetSink
from materializer.records import derive_records
from materializer.service import Materializer, MaterializerOptions
from rollbus.testing.memory_consumer import DurableConsumer
from rollbus.testing.memory_kv import InMemoryKv
from rollbus.testing.memory_log import InMemoryLog
from schemas.errors import LogUnavailable
from schemas.events import SessionQuarantined
from schemas.log import HDR_MSG_ID
from schemas.records import MaterializedMarker
from session.fold import fold
from session_projector.service import Projector
from tests.helpers import SessionScript
from tests.sessions import append, workload

DURABLE = "rollbus-materializer"
OPTIONS = MaterializerOptions(max_delay=0.005, retry_delay=0.001, max_retry_delay=0.01, ack_wait=0.2)


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


@contextlib.asynccontextmanager
async def running(
    log: InMemoryLog, sink: ParquetSink, options: MaterializerOptions = OPTIONS
) -> AsyncIterator[Materializer]:
    """A projector and a materializer on ``log`` until the block ends."""
    stop = asyncio.Event()
    materializer = Materializer(log, sink, options=options)
    tasks = [asyncio.ensure_future(Projector(log).run(stop)), asyncio.ensure_future(materializer.run(stop))]
    try:
        yield materializer
    finally:
        stop.set()
        await asyncio.gather(*tasks)


def consumer(log: InMemoryLog) -> DurableConsumer:
    return log.consumers[(log.cfg.ready_stream, DURABLE)]


def settled(log: InMemoryLog) -> bool:
    """Every ready signal acknowledged."""
    found = log.consumers.get((log.cfg.ready_stream, DURABLE))
    return found is not None and len(found.acked) == len(log.ready) > 0 and not found.pending


def markers(log: InMemoryLog) -> dict[str, MaterializedMarker]:
    bucket = log.kv(log.cfg.markers_bucket)
    return {
        key: msgspec.json.decode(entry.value, type=MaterializedMarker)
        for key, entry in bucket._entries.items()
        if entry.value is not None
    }


def expected_keys(scripts: list[SessionScript]) -> Counter[str]:
    return Counter(
        r.key for s in scripts if (state := fold(s.events)).status == "finalized" for r in derive_records(state)
    )


def ended(session_id: str) -> SessionScript:
    script = SessionScript(session_id=session_id, uid="q1", metadata={"rollout_n": 1})
    script.turn(0, [1, 2], [3, 4], new_chain=True)
    script.reward(1.0)
    script.finalize()
    return script


async def test_each_ended_session_is_written_once_and_every_signal_acknowledged(tmp_path: Path) -> None:
    log = InMemoryLog(max_wait=0.005)
    scripts = workload(prompts=4, n=2, seed=5)
    sink = ParquetSink(tmp_path / "t")
    async with running(log, sink):
        for script in scripts:
            await append(log, script)
        await until(lambda: len(log.ready) == len(scripts) and settled(log))
    assert Counter(sink.read().column("key").to_pylist()) == expected_keys(scripts)
    found = markers(log)
    assert set(found) == {s.session_id for s in scripts}
    assert {sid: m.status for sid, m in found.items()} == {s.session_id: fold(s.events).status for s in scripts}


async def test_a_signal_delivered_again_after_its_ack_was_lost_gives_one_record_set(tmp_path: Path) -> None:
    log = InMemoryLog(max_wait=0.005)
    script = ended("c" * 32)
    sink = ParquetSink(tmp_path / "t")
    await log.subscribe(log.cfg.ready_stream, log.cfg.ready_subjects, DURABLE, ack_wait=0.2, max_ack_pending=256)
    consumer(log).lose_acks = 1  # the server stores the first ack of the signal nowhere: it is delivered again
    async with running(log, sink) as materializer:
        await append(log, script)
        await until(lambda: settled(log))
    assert consumer(log).deliveries[1] == 2
    assert materializer.materialized == 1  # the second delivery found the marker
    assert Counter(sink.read().column("key").to_pylist()) == expected_keys([script])


async def test_the_same_session_signalled_twice_is_written_once(tmp_path: Path) -> None:
    log = InMemoryLog(max_wait=0.005)
    script = ended("d" * 32)
    sink = ParquetSink(tmp_path / "t")
    async with running(log, sink):
        await append(log, script)
        await until(lambda: settled(log))
        signal = log.ready[0]  # a second signal for it (another Nats-Msg-Id: JetStream keeps both)
        await log.publish(signal.subject, signal.data, {**signal.headers, HDR_MSG_ID: "again"})
        await until(lambda: len(log.ready) == 2 and settled(log))
    assert Counter(sink.read().column("key").to_pylist()) == expected_keys([script])
    assert len(list(sink.directory.glob("*.parquet"))) == 1


class FailsOnce(InMemoryKv):
    """A markers bucket whose first marker write is not answered; records what the consumer had acked at
    every marker write."""

    def __init__(self, bucket: str, log: InMemoryLog) -> None:
        super().__init__(bucket)
        self._log = log
        self.failed = 0
        self.acked_at_write: list[set[int]] = []

    async def create(self, key: str, value: bytes) -> int:
        self.acked_at_write.append(set(consumer(self._log).acked))
        if not self.failed:
            self.failed += 1
            raise LogUnavailable("the markers bucket did not answer")
        return await super().create(key, value)


async def test_a_signal_whose_write_fails_is_not_acknowledged_and_is_written_when_redelivered(tmp_path: Path) -> None:
    log = InMemoryLog(redelivery_delay=0.0, max_wait=0.005)
    bucket = log.buckets[log.cfg.markers_bucket] = FailsOnce(log.cfg.markers_bucket, log)
    script = ended("e" * 32)
    sink = ParquetSink(tmp_path / "t")
    async with running(log, sink):
        await append(log, script)
        await until(lambda: settled(log))
    assert bucket.failed == 1 and bucket.acked_at_write == [set(), set()]  # never acked before its marker
    assert consumer(log).deliveries[1] == 2 and consumer(log).acked == {1}
    assert set(markers(log)) == {script.session_id}
    assert Counter(sink.read().column("key").to_pylist()) == expected_keys([script])  # the failed batch left no rows
    assert sink.staged() == []


async def test_a_session_the_sinks_cannot_hold_is_quarantined_once_on_its_log(tmp_path: Path) -> None:
    """The quarantine goes through the port too: the session's last message read back, its event appended
    after it (once, though its signal comes twice), its marker written, no rows."""
    log = InMemoryLog(max_wait=0.005)
    bad = SessionScript(session_id="f" * 32, uid="q2", metadata={"rollout_n": 1, "x": msgspec.msgpack.Ext(5, b"?")})
    bad.turn(0, [1, 2], [3, 4], new_chain=True)
    bad.finalize()
    good = ended("1" * 32)
    sink = ParquetSink(tmp_path / "t")
    await log.subscribe(log.cfg.ready_stream, log.cfg.ready_subjects, DURABLE, ack_wait=0.2, max_ack_pending=256)
    consumer(log).lose_acks = 1  # the first batch's signal comes again
    async with running(log, sink) as materializer:
        await append(log, bad)
        await until(lambda: settled(log))
        await append(log, good)
        await until(lambda: len(log.ready) == 2 and settled(log))
    events = (await log.read_session(bad.session_id)).events
    assert [type(e) for e in events[len(bad.events) :]] == [SessionQuarantined]
    assert events[-1].seq == bad.events[-1].seq + 1 and events[-1].stage == "invalid"  # type: ignore[attr-defined]
    assert markers(log)[bad.session_id].status == "quarantined"
    assert (await materializer.writer()).quarantined == Counter(invalid=1)
    assert Counter(sink.read().column("key").to_pylist()) == expected_keys([good])
