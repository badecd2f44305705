"""The materializer against a real nats-server: ready signals -> records in Parquet, exactly once."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import msgspec
import pytest

from edge.publisher import JetStreamLog
from materializer.batch import BatchWriter
from materializer.ledger import Markers, PromptLedger, open_bucket
from materializer.parquet import ParquetSink
from materializer.records import derive_records
from materializer.service import Materializer, MaterializerOptions
from schemas.records import MaterializedMarker, record_digest
from session_projector.fold import fold
from session_projector.service import Projector
from tests.sessions import append, expected_statuses, workload


async def _wait_for_markers(js, cfg, count: int, timeout: float = 60.0) -> Markers:
    markers = Markers(await open_bucket(js, cfg.markers_bucket), 5.0)
    kv = await js.key_value(cfg.markers_bucket)
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        with contextlib.suppress(Exception):  # "no keys found" while empty
            if len(await kv.keys()) >= count:
                return markers
        assert asyncio.get_running_loop().time() < deadline, "markers did not appear"
        await asyncio.sleep(0.1)


async def _drained(js, cfg, signals: int, timeout: float = 60.0) -> None:
    """Wait until the materializer acknowledged ``signals`` ready signals."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        with contextlib.suppress(Exception):  # the consumer is not created yet
            info = await js.consumer_info(cfg.ready_stream, "rollbus-materializer")
            if info.ack_floor.stream_seq >= signals and info.num_ack_pending == 0 and info.num_pending == 0:
                return
        assert asyncio.get_running_loop().time() < deadline, "ready signals were not acknowledged"
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def running(js, cfg, sink, **options):
    stop = asyncio.Event()
    materializer = Materializer(js, cfg, sink, options=MaterializerOptions(max_delay=0.1, **options))
    tasks = [asyncio.ensure_future(Projector(js, cfg).run(stop)), asyncio.ensure_future(materializer.run(stop))]
    try:
        yield materializer
    finally:
        stop.set()
        await asyncio.gather(*tasks)


def _expected_records(scripts):
    records = {}
    for script in scripts:
        state = fold(script.events)
        if state.status == "finalized":
            records.update({r.key: r for r in derive_records(state)})
    return records


async def test_ended_sessions_land_once_with_their_markers_and_prompt_progress(js, log_config, tmp_path):
    scripts = workload(prompts=6, n=3, seed=1)
    log = JetStreamLog(js, log_config)
    sink = ParquetSink(tmp_path / "trajectories")
    async with running(js, log_config, sink) as materializer:
        for script in scripts:
            await append(log, script)
        markers = await _wait_for_markers(js, log_config, len(scripts))
        for script in scripts[:4]:  # redelivered or repeated: nothing changes
            await materializer.materialize(script.session_id)
    table = sink.read()
    keys = table.column("key").to_pylist()
    expected = _expected_records(scripts)
    assert Counter(keys) == Counter(list(expected))  # every key, exactly once
    assert len(list(sink.directory.glob("*.parquet"))) < len(scripts)  # batches, not a file per session
    found = await markers.get_many(s.session_id for s in scripts)
    for script in scripts:
        marker = found[script.session_id]
        state = fold(script.events)
        assert marker.status == state.status and marker.uid == state.uid
        assert marker.digests == {k: record_digest(r) for k, r in expected.items() if r.session_id == state.session_id}
    ledger = PromptLedger(await open_bucket(js, log_config.prompts_bucket), 5.0)
    progress = await ledger.load(expected_statuses(scripts))
    assert {uid: p.status for uid, (p, _) in progress.items()} == expected_statuses(scripts)
    assert all(p.published == "" for p, _ in progress.values())  # nothing published without TransferQueue


async def test_rows_equal_the_pure_derivation(js, log_config, tmp_path):
    scripts = workload(prompts=3, n=2, seed=2)
    log = JetStreamLog(js, log_config)
    sink = ParquetSink(tmp_path / "t")
    async with running(js, log_config, sink):
        for script in scripts:
            await append(log, script)
        await _wait_for_markers(js, log_config, len(scripts))
    rows = {row["key"]: row for row in sink.read().to_pylist()}
    for key, record in _expected_records(scripts).items():
        row = rows[key]
        assert row["input_ids"] == record.input_ids.tolist() and row["loss_mask"] == record.loss_mask.tolist()
        assert row["rm_scores"] == pytest.approx(record.rm_scores.tolist())
        assert (row["rollout_log_probs"] is None) == (record.rollout_log_probs is None)


async def test_a_batch_staged_before_a_crash_is_committed_or_discarded_on_restart(js, log_config, tmp_path):
    scripts = workload(prompts=2, n=2, seed=3)[:3]
    states = [fold(s.events) for s in scripts]
    log = JetStreamLog(js, log_config)
    for script in scripts:
        await append(log, script)
    sink = ParquetSink(tmp_path / "t")
    records = [r for s in states for r in derive_records(s)]
    marker = [MaterializedMarker(session_id=s.session_id, stream_seq=1, uid=s.uid, session_index=s.session_index,
                                 digests={r.key: record_digest(r) for r in derive_records(s)}) for s in states]
    committed = sink.stage(records, marker)  # crash after staging and one marker: committed on restart
    markers = Markers(await open_bucket(js, log_config.markers_bucket), 5.0)
    await markers.create_marker(committed.markers[0])
    orphan = sink.stage(records[:1], [msgspec.structs.replace(marker[0], session_id="f" * 32)])  # no marker: dropped
    await Materializer(js, log_config, sink).recover()
    assert [p.name for p in sink.directory.glob("*.parquet")] == [committed.name]
    assert sink.staged() == [] and orphan.name != committed.name
    assert set(await markers.get_many(s.session_id for s in states)) == {s.session_id for s in states}
    async with running(js, log_config, sink):  # the signals come: nothing is written twice
        await _drained(js, log_config, len(scripts))
    assert Counter(sink.read().column("key").to_pylist()) == Counter(r.key for r in records)


async def test_a_batch_that_fails_between_its_markers_is_finished_by_the_next_write(js, log_config, tmp_path):
    from schemas.errors import LogUnavailable
    from session_projector.reader import load_state

    scripts = workload(prompts=2, n=2, seed=8)
    log = JetStreamLog(js, log_config)
    for script in scripts:
        await append(log, script)
    markers = Markers(await open_bucket(js, log_config.markers_bucket), 5.0)
    sink = ParquetSink(tmp_path / "t")
    writer = BatchWriter(
        load=lambda sid: load_state(js, log_config, sid), markers=markers,
        ledger=PromptLedger(await open_bucket(js, log_config.prompts_bucket), 5.0), parquet=sink)
    create, calls = markers.create_marker, []

    async def flaky(marker):
        calls.append(marker.session_id)
        if len(calls) == 2:
            raise LogUnavailable("the KV did not answer")
        await create(marker)

    markers.create_marker = flaky
    ids = [s.session_id for s in scripts]
    with pytest.raises(LogUnavailable):
        await writer.write(ids)
    assert sink.staged() and read_dataset_keys(sink) == []  # staged, some markers written, nothing visible
    await writer.write(ids)  # the redelivered batch
    assert sink.staged() == []
    assert Counter(read_dataset_keys(sink)) == Counter(list(_expected_records(scripts)))
    assert set(await markers.get_many(ids)) == set(ids)


def read_dataset_keys(sink: ParquetSink) -> list[str]:
    return sink.read().column("key").to_pylist()
