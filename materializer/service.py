"""The materializer service: ready signal -> session rebuilt from the log -> records -> sinks.

Idempotent by construction: records are derived from the log alone (the same fold), and
every sink write is keyed by session, so a redelivered signal rewrites identical records.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext

from materializer.parquet import ParquetSink
from materializer.records import RecordOptions, derive_records
from schemas.log import LogConfig
from session_projector.consumer import consume
from session_projector.reader import load_state
from session_projector.service import ReadySignal

log = logging.getLogger(__name__)

_ready = msgspec.json.Decoder(ReadySignal)


class Materializer:
    def __init__(self, js: JetStreamContext, cfg: LogConfig, sink: ParquetSink, *,
                 options: RecordOptions = RecordOptions(), durable: str = "rollbus-materializer") -> None:
        self._js = js
        self._cfg = cfg
        self._sink = sink
        self._options = options
        self._durable = durable
        self.materialized = 0  # sessions written by this process

    async def run(self, stop: asyncio.Event) -> None:
        await consume(self._js, stream=self._cfg.ready_stream, durable=self._durable,
                      subject=self._cfg.ready_subjects, handler=self._on_ready, stop=stop)

    async def _on_ready(self, msg: Msg) -> None:
        ready = _ready.decode(msg.data)
        await self.materialize(ready.session_id)

    async def materialize(self, session_id: str) -> int:
        """Derive and write one finalized session's records; returns how many."""
        state, _ = await load_state(self._js, self._cfg, session_id)
        if state.status != "finalized":
            log.warning("session %s is %s; nothing to materialize", session_id, state.status)
            return 0
        records = derive_records(state, self._options)
        await asyncio.to_thread(self._sink.write, session_id, records)
        self.materialized += 1
        log.info("session %s: %d trajectories written", session_id, len(records))
        return len(records)
