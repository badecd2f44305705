"""The materializer's one invariant, against a real nats-server: a ready signal is acknowledged only once
its session has a marker (its records written, or quarantined). A server's limit or a sink's refusal is
transient: the signals wait, nothing is quarantined for it, and once the limit is gone every session is
written exactly once.

Each test watches the service where it decides: the batches its consumer hands it, and what it answers
(the signals to redeliver; the rest are acknowledged). At that moment every acknowledged session must have
its marker already."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from eventlog.kv import KvStore
from eventlog.publisher import JetStreamLog
from materializer.ledger import Markers
from materializer.parquet import ParquetSink
from materializer.service import Materializer
from schemas.log import MAX_PAYLOAD, LogConfig, ReadySignal
from schemas.records import MaterializedMarker
from stack.provision import connect, provision
from tests.integration.test_materializer import _expected_records
from tests.integration.test_materializer import running as materializing
from tests.sessions import append, workload

_signal = msgspec.json.Decoder(ReadySignal)


class Watched(Materializer):
    """The real service; after each batch it checks the invariant for what it is about to acknowledge."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.acked: Counter[str] = Counter()
        self.violations: list[str] = []
        self.batches = 0

    async def _on_batch(self, msgs: list[Msg]) -> list[Msg]:
        failed = await super()._on_batch(msgs)
        self.batches += 1
        redelivered = {id(m) for m in failed}
        acked = [_signal.decode(m.data).session_id for m in msgs if id(m) not in redelivered]
        markers = await (await self.writer()).markers.get_many(acked)
        self.violations += [sid for sid in acked if sid not in markers]
        self.acked.update(acked)
        return failed


def running(nc: Client, cfg: LogConfig, sink: ParquetSink):
    return materializing(nc, cfg, sink, Watched, max_delay=0.2, max_batch=256, retry_delay=0.2, max_retry_delay=1.0)


async def _marked(markers: Markers, session_ids: list[str], timeout: float) -> dict[str, MaterializedMarker]:
    """The sessions' markers, once all exist or ``timeout`` passed."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        found = await markers.get_many(session_ids)
        if len(found) == len(session_ids) or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(0.2)


def _check_written_once(sink: ParquetSink, scripts, found: dict[str, MaterializedMarker]) -> None:
    assert len(found) == len(scripts), f"{len(scripts) - len(found)} sessions unmarked"
    assert Counter(m.status for m in found.values())["quarantined"] == 0
    assert Counter(sink.read().column("key").to_pylist()) == Counter(list(_expected_records(scripts)))


@pytest.fixture
async def few_consumers(nats_server, log_config: LogConfig):
    """The test's log on a stream that takes at most 4 consumers (the projector's durable one among them):
    a server limit that a reader holding a consumer per session runs into at once."""
    client = await connect(nats_server.url, name="pytest-limits")
    js = client.jetstream()
    await js.add_stream(StreamConfig(name=log_config.stream, subjects=[log_config.subjects], storage=StorageType.FILE,
                                     retention=RetentionPolicy.LIMITS, allow_direct=True, max_msg_size=MAX_PAYLOAD,
                                     duplicate_window=log_config.duplicate_window_s, discard=DiscardPolicy.NEW,
                                     max_consumers=4))
    await provision(js, log_config)
    yield client
    await client.close()


async def test_a_server_limit_on_consumers_never_acknowledges_an_unwritten_session(few_consumers, log_config,
                                                                                  tmp_path):
    nc, js = few_consumers, few_consumers.jetstream()
    scripts = workload(prompts=40, n=4, seed=3)
    log = JetStreamLog(nc, log_config)
    sink = ParquetSink(tmp_path / "trajectories")
    async with running(nc, log_config, sink) as materializer:
        await asyncio.gather(*(append(log, s) for s in scripts))
        markers = await Markers(KvStore(js, log_config.markers_bucket, timeout=5.0)).bind()
        found = await _marked(markers, [s.session_id for s in scripts], timeout=90)
    assert materializer.violations == []
    _check_written_once(sink, scripts, found)


class FullDisk(ParquetSink):
    """A Parquet sink on a disk that is full for its first ``failures`` stagings (ENOSPC, as the OS says it)."""

    def __init__(self, directory: Path, failures: int) -> None:
        super().__init__(directory)
        self.failures = failures

    def stage(self, *args: object, **kwargs: object):  # type: ignore[override]
        if self.failures > 0:
            self.failures -= 1
            raise OSError(28, "No space left on device")
        return super().stage(*args, **kwargs)  # type: ignore[arg-type]


async def test_a_full_disk_is_waited_out_and_quarantines_nothing(nc, js, log_config, tmp_path):
    scripts = workload(prompts=10, n=3, seed=4)
    log = JetStreamLog(nc, log_config)
    sink = FullDisk(tmp_path / "trajectories", failures=6)
    async with running(nc, log_config, sink) as materializer:
        for script in scripts:
            await append(log, script)
        markers = await Markers(KvStore(js, log_config.markers_bucket, timeout=5.0)).bind()
        found = await _marked(markers, [s.session_id for s in scripts], timeout=60)
    assert sink.failures == 0 and materializer.batches > 1
    assert materializer.violations == []
    _check_written_once(sink, scripts, found)
