"""Provisioning the log: what it creates, idempotency, reconciliation, and the log's write rules."""

from __future__ import annotations

import asyncio
import socket

import pytest
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType
from nats.js.errors import BadRequestError

from schemas.errors import LogUnavailable, ProvisionError
from schemas.log import (
    HDR_EXPECTED_LAST_SUBJECT_SEQ,
    HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT,
    HDR_MSG_ID,
    MAX_PAYLOAD,
    LogConfig,
    msg_id,
)
from stack.nats_server import EmbeddedNats
from stack.provision import connect, provision

SESSION = "0123456789abcdef"
OTHER_SESSION = "fedcba9876543210"
ERR_WRONG_LAST_SEQUENCE = 10071


async def test_creates_the_log_stream(js: JetStreamContext, log_config: LogConfig) -> None:
    config = (await js.stream_info(log_config.stream)).config
    assert config.subjects == [log_config.subjects]
    assert config.storage == StorageType.FILE
    assert config.retention == RetentionPolicy.LIMITS
    assert config.duplicate_window == log_config.duplicate_window_s
    assert config.allow_direct is True
    assert config.max_msg_size == MAX_PAYLOAD
    assert (config.max_msgs, config.max_bytes, config.max_age) == (-1, -1, 0)


async def test_creates_the_ready_stream(js: JetStreamContext, log_config: LogConfig) -> None:
    config = (await js.stream_info(log_config.ready_stream)).config
    assert config.subjects == [log_config.ready_subjects]
    assert config.storage == StorageType.FILE
    assert config.retention == RetentionPolicy.LIMITS
    assert config.duplicate_window == log_config.duplicate_window_s


async def test_creates_the_buckets(js: JetStreamContext, log_config: LogConfig) -> None:
    for bucket in (log_config.projections_bucket, log_config.markers_bucket):
        kv = await js.key_value(bucket)
        status = await kv.status()
        assert status.history == 1
        assert status.stream_info.config.storage == StorageType.FILE


async def test_provision_twice_changes_nothing(js: JetStreamContext, log_config: LogConfig) -> None:
    before = (await js.stream_info(log_config.stream)).config
    await provision(js, log_config)
    assert (await js.stream_info(log_config.stream)).config == before


async def test_concurrent_provisioning(nats_server: EmbeddedNats, log_config: LogConfig) -> None:
    clients = [await connect(nats_server.url, name=f"provisioner-{i}") for i in range(2)]
    try:
        await asyncio.gather(*(provision(nc.jetstream(), log_config) for nc in clients for _ in range(3)))
        js = clients[0].jetstream()
        assert (await js.stream_info(log_config.stream)).config.subjects == [log_config.subjects]
        await js.key_value(log_config.markers_bucket)
    finally:
        for nc in clients:
            await nc.close()


async def test_the_log_dedups_by_msg_id(js: JetStreamContext, log_config: LogConfig) -> None:
    subject = log_config.subject(SESSION, "opened")
    headers = {HDR_MSG_ID: msg_id(SESSION, 1)}
    first = await js.publish(subject, b"one", headers=headers)
    again = await js.publish(subject, b"one", headers=headers)
    assert not first.duplicate
    assert again.duplicate
    assert again.seq == first.seq
    assert (await js.stream_info(log_config.stream)).state.messages == 1


async def test_expected_last_subject_sequence_guards_a_session(
    js: JetStreamContext, log_config: LogConfig
) -> None:
    def expect(seq: int) -> dict[str, str]:
        return {
            HDR_EXPECTED_LAST_SUBJECT_SEQ: str(seq),
            HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT: log_config.session_filter(SESSION),
        }

    first = await js.publish(log_config.subject(SESSION, "opened"), b"1", headers=expect(0))
    await js.publish(log_config.subject(OTHER_SESSION, "opened"), b"other")  # another session: no effect
    second = await js.publish(log_config.subject(SESSION, "turn"), b"2", headers=expect(first.seq))
    with pytest.raises(BadRequestError) as stale:
        await js.publish(log_config.subject(SESSION, "turn"), b"3", headers=expect(first.seq))
    assert stale.value.err_code == ERR_WRONG_LAST_SEQUENCE
    await js.publish(log_config.subject(SESSION, "turn"), b"3", headers=expect(second.seq))


async def test_updates_what_is_safe(nats_server: EmbeddedNats, log_config: LogConfig) -> None:
    nc = await connect(nats_server.url, name="pytest")
    js = nc.jetstream()
    try:
        await js.add_stream(name=log_config.stream, subjects=["legacy.>"], duplicate_window=1.0)
        await js.create_key_value(bucket=log_config.markers_bucket, history=5)
        await provision(js, log_config)
        config = (await js.stream_info(log_config.stream)).config
        history = (await (await js.key_value(log_config.markers_bucket)).status()).history
    finally:
        await nc.close()
    assert config.subjects == ["legacy.>", log_config.subjects]
    assert config.duplicate_window == log_config.duplicate_window_s
    assert config.allow_direct is True
    assert history == 1


async def test_refuses_to_change_retention(nats_server: EmbeddedNats, log_config: LogConfig) -> None:
    nc = await connect(nats_server.url, name="pytest")
    js = nc.jetstream()
    try:
        await js.add_stream(
            name=log_config.stream, subjects=[log_config.subjects], retention=RetentionPolicy.WORK_QUEUE
        )
        with pytest.raises(ProvisionError, match="retention"):
            await provision(js, log_config)
    finally:
        await nc.close()


async def test_subjects_taken_by_another_stream(nats_server: EmbeddedNats, log_config: LogConfig) -> None:
    nc = await connect(nats_server.url, name="pytest")
    js = nc.jetstream()
    try:
        # The ready stream's name is free, but its subjects belong to the (misnamed) log stream.
        await js.add_stream(name=log_config.stream, subjects=[log_config.subjects, log_config.ready_subjects])
        with pytest.raises(ProvisionError, match=log_config.ready_stream):
            await provision(js, log_config)
    finally:
        await nc.close()


async def test_connect_gives_up_on_an_absent_server() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(LogUnavailable, match=str(port)):
        await connect(f"nats://127.0.0.1:{port}", name="pytest", timeout_s=0.5)
