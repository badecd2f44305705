"""The log contract (tests/contract/log_contract.py) against JetStream: ``JetStreamPort`` (``JetStreamLog`` and the
readers, consumers and KV buckets of :mod:`eventlog`) on a real nats-server (the test's own stream)."""

from __future__ import annotations

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from eventlog.acks import Ack, AckedPublisher
from eventlog.jetstream import JetStreamPort
from eventlog.reader import SessionLog, last_stream_seq, load_state, read_session
from rollbus.testing.memory_log import StoredMessage
from schemas.log import LogConfig
from session.fold import SessionState
from tests.contract.log_contract import LIMIT, LogContract, PortContract


class LosesFirstAck:
    """The real publisher, except that its first publish stores the message and then times out."""

    def __init__(self, inner: AckedPublisher) -> None:
        self._inner = inner
        self.calls = 0

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str], timeout: float) -> Ack:
        self.calls += 1
        ack = await self._inner.publish(subject, payload, headers, timeout)
        if self.calls == 1:
            raise TimeoutError("no acknowledgement")
        return ack


class JetStreamBackend:
    def __init__(self, nc: Client, js: JetStreamContext, cfg: LogConfig) -> None:
        self.cfg = cfg
        self.log = JetStreamPort(nc, cfg)
        self._js = js

    async def read(self, session_id: str, until: int | None = None) -> SessionLog:
        return await read_session(self._js, self.cfg, session_id, until=until)

    async def load(self, session_id: str, until: int | None = None) -> tuple[SessionState, int]:
        return await load_state(self._js, self.cfg, session_id, until=until)

    async def position(self, session_id: str) -> int:
        return await last_stream_seq(self._js, self.cfg, self.cfg.session_filter(session_id))

    async def stored(self) -> list[StoredMessage]:
        info = await self._js.stream_info(self.cfg.stream)
        found = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
            msg = await self._js.get_msg(self.cfg.stream, seq)
            found.append(StoredMessage(seq=msg.seq or 0, subject=msg.subject or "", headers=dict(msg.headers or {}),
                                       data=msg.data or b""))
        return found

    async def piece(self, name: str) -> bytes | None:
        store = await self._js.object_store(self.cfg.pieces_bucket)
        try:
            return (await store.get(name)).data
        except NotFoundError:
            return None

    def lose_next_ack(self) -> None:
        self.log._publisher = LosesFirstAck(self.log._publisher)  # type: ignore[assignment]


class TestJetStreamLog(LogContract, PortContract):
    @pytest.fixture
    def backend(self, nc: Client, js: JetStreamContext, log_config: LogConfig) -> JetStreamBackend:
        return JetStreamBackend(nc, js, msgspec.structs.replace(log_config, max_event_bytes=LIMIT))
