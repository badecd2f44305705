"""Found by the chaos run (``ops/chaos/run.py --seed 2 --minutes 1.5 --faults 10 --pause 15 30``): a
projector or a materializer that starts while nats-server is stalled (SIGSTOP, a long GC or disk stall)
for longer than its first requests wait (10 s: the materializer's markers bucket, the consumers' create)
failed as a component, so ``rollbus materializer`` exited ("component materializer failed:
LogUnavailable('bucket rollbus_materialized: JetStream KV did not answer ...'); stopping"), as would
``rollbus up`` as a whole. Both must wait for the server, as they do once running, and then work."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from eventlog.jetstream import JetStreamPort
from eventlog.kv import KvStore
from eventlog.publisher import JetStreamLog
from materializer.ledger import Markers
from materializer.parquet import ParquetSink
from materializer.service import Materializer, MaterializerOptions
from session_projector.service import Projector
from tests.integration.test_log_outage import CFG, Private, _a_session

STALL_S = 12.0  # past the 10 s its first requests wait


async def test_a_projector_and_a_materializer_started_during_a_stall_wait_for_the_server(private: Private,
                                                                                         tmp_path: Path):
    script = await _a_session(private.nc)
    js, stop = private.nc.jetstream(), asyncio.Event()
    os.kill(private.server.pid, signal.SIGSTOP)
    try:
        tasks = {"projector": asyncio.ensure_future(Projector(JetStreamPort(private.nc, CFG)).run(stop)),
                 "materializer": asyncio.ensure_future(Materializer(
                     JetStreamPort(private.nc, CFG), ParquetSink(tmp_path / "trajectories"),
                     options=MaterializerOptions(max_delay=0.1)
                 ).run(stop))}
        await asyncio.sleep(STALL_S)
        failed = {name: repr(task.exception()) for name, task in tasks.items() if task.done()}
        assert failed == {}, f"gave up during the stall: {failed}"
    finally:
        os.kill(private.server.pid, signal.SIGCONT)
    try:
        script.finalize()
        await JetStreamLog(private.nc, CFG).append(script.session_id, script.events[-1:], 1)
        markers = await Markers(KvStore(js, CFG.markers_bucket, timeout=10.0)).bind()
        deadline = time.monotonic() + 60
        while not await markers.get_many([script.session_id]):
            assert time.monotonic() < deadline, "the session was never materialized after the stall"
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
