"""The KV contract (tests/contract/kv_contract.py) against JetStream KV: :class:`eventlog.kv.KvStore` on a real
nats-server, one fresh bucket a test; and what only a server can do: a missing bucket, a stalled server."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator

import psutil
import pytest
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType

from eventlog.kv import KvStore
from schemas.errors import LogUnavailable
from tests.contract.kv_contract import KvContract
from tests.integration.test_log_outage import (
    Private,
    private,  # noqa: F401 - a fixture
)


@pytest.fixture
async def bucket(js: JetStreamContext) -> AsyncIterator[str]:
    name = "kv_contract_" + secrets.token_hex(4)
    await js.create_key_value(KeyValueConfig(bucket=name, history=1, storage=StorageType.MEMORY))
    yield name
    await js.delete_key_value(name)


class TestJetStreamKv(KvContract):
    @pytest.fixture
    def store(self, js: JetStreamContext, bucket: str) -> KvStore:
        return KvStore(js, bucket, timeout=5.0)


async def test_a_bucket_that_does_not_exist_is_named(js: JetStreamContext) -> None:
    with pytest.raises(LogUnavailable, match="KV bucket no_such_bucket does not exist"):
        await KvStore(js, "no_such_bucket").get("k")


async def test_items_read_the_live_keys_in_one_pass(js: JetStreamContext, bucket: str) -> None:
    store = KvStore(js, bucket)
    assert [item async for item in store.items()] == []
    for key in ("a", "b", "c"):
        await store.put(key, key.encode() * 2)
    await store.put("a", b"again")
    await store.delete("b")
    assert sorted([item async for item in store.items()]) == [("a", b"again"), ("c", b"cc")]


def _stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until every thread of ``pid`` is stopped (a loaded machine may take a moment)."""
    deadline = time.monotonic() + timeout_s
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, "the server did not stop"
        time.sleep(0.01)


async def test_a_stalled_server_is_log_unavailable_within_the_timeout(private: Private) -> None:  # noqa: F811
    js = private.nc.jetstream()
    await js.create_key_value(KeyValueConfig(bucket="stalled", history=1))
    store = await KvStore(js, "stalled", timeout=1.0).bind()
    await store.put("k", b"v")
    os.kill(private.server.pid, signal.SIGSTOP)
    try:
        _stopped(private.server.pid)
        for what, call in [("get", store.get("k")), ("update", store.update("k", b"w", 1)),
                           ("create", store.create("new", b"v"))]:
            started = time.monotonic()
            with pytest.raises(LogUnavailable):
                await call
                pytest.fail(f"{what} was answered by a stopped server")
            assert time.monotonic() - started < 3.0, what
    finally:
        os.kill(private.server.pid, signal.SIGCONT)
    await asyncio.sleep(0.2)
    assert await store.get("k") is not None  # and it recovers by itself
