"""The projector service: notices ended sessions and signals "ready to materialize".

It consumes the ``finalized`` and ``aborted`` events of the log with durable consumers
and publishes one ready signal per session to the ready stream, deduplicated by
``Nats-Msg-Id = ready:<session_id>`` (a redelivered finalize publishes a duplicate the
server drops). A session ends once (finalized or aborted, never both); the materializer
writes the records of a finalized one and counts an aborted one as a failed session of
its prompt.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.client import JetStreamContext

from schemas.errors import LogUnavailable
from schemas.events import SessionAborted, SessionFinalized
from schemas.log import HDR_MSG_ID, LogConfig
from session_projector.consumer import consume
from session_projector.reader import decode_message

log = logging.getLogger(__name__)


class ReadySignal(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    stream_seq: int  # the finalize envelope's position: the session's log is complete up to here


class Projector:
    def __init__(self, js: JetStreamContext, cfg: LogConfig, *, durable: str = "rollbus-projector") -> None:
        self._js = js
        self._cfg = cfg
        self._durable = durable

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.gather(
            consume(self._js, stream=self._cfg.stream, durable=self._durable,
                    subject=self._cfg.kind_filter("finalized"), handler=self._on_ended, stop=stop),
            consume(self._js, stream=self._cfg.stream, durable=f"{self._durable}-aborted",
                    subject=self._cfg.kind_filter("aborted"), handler=self._on_ended, stop=stop),
        )

    async def _on_ended(self, msg: Msg) -> None:
        events = decode_message(msg.data, msg.headers)
        for event in events:
            if isinstance(event, SessionFinalized | SessionAborted):
                await self._signal(ReadySignal(session_id=event.session_id, stream_seq=msg.metadata.sequence.stream))

    async def _signal(self, ready: ReadySignal) -> None:
        subject = self._cfg.ready_subject(ready.session_id)
        headers = {HDR_MSG_ID: f"ready:{ready.session_id}"}
        try:
            await asyncio.wait_for(self._js.publish(subject, msgspec.json.encode(ready), headers=headers), 10)
        except (TimeoutError, NatsTimeoutError) as exc:
            raise LogUnavailable(f"ready signal for {ready.session_id} not acknowledged") from exc
        log.info("session %s ready to materialize", ready.session_id)
