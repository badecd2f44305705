"""The materializer against a real nats-server: ready signals -> records in Parquet, exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import Counter

import msgspec
import pytest

from eventlog.jetstream import JetStreamPort
from eventlog.kv import KvStore
from eventlog.publisher import JetStreamLog
from materializer.batch import BatchWriter
from materializer.ledger import Markers, PromptLedger
from materializer.parquet import ParquetSink
from materializer.records import derive_records
from materializer.service import Materializer, MaterializerOptions
from schemas.records import MaterializedMarker, record_digest
from session.fold import fold
from session_projector.service import Projector
from tests.helpers import SessionScript
from tests.sessions import append, expected_statuses, workload


async def _wait_for_markers(js, cfg, count: int, timeout: float = 60.0) -> Markers:
    markers = await Markers(KvStore(js, cfg.markers_bucket, timeout=5.0)).bind()
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
async def running(nc, cfg, sink, kind: type[Materializer] = Materializer, **options):
    """A projector and a materializer (of class ``kind``) running until the block ends."""
    stop = asyncio.Event()
    materializer = kind(JetStreamPort(nc, cfg), sink, options=MaterializerOptions(**{"max_delay": 0.1, **options}))
    tasks = [asyncio.ensure_future(Projector(JetStreamPort(nc, cfg)).run(stop)),
             asyncio.ensure_future(materializer.run(stop))]
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


async def test_ended_sessions_land_once_with_their_markers_and_prompt_progress(nc, js, log_config, tmp_path,
                                                                                 caplog):
    scripts = workload(prompts=6, n=3, seed=1)
    log = JetStreamLog(nc, log_config)
    sink = ParquetSink(tmp_path / "trajectories")
    with caplog.at_level(logging.INFO, logger="materializer.service"):
        async with running(nc, log_config, sink) as materializer:
            for script in scripts:
                await append(log, script)
            markers = await _wait_for_markers(js, log_config, len(scripts))
            for script in scripts[:4]:  # redelivered or repeated: nothing changes
                await materializer.materialize(script.session_id)
    batches = [r.getMessage() for r in caplog.records if r.getMessage().startswith("materialized ")]
    assert batches and all(line.split()[2] == "sessions" for line in batches), batches
    assert not any("retry" in line for line in batches), batches  # nothing failed: no "(0 failed, will retry)"
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
    ledger = await PromptLedger(KvStore(js, log_config.prompts_bucket, timeout=5.0)).bind()
    progress = await ledger.load(expected_statuses(scripts))
    assert {uid: p.status for uid, (p, _) in progress.items()} == expected_statuses(scripts)
    assert all(p.published == "" for p, _ in progress.values())  # nothing published without TransferQueue


async def test_rows_equal_the_pure_derivation(nc, js, log_config, tmp_path):
    scripts = workload(prompts=3, n=2, seed=2)
    log = JetStreamLog(nc, log_config)
    sink = ParquetSink(tmp_path / "t")
    async with running(nc, log_config, sink):
        for script in scripts:
            await append(log, script)
        await _wait_for_markers(js, log_config, len(scripts))
    rows = {row["key"]: row for row in sink.read().to_pylist()}
    for key, record in _expected_records(scripts).items():
        row = rows[key]
        assert row["input_ids"] == record.input_ids.tolist() and row["loss_mask"] == record.loss_mask.tolist()
        assert row["rm_scores"] == pytest.approx(record.rm_scores.tolist())
        assert (row["rollout_log_probs"] is None) == (record.rollout_log_probs is None)


async def test_a_batch_staged_before_a_crash_is_committed_or_discarded_on_restart(nc, js, log_config, tmp_path):
    scripts = workload(prompts=2, n=2, seed=3)[:3]
    states = [fold(s.events) for s in scripts]
    log = JetStreamLog(nc, log_config)
    for script in scripts:
        await append(log, script)
    sink = ParquetSink(tmp_path / "t")
    records = [r for s in states for r in derive_records(s)]
    marker = [MaterializedMarker(session_id=s.session_id, stream_seq=1, uid=s.uid, session_index=s.session_index,
                                 digests={r.key: record_digest(r) for r in derive_records(s)}) for s in states]
    committed = sink.stage(records, marker)  # crash after staging and one marker: committed on restart
    markers = await Markers(KvStore(js, log_config.markers_bucket, timeout=5.0)).bind()
    await markers.create_marker(committed.markers[0])
    orphan = sink.stage(records[:1], [msgspec.structs.replace(marker[0], session_id="f" * 32)])  # no marker: dropped
    await Materializer(JetStreamPort(nc, log_config), sink).recover()
    assert [p.name for p in sink.directory.glob("*.parquet")] == [committed.name]
    assert sink.staged() == [] and orphan.name != committed.name
    assert set(await markers.get_many(s.session_id for s in states)) == {s.session_id for s in states}
    async with running(nc, log_config, sink):  # the signals come: nothing is written twice
        await _drained(js, log_config, len(scripts))
    assert Counter(sink.read().column("key").to_pylist()) == Counter(r.key for r in records)


async def test_a_batch_that_fails_between_its_markers_is_finished_by_the_next_write(nc, js, log_config, tmp_path):
    from eventlog.reader import load_state
    from schemas.errors import LogUnavailable

    scripts = workload(prompts=2, n=2, seed=8)
    log = JetStreamLog(nc, log_config)
    for script in scripts:
        await append(log, script)
    markers = await Markers(KvStore(js, log_config.markers_bucket, timeout=5.0)).bind()
    sink = ParquetSink(tmp_path / "t")
    writer = BatchWriter(
        load=lambda sid: load_state(js, log_config, sid), markers=markers,
        ledger=await PromptLedger(KvStore(js, log_config.prompts_bucket, timeout=5.0)).bind(), parquet=sink)
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


def prompt_session(uid: str, index: int, *, chains: int = 1, abort: bool = False, finished: bool = True,
                   **metadata) -> SessionScript:
    """An ended session of prompt ``uid`` opened with ``metadata`` (plus ``global_steps: 4``); chain ``c``
    samples ``c + 1`` tokens, so the last chain is the longest."""
    script = SessionScript(session_id=secrets.token_hex(16), uid=uid, session_index=index,
                           metadata={"global_steps": 4, **metadata})
    for chain in range(chains):
        script.turn(chain, [1, 2, chain], [7 + index] * (chain + 1), new_chain=True, tip=f"t{chain}")
    if abort:
        script.abort()
        return script
    script.reward(1.0, **({} if finished else {"finished": False}))
    script.finalize()
    return script


async def batch_writer(js, cfg, sink, **kwargs) -> BatchWriter:
    from eventlog.reader import load_state

    return BatchWriter(load=lambda sid: load_state(js, cfg, sid),
                       markers=await Markers(KvStore(js, cfg.markers_bucket, timeout=5.0)).bind(),
                       ledger=await PromptLedger(KvStore(js, cfg.prompts_bucket, timeout=5.0)).bind(), parquet=sink,
                       **kwargs)


async def appended(nc, cfg, *scripts: SessionScript) -> list[str]:
    log = JetStreamLog(nc, cfg)
    for script in scripts:
        await append(log, script)
    return [script.session_id for script in scripts]


async def progress_of(js, cfg, uid):
    ledger = await PromptLedger(KvStore(js, cfg.prompts_bucket, timeout=5.0)).bind()
    return (await ledger.load([uid]))[uid][0]


async def test_a_session_s_metadata_chooses_its_record_options_and_its_marker_says_which(nc, js, log_config,
                                                                                         tmp_path, caplog):
    from materializer.verify import compare

    scripts = [prompt_session("u1", 0, chains=2, trajectory_selection="longest"),
               prompt_session("u1", 1, chains=2),
               prompt_session("u1", 2, chains=2, trajectory_selection="shortest"),
               prompt_session("u1", 3, finished=False, mask_unfinished_episode=True)]
    sink = ParquetSink(tmp_path / "t")
    writer = await batch_writer(js, log_config, sink, rollout_n=4)
    with caplog.at_level(logging.WARNING, logger="materializer.metadata"):
        await writer.write(await appended(nc, log_config, *scripts))
    assert "trajectory_selection='shortest' is not 'all' or 'longest'" in caplog.text
    rows = {row["key"]: row for row in sink.read().to_pylist()}
    assert sorted(rows) == ["u1_0_1", "u1_1_0", "u1_1_1", "u1_2_0", "u1_2_1", "u1_3_0"]  # only 0 chose longest
    assert rows["u1_3_0"]["loss_mask"] == [0] and rows["u1_1_0"]["loss_mask"] == [1]
    markers = await writer.markers.get_many(s.session_id for s in scripts)
    options = [markers[s.session_id].options for s in scripts]
    assert [o.trajectory_selection for o in options] == ["longest", "all", "all", "all"]
    assert [o.mask_unfinished_episode for o in options] == [False, False, False, True]
    for script in scripts:  # what rollbus replay --verify does: the marker's options, whatever the global ones
        assert compare(fold(script.events), markers[script.session_id]) == []


async def test_a_newer_attempt_restarts_its_prompt_and_older_sessions_are_not_counted(nc, js, log_config, tmp_path):
    old = [prompt_session("u2", i, rollout_n=2, attempt=10) for i in range(2)]
    new = [prompt_session("u2", i, rollout_n=3, attempt=20, global_steps=6, prompt_status_rule="all_success")
           for i in range(3)]
    sink = ParquetSink(tmp_path / "t")
    writer = await batch_writer(js, log_config, sink)
    await writer.write(await appended(nc, log_config, old[0]))
    assert (await progress_of(js, log_config, "u2")).attempt == 10
    await writer.write(await appended(nc, log_config, old[1], new[0], new[1]))  # the old one first in the batch
    progress = await progress_of(js, log_config, "u2")
    assert (progress.attempt, progress.expected, progress.global_steps, progress.rule) == (20, 3, 6, "all_success")
    assert {i: o.session_id for i, o in progress.outcomes.items()} == {"0": new[0].session_id,
                                                                      "1": new[1].session_id}
    assert progress.status == "running"  # old[1] would have finished attempt 10, and attempt 20 with it
    await writer.write([old[0].session_id, old[1].session_id])  # redelivered: still not counted
    await writer.write(await appended(nc, log_config, new[2]))
    progress = await progress_of(js, log_config, "u2")
    assert progress.status == "finished" and set(progress.outcomes) == {"0", "1", "2"}
    markers = await writer.markers.get_many(s.session_id for s in old + new)
    assert [markers[s.session_id].attempt for s in old + new] == [10, 10, 20, 20, 20]
    sessions = Counter(sink.read().column("session_id").to_pylist())
    assert set(sessions) == {s.session_id for s in old + new}  # the stale session's records are kept in Parquet


async def test_all_success_fails_a_prompt_one_of_whose_sessions_was_aborted(nc, js, log_config, tmp_path):
    strict = [prompt_session("u3", i, rollout_n=3, abort=i == 1, prompt_status_rule="all_success")
              for i in range(3)]
    lenient = [prompt_session("u4", i, rollout_n=3, abort=i == 1) for i in range(3)]
    writer = await batch_writer(js, log_config, ParquetSink(tmp_path / "t"))
    await writer.write(await appended(nc, log_config, *strict, *lenient))
    assert (await progress_of(js, log_config, "u3")).status == "failure"
    assert (await progress_of(js, log_config, "u4")).status == "finished"
