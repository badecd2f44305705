"""Chaos: ``rollbus materializer --transfer-queue`` is SIGKILLed at random moments while 200 sessions
finalize, restarted each time; then TransferQueue and Parquet must hold every expected key exactly
once, with contents identical to a fault-free run and every prompt status right.

The sessions' events are appended straight to the log (as the edge would), the projector runs in
this process, and TransferQueue is hosted by this process (``tq_cluster``), so it outlives every
materializer: each one joins it with ``--ray-address``, as it would join verl's trainer's.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import pytest
import transfer_queue as tq
from nats.aio.client import Client

from eventlog.jetstream import JetStreamPort
from eventlog.kv import KvStore
from eventlog.publisher import JetStreamLog
from materializer.ledger import Markers
from materializer.parquet import ParquetSink
from materializer.prompts import RANK
from materializer.records import derive_records
from materializer.service import Materializer, MaterializerOptions
from materializer.transfer_queue import TransferQueueSink
from schemas.log import LogConfig
from session.fold import fold
from session_projector.service import Projector
from stack.nats_server import EmbeddedNats
from stack.provision import connect, provision
from tests.processes import MaterializerProcess
from tests.sessions import append, expected_statuses, workload
from tests.tq.readers import parquet_rows, tq_partition

PROMPTS, N, KILLS = 50, 4, 5


def materializer(nats_url: str, data_dir: Path, ray_address: str, partition: str, run: int) -> MaterializerProcess:
    return MaterializerProcess(nats_url, data_dir, data_dir / f"materializer-{run}.log",
                               ["--transfer-queue", "--ray-address", ray_address, "--tq-partition", partition,
                                "--batch-size", "16", "--log-level", "WARNING"])


async def _drained(js, cfg: LogConfig, durable: str, signals: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = await js.consumer_info(cfg.ready_stream, durable)
            if info.ack_floor.stream_seq >= signals and info.num_ack_pending == 0 and info.num_pending == 0:
                return
        except Exception:
            pass
        assert time.monotonic() < deadline, f"{durable} did not acknowledge {signals} signals"
        await asyncio.sleep(0.2)


async def _count_markers(js, cfg: LogConfig) -> int:
    try:
        return len(await (await js.key_value(cfg.markers_bucket)).keys())
    except Exception:
        return 0


async def _reference(nc: Client, cfg: LogConfig, tmp_path: Path, partition: str, signals: int) -> Path:
    """The same signals through an in-process materializer nobody kills (its own bookkeeping and outputs)."""
    ref = LogConfig(markers_bucket="ref_materialized", prompts_bucket="ref_prompts")
    js = nc.jetstream()
    await provision(js, ref)
    sink = ParquetSink(tmp_path / "reference" / "trajectories")
    stop = asyncio.Event()
    materializer = Materializer(JetStreamPort(nc, ref), sink, tq=TransferQueueSink(partition),
                                options=MaterializerOptions(transfer_queue=True, durable="reference", max_batch=64,
                                                            max_delay=0.1))
    task = asyncio.ensure_future(materializer.run(stop))
    await _drained(js, ref, "reference", signals)
    stop.set()
    await task
    return sink.directory


@pytest.mark.slow
async def test_sigkill_at_random_moments_loses_and_duplicates_nothing(tq_cluster, tmp_path):
    scripts = workload(prompts=PROMPTS, n=N, seed=20240611)
    chunks = [scripts[i::KILLS] for i in range(KILLS)]
    partition, reference_partition = "chaos", "chaos-reference"
    rng = random.Random(7)
    data = tmp_path / "data"
    data.mkdir()
    with EmbeddedNats(tmp_path / "nats", name="chaos") as server:
        nc = await connect(server.url, name="chaos-test")
        js, cfg = nc.jetstream(), LogConfig()
        await provision(js, cfg)
        log, stop = JetStreamLog(nc, cfg), asyncio.Event()
        projector = asyncio.ensure_future(Projector(JetStreamPort(nc, cfg)).run(stop))
        seen: dict[str, list[str]] = {}
        watcher = asyncio.ensure_future(_watch_statuses(partition, seen, stop))
        marked_at_kill = []
        try:
            for run, chunk in enumerate(chunks):
                proc = materializer(server.url, data, tq_cluster, partition, run)
                await proc.ready()
                writer = asyncio.ensure_future(_append_all(log, chunk, rng))  # sessions finalize meanwhile
                await asyncio.sleep(rng.uniform(0.2, 2.5))
                proc.kill()
                marked_at_kill.append(await _count_markers(js, cfg))
                await writer
            final = materializer(server.url, data, tq_cluster, partition, KILLS)
            await final.ready()
            await _drained(js, cfg, "rollbus-materializer", len(scripts))
            assert final.stop() == 0, final.output.read_text()
            reference = await _reference(nc, cfg, tmp_path, reference_partition, len(scripts))
            markers = await Markers(KvStore(js, cfg.markers_bucket, timeout=5.0)).bind()
            found = await markers.get_many(s.session_id for s in scripts)
        finally:
            stop.set()
            await asyncio.gather(projector, watcher)
            await nc.close()
    print(f"markers at each SIGKILL: {marked_at_kill} of {len(scripts)}; prompts seen moving running -> "
          f"terminal: {sum(len(v) > 1 for v in seen.values())} of {len(seen)}")
    for uid, statuses in seen.items():  # as a trainer polling kv_list saw them: never backwards
        ranks = [RANK[s] for s in statuses]
        assert ranks == sorted(ranks), (uid, statuses)
    _check(scripts, found, data / "trajectories", reference, partition, reference_partition)


async def _watch_statuses(partition: str, seen: dict[str, list[str]], stop: asyncio.Event) -> None:
    """Poll the prompt statuses as verl's ReplayBuffer does, recording each change."""
    while not stop.is_set():
        listing = await asyncio.to_thread(tq.kv_list, partition_id=partition)
        for key, tag in listing.get(partition, {}).items():
            if tag.get("is_prompt") and (not seen.get(key) or seen[key][-1] != tag["status"]):
                seen.setdefault(key, []).append(tag["status"])
        await asyncio.sleep(0.2)


async def _append_all(log: JetStreamLog, chunk, rng: random.Random) -> None:
    for script in chunk:
        await append(log, script)
        if rng.random() < 0.2:
            await asyncio.sleep(rng.uniform(0.0, 0.2))


def _check(scripts, markers, directory: Path, reference: Path, partition: str, reference_partition: str) -> None:
    expected = {}
    for script in scripts:
        state = fold(script.events)
        if state.status == "finalized":
            expected.update({r.key: r for r in derive_records(state)})
    assert len(markers) == len(scripts)  # every session ended exactly once in the bookkeeping
    assert ParquetSink(directory).staged() == []  # nothing left half-committed
    rows = parquet_rows(directory)
    assert Counter(row["key"] for row in rows) == Counter(list(expected))  # every key, exactly once
    reference_rows = {row["key"]: row for row in parquet_rows(reference)}
    assert {row["key"]: row for row in rows} == reference_rows  # identical to the fault-free run
    chaos, prompts = tq_partition(partition)
    fault_free, reference_prompts = tq_partition(reference_partition)
    assert sorted(chaos) == sorted(expected)  # every trajectory key once (kv_list keys are unique)
    assert chaos == fault_free  # fields and tags, key by key
    statuses = expected_statuses(scripts)
    assert {uid: tag["status"] for uid, tag in prompts.items()} == statuses
    assert prompts == reference_prompts
    assert "failure" in statuses.values() and "finished" in statuses.values()
