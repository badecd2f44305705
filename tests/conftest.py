"""Shared fixtures: one embedded nats-server per session, and an isolated log per test.

Tests share the server but never a stream: ``log_config`` gives each test its own
stream, subject prefix and buckets, and removes them afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from schemas.errors import LogUnavailable
from schemas.log import LogConfig
from stack.nats_server import EmbeddedNats
from stack.provision import connect, provision


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(tmp_path_factory.mktemp("nats") / "store", name="rollbus-test") as server:
        yield server


@pytest_asyncio.fixture
async def log_config(request: pytest.FixtureRequest) -> AsyncIterator[LogConfig]:
    """A log of this test's own; dropped afterwards when the test used the server."""
    tag = secrets.token_hex(6)
    cfg = LogConfig(
        stream=f"T{tag}",
        prefix=f"t{tag}",
        ready_stream=f"T{tag}_READY",
        projections_bucket=f"t{tag}_sessions",
        markers_bucket=f"t{tag}_materialized",
        leases_bucket=f"t{tag}_leases",
        prompts_bucket=f"t{tag}_prompts",
        session_index_bucket=f"t{tag}_session_index",
        pieces_bucket=f"t{tag}_pieces",
    )
    server = request.getfixturevalue("nats_server") if "nats_server" in request.fixturenames else None
    yield cfg
    if server is not None and server.running:
        await _drop(server.url, cfg)


async def _drop(url: str, cfg: LogConfig) -> None:
    """Delete the test's streams and buckets, best effort."""
    try:
        client = await connect(url, name="pytest-cleanup", timeout_s=2)
    except LogUnavailable:
        return
    js = client.jetstream()
    names = [cfg.stream, cfg.ready_stream, f"KV_{cfg.projections_bucket}", f"KV_{cfg.markers_bucket}",
             f"KV_{cfg.leases_bucket}", f"KV_{cfg.prompts_bucket}", f"KV_{cfg.session_index_bucket}",
             f"OBJ_{cfg.pieces_bucket}"]
    for name in names:
        with contextlib.suppress(TimeoutError, NatsError):  # already gone, or never made
            await asyncio.wait_for(js.delete_stream(name), 2)
    await client.close()


@pytest_asyncio.fixture
async def nc(nats_server: EmbeddedNats, log_config: LogConfig) -> AsyncIterator[Client]:
    """A connected client, with the test's log already provisioned."""
    client = await connect(nats_server.url, name="pytest")
    await provision(client.jetstream(), log_config)
    yield client
    await client.close()


@pytest.fixture
def js(nc: Client) -> JetStreamContext:
    return nc.jetstream()
