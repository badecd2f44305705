"""Quarantine with the TransferQueue sink: a poison session's records reach neither sink, its batch's
innocent sessions reach both, and its prompt still gets a terminal status (it counts as failed)."""

from __future__ import annotations

import asyncio
import secrets

import msgspec

from eventlog.jetstream import JetStreamPort
from eventlog.publisher import JetStreamLog
from eventlog.reader import read_session
from materializer.parquet import ParquetSink
from materializer.service import Materializer, MaterializerOptions
from materializer.transfer_queue import TransferQueueSink
from schemas.events import SessionQuarantined
from session_projector.service import Projector
from tests.helpers import SessionScript
from tests.integration.test_materializer import _drained
from tests.integration.test_materializer_quarantine import _ready_signals
from tests.sessions import append
from tests.tq.readers import parquet_rows, tq_partition


def _session(uid: str, index: int, rollout_n: int, *, sampled: tuple[int, ...] = (7, 8), **metadata) -> SessionScript:
    script = SessionScript(session_id=secrets.token_hex(16), uid=uid, session_index=index,
                           metadata={"global_steps": 4, "rollout_n": rollout_n, "data_source": "synthetic",
                                     **metadata})
    script.turn(0, [1, 2, 3], list(sampled), new_chain=True)
    script.reward(1.0)
    script.finalize()
    return script


async def test_a_poison_session_reaches_no_sink_and_its_prompt_still_ends(nc, js, log_config, tmp_path, partition):
    innocents = [_session("pa", 0, 3), _session("pa", 2, 3)]
    odd_task = _session("pa", 1, 3, extra_info={"blob": msgspec.msgpack.Ext(7, b"?")})  # TQ could hold it, Parquet not
    wide_token = _session("pb", 0, 1, sampled=(2**31,))
    scripts = [innocents[0], odd_task, wide_token, innocents[1]]
    log = JetStreamLog(nc, log_config)
    sink = ParquetSink(tmp_path / "trajectories")
    stop = asyncio.Event()
    projector = asyncio.ensure_future(Projector(JetStreamPort(nc, log_config)).run(stop))
    for script in scripts:
        await append(log, script)
    await _ready_signals(js, log_config, len(scripts))  # so that they make one batch
    materializer = Materializer(JetStreamPort(nc, log_config), sink, tq=TransferQueueSink(partition),
                                options=MaterializerOptions(max_delay=0.3, transfer_queue=True))
    task = asyncio.ensure_future(materializer.run(stop))
    try:
        await _drained(js, log_config, len(scripts))
    finally:
        stop.set()
        await asyncio.gather(projector, task)
    rows, prompts = tq_partition(partition)
    assert sorted(rows) == ["pa_0_0", "pa_2_0"]
    assert sorted(row["key"] for row in parquet_rows(sink.directory)) == ["pa_0_0", "pa_2_0"]
    assert {uid: tag["status"] for uid, tag in prompts.items()} == {"pa": "finished", "pb": "failure"}
    assert len(list(sink.directory.glob("*.parquet"))) == 1  # one batch
    for script, problem in ((odd_task, "metadata cannot be stored as JSON"), (wide_token, "token id")):
        events = (await read_session(js, log_config, script.session_id)).events
        (event,) = [e for e in events if isinstance(e, SessionQuarantined)]
        assert event.stage == "invalid" and problem in event.reason
    assert (await materializer.writer()).quarantined["invalid"] == 2
