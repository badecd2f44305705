"""Two materializers share the work of one stream, exactly once.

Several ``rollbus materializer`` processes pull from the same durable consumer of the ready
stream (JetStream hands each signal to one of them, and a signal nobody acknowledged in time
to another), and write one ``--data-dir``. What must hold: every ended session gets exactly
one marker and every trajectory key exactly one Parquet row, with both processes doing part
of the work, also when one of them is SIGKILLed mid-run (its signals go to the other, its
staged batches are adopted by the other's next write).

The second test makes the race that redelivery allows happen on purpose, in one process: two
writers (two sinks on one dataset) read the same session before either marked it; one marker
wins and the other writer leaves its copy of the session out of its file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from pathlib import Path

from eventlog.jetstream import JetStreamPort
from eventlog.kv import KvStore
from eventlog.publisher import JetStreamLog
from eventlog.reader import load_state
from materializer.batch import BatchWriter
from materializer.ledger import Markers, PromptLedger
from materializer.parquet import ParquetSink
from materializer.records import derive_records
from schemas.log import LogConfig
from session.fold import fold
from session_projector.service import Projector
from stack.nats_server import EmbeddedNats
from stack.provision import connect, provision
from tests.helpers import SessionScript
from tests.processes import MaterializerProcess
from tests.sessions import append, workload
from tests.tq.readers import parquet_rows

DURABLE = "rollbus-materializer"


def materializer(nats_url: str, data_dir: Path, name: str) -> MaterializerProcess:
    """``rollbus materializer`` (Parquet only), its output beside ``data_dir``."""
    return MaterializerProcess(nats_url, data_dir, data_dir.parent / f"{name}.log",
                               ["--batch-size", "8", "--metrics-port", "0", "--log-level", "INFO"])


async def _drained(js, cfg: LogConfig, signals: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):  # the consumer is not created yet
            info = await js.consumer_info(cfg.ready_stream, DURABLE)
            if info.ack_floor.stream_seq >= signals and info.num_ack_pending == 0 and info.num_pending == 0:
                return
        assert time.monotonic() < deadline, f"{DURABLE} did not acknowledge {signals} signals"
        await asyncio.sleep(0.2)


def _expected_keys(scripts: list[SessionScript]) -> Counter[str]:
    keys: Counter[str] = Counter()
    for script in scripts:
        state = fold(script.events)
        if state is not None and state.status == "finalized":
            keys.update(r.key for r in derive_records(state))
    return keys


def _owners(directory: Path) -> Counter[str]:
    """Committed files by the sink that staged them (``part-<batch>-<owner>.parquet``)."""
    return Counter(path.stem.rsplit("-", 1)[1] for path in directory.glob("part-*-*.parquet"))


async def test_two_materializer_processes_write_every_record_once_even_when_one_is_killed(tmp_path):
    scripts = workload(prompts=20, n=2, seed=16)  # 40 sessions
    data = tmp_path / "data"
    with EmbeddedNats(tmp_path / "nats", name="two-materializers") as server:
        nc = await connect(server.url, name="two-materializers-test")
        js, cfg = nc.jetstream(), LogConfig()
        await provision(js, cfg)
        log, stop = JetStreamLog(nc, cfg), asyncio.Event()
        projector = asyncio.ensure_future(Projector(JetStreamPort(nc, cfg)).run(stop))
        a, b = materializer(server.url, data, "a"), materializer(server.url, data, "b")
        try:
            await asyncio.gather(a.ready(), b.ready())
            killed_after = 0
            for n, script in enumerate(scripts, 1):
                await append(log, script)
                await asyncio.sleep(0.05)  # sessions end one by one, as agents finish
                if not killed_after and a.batches() and b.batches():  # both at work: kill one mid-run
                    a.kill()  # some of its signals unacknowledged, perhaps a batch staged
                    killed_after = n
            deadline = time.monotonic() + 60
            while not killed_after:  # every session ended before both had written a batch
                assert time.monotonic() < deadline, "the work was not shared"
                if a.batches() and b.batches():
                    a.kill()
                    killed_after = len(scripts)
                await asyncio.sleep(0.05)
            await _drained(js, cfg, len(scripts))
            assert b.stop() == 0, b.output.read_text()
            markers = await Markers(KvStore(js, cfg.markers_bucket, timeout=5.0)).get_many(
                s.session_id for s in scripts)
        finally:
            a.stop()
            b.stop()
            stop.set()
            await projector
            await nc.close()
    print(f"materializer a SIGKILLed after {killed_after} of {len(scripts)} sessions ended; batches: a "
          f"{a.batches()}, b {b.batches()}")
    assert sorted(markers) == sorted(s.session_id for s in scripts)  # every session ended once
    directory = data / "trajectories"
    assert ParquetSink(directory).staged() == []  # nothing left staged (the dead one's adopted, committed)
    rows = parquet_rows(directory)
    expected = _expected_keys(scripts)
    assert Counter(row["key"] for row in rows) == expected  # every key exactly once: none missing, none twice
    files = {m.parquet_file for m in markers.values() if m.digests}
    assert files == {path.name for path in directory.glob("*.parquet")}  # every file committed by its markers
    assert len(_owners(directory)) >= 2  # written by both processes
    by_session = Counter(row["session_id"] for row in rows)
    for sid, marker in markers.items():  # a marker's digests are exactly the session's rows
        assert by_session.get(sid, 0) == len(marker.digests), sid


async def test_a_session_two_writers_raced_on_is_in_the_dataset_once(nc, js, log_config, tmp_path, caplog):
    scripts = workload(prompts=3, n=3, seed=3)  # prompts 0, 1, 2: sessions 0-2, 3-5, 6-8
    log = JetStreamLog(nc, log_config)
    for script in scripts:
        await append(log, script)
    ids = [s.session_id for s in scripts]
    directory = tmp_path / "trajectories"

    async def writer() -> BatchWriter:
        return BatchWriter(load=lambda sid: load_state(js, log_config, sid),
                           markers=await Markers(KvStore(js, log_config.markers_bucket, timeout=5.0)).bind(),
                           ledger=await PromptLedger(KvStore(js, log_config.prompts_bucket, timeout=5.0)).bind(),
                           parquet=ParquetSink(directory))

    one, two = await writer(), await writer()
    await one.write([ids[0], ids[2], ids[3], ids[6]])  # the prompts are known: the writers race on the sessions alone
    with caplog.at_level(logging.WARNING, logger="materializer.batch"):
        # Both read sessions 4 and 5 before either marked them (as after a redelivery to a second process).
        batches = [(one, [ids[1], ids[4], ids[5]]), (two, [ids[4], ids[5], *ids[7:]])]
        results = await asyncio.gather(*(w.write(batch) for w, batch in batches), return_exceptions=True)
        for (w, batch), result in zip(batches, results, strict=True):
            if isinstance(result, Exception):  # a prompt's progress written concurrently: the batch is retried
                await w.write(batch)
    assert any("written by another materializer first" in r.getMessage() for r in caplog.records), results
    rows = parquet_rows(directory)
    assert Counter(row["key"] for row in rows) == _expected_keys(scripts)
    markers = await one.markers.get_many(ids)
    assert sorted(markers) == sorted(ids)
    by_file = Counter(row["session_id"] for row in rows)
    for sid, marker in markers.items():
        assert by_file.get(sid, 0) == len(marker.digests)
    assert ParquetSink(directory).staged() == []
