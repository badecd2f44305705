"""AckedPublisher and JetStreamLog against a real JetStream: a publish stores exactly the headers and payload it
was given, and acknowledgements, duplicates and rejections come back as js.publish's would."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg

from eventlog.acks import Ack, AckedPublisher
from eventlog.publisher import JetStreamLog
from schemas.errors import NoResponders, OwnershipLost, PublishRejected
from schemas.log import HDR_EXPECTED_LAST_SUBJECT_SEQ, HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT, HDR_MSG_ID, LogConfig
from tests.helpers import SessionScript

SESSION = "0123456789abcdef0123456789abcdef"


def headers(cfg: LogConfig, msg_id: str, expected_last: int, **extra: str) -> dict[str, str]:
    return {HDR_MSG_ID: msg_id, HDR_EXPECTED_LAST_SUBJECT_SEQ: str(expected_last),
            HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT: cfg.session_filter(SESSION), **extra}


async def test_a_publish_stores_headers_and_payload_as_given(nc: Client, js: JetStreamContext,
                                                                  log_config: LogConfig) -> None:
    publisher = AckedPublisher(nc)
    subject = log_config.subject(SESSION, "turn")
    payload = bytes(range(256)) * 40  # binary, CR/LF bytes included
    ack = await publisher.publish(subject, payload, headers(log_config, f"{SESSION}:1", 0, **{"Rollbus-Seq": "1-4"}), 5)
    assert (ack.stream, ack.seq, ack.duplicate) == (log_config.stream, 1, False)
    stored = await js.get_msg(log_config.stream, 1)
    assert stored.data == payload and stored.subject == subject
    assert stored.headers is not None
    assert stored.headers[HDR_MSG_ID] == f"{SESSION}:1" and stored.headers["Rollbus-Seq"] == "1-4"


async def test_duplicates_and_wrong_sequence_are_reported(nc: Client, log_config: LogConfig) -> None:
    publisher = AckedPublisher(nc)
    subject = log_config.subject(SESSION, "turn")
    first = await publisher.publish(subject, b"a", {HDR_MSG_ID: f"{SESSION}:1"}, 5)
    again = await publisher.publish(subject, b"a", {HDR_MSG_ID: f"{SESSION}:1"}, 5)
    assert (again.seq, again.duplicate) == (first.seq, True)
    with pytest.raises(PublishRejected) as rejected:
        await publisher.publish(subject, b"b", headers(log_config, f"{SESSION}:2", 0), 5)
    assert rejected.value.error.err_code == 10071


async def test_a_value_with_a_line_break_is_sanitized_by_the_client(nc: Client, js: JetStreamContext,
                                                             log_config: LogConfig) -> None:
    publisher = AckedPublisher(nc)
    subject = log_config.subject(SESSION, "turn")
    await publisher.publish(subject, b"x", headers(log_config, f"{SESSION}:1", 0, **{"Rollbus-Note": "a\r\nb"}), 5)
    stored = await js.get_msg(log_config.stream, 1)
    assert stored.headers is not None and "\n" not in stored.headers["Rollbus-Note"]


async def test_no_stream_on_the_subject_is_no_responders(nc: Client) -> None:
    with pytest.raises(NoResponders):
        await AckedPublisher(nc).publish("nobody.listens.here", b"x", {HDR_MSG_ID: "m"}, 5)


class LosesFirstAck:
    """The real publisher, except that the first attempt times out: its message stored (the ack was
    lost) or, with ``stores_first=False``, never sent."""

    def __init__(self, inner: AckedPublisher, *, stores_first: bool = True) -> None:
        self._inner = inner
        self._stores_first = stores_first
        self.calls = 0

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str], timeout: float) -> Ack:
        self.calls += 1
        if self.calls == 1 and not self._stores_first:
            raise TimeoutError("no acknowledgement")
        ack = await self._inner.publish(subject, payload, headers, timeout)
        if self.calls == 1:
            raise TimeoutError("no acknowledgement")
        return ack


async def test_a_retry_after_a_lost_ack_finds_its_envelope_stored(nc: Client, js: JetStreamContext,
                                                                  log_config: LogConfig) -> None:
    """JetStream checks the expected last sequence before its duplicate window, so the retry is refused
    as "wrong last sequence"; the log then sees the stored envelope is this one, and the append succeeds."""
    script = SessionScript(session_id=SESSION)
    log = JetStreamLog(nc, log_config)
    lossy = log._publisher = LosesFirstAck(log._publisher)  # type: ignore[assignment]
    appended = await log.append(SESSION, script.events, 0)
    assert lossy.calls == 2 and appended.stream_seq == 1
    assert [m.seq for m in await read_all(js, log_config)] == [1]  # stored once
    # After a timeout, a refusal for another writer's envelope still means the session is lost.
    other = SessionScript(session_id=SESSION, uid="someone-else")
    lossy = log._publisher = LosesFirstAck(AckedPublisher(nc), stores_first=False)  # type: ignore[assignment]
    with pytest.raises(OwnershipLost):
        await log.append(SESSION, [msgspec.structs.replace(other.events[0], seq=2)], 0)
    assert lossy.calls == 2 and [m.seq for m in await read_all(js, log_config)] == [1]


async def read_all(js: JetStreamContext, cfg: LogConfig) -> list[RawStreamMsg]:
    info = await js.stream_info(cfg.stream)
    return [await js.get_msg(cfg.stream, seq) for seq in range(1, info.state.last_seq + 1)]


async def test_every_ack_is_settled_from_the_read_loop_on_one_subscription(nc: Client, log_config: LogConfig) -> None:
    """The seam AckedPublisher relies on (eventlog.acks._Replies): nats-py hands every message of a subscription
    made with ``future=`` to that object's ``set_result``, not the first only, and starts no task to queue them
    for. Fails when a nats-py release changes either."""
    publisher = AckedPublisher(nc)
    subject = log_config.subject(SESSION, "turn")
    acks = await asyncio.gather(*(publisher.publish(subject, b"x", {HDR_MSG_ID: f"{SESSION}:{n}"}, 5)
                                  for n in range(1, 201)))
    assert sorted(ack.seq for ack in acks) == list(range(1, 201)) and not any(ack.duplicate for ack in acks)
    more = [await publisher.publish(subject, b"y", {HDR_MSG_ID: f"{SESSION}:{n}"}, 5) for n in range(201, 211)]
    assert [ack.seq for ack in more] == list(range(201, 211))
    sub = publisher._sub
    assert sub is not None and sub._wait_for_msgs_task is None and sub.pending_msgs == 0
    await publisher.close()
