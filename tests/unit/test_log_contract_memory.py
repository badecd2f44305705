"""The log contract (tests/contract/log_contract.py) against the in-memory log: no NATS, milliseconds."""

from __future__ import annotations

import msgspec
import pytest

from eventlog.reader import SessionLog
from rollbus.testing.memory_log import InMemoryLog, StoredMessage
from schemas.errors import LogUnavailable
from schemas.log import LogConfig
from session.fold import SessionState
from tests.contract.log_contract import LIMIT, LogContract, PortContract, session
from tests.helpers import envelopes


class MemoryBackend:
    def __init__(self, log: InMemoryLog) -> None:
        self.log = log
        self.cfg = log.cfg

    async def read(self, session_id: str, until: int | None = None) -> SessionLog:
        return await self.log.read_session(session_id, until=until)

    async def load(self, session_id: str, until: int | None = None) -> tuple[SessionState, int]:
        return await self.log.load_state(session_id, until=until)

    async def position(self, session_id: str) -> int:
        return await self.log.last_stream_seq(session_id)

    async def stored(self) -> list[StoredMessage]:
        return list(self.log.messages)

    async def piece(self, name: str) -> bytes | None:
        return self.log.pieces.get(name)

    def lose_next_ack(self) -> None:
        self.log.lose_next_ack()


class TestInMemoryLog(LogContract, PortContract):
    @pytest.fixture
    def backend(self) -> MemoryBackend:
        return MemoryBackend(InMemoryLog(msgspec.structs.replace(LogConfig(), max_event_bytes=LIMIT)))


# --- what only the in-memory log has: failures on request -----------------------------------------


@pytest.mark.parametrize("stored", [False, True])
async def test_a_failure_on_request_is_raised_once_its_envelope_stored_or_not(stored: bool) -> None:
    log = InMemoryLog()
    groups = envelopes(session().events)
    log.fail_next(LogUnavailable("no acknowledgement"), stored=stored)
    with pytest.raises(LogUnavailable):
        await log.append(session().session_id, groups[0], 0)
    assert len(log.messages) == int(stored)
    assert (await log.append(session().session_id, groups[int(stored)], int(stored))).stream_seq == 1 + int(stored)
