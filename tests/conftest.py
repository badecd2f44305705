"""Shared fixtures: one embedded nats-server per session, and an isolated log per test.

Tests share the server but never a stream: ``log_config`` gives each test its own
stream, subject prefix and buckets, and removes them afterwards: within generous
timeouts (a loaded machine answers late, and a drop given up left the test's eight
streams on the server for the rest of the session), and never silently (a stream left
behind is a warning). A test that fails while the server is up gets the server's own
warnings as a report section: some failures reach its clients only as a fixed sentence
(``error creating store for stream``) and their cause (a full disk, no free file
descriptors) only in its log.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import warnings
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from schemas.errors import LogUnavailable
from schemas.log import LogConfig
from stack.nats_server import EmbeddedNats
from stack.provision import connect, provision

DROP_TIMEOUT_S = 30.0  # connecting, and each delete, when a test's log is dropped
_SHARED: list[EmbeddedNats] = []  # the session's server, once started
_LOG_AT = pytest.StashKey[int]()  # the size of its log when a test began


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    # die_with_parent: a pytest killed (a CI timeout, SIGKILL) takes its server along instead of leaving it
    # running alone; safe here, for a session fixture starts it from the main thread, which outlives it.
    with EmbeddedNats(tmp_path_factory.mktemp("nats") / "store", name="rollbus-test", die_with_parent=True) as server:
        _SHARED.append(server)
        yield server
        _SHARED.remove(server)


def _log_size() -> int:
    try:
        return _SHARED[0].log_path.stat().st_size if _SHARED else 0
    except OSError:
        return 0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> object:
    item.stash[_LOG_AT] = _log_size()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    if report.failed and _SHARED and report.when in ("setup", "call"):
        said = server_warnings(_SHARED[0], item.stash.get(_LOG_AT, 0))
        if said:
            report.sections.append(("the shared nats-server's warnings during this test", said))
    return report


def server_warnings(server: EmbeddedNats, since: int, most: int = 20) -> str:
    """The warning and error lines ``server`` logged from byte ``since`` of its log (the last ``most``)."""
    try:
        with server.log_path.open("rb") as log:
            log.seek(since)
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join([line for line in lines if any(f"[{level}]" in line for level in ("WRN", "ERR", "FTL"))][-most:])


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
        left = await drop(server.url, cfg)
        if left:
            warnings.warn(f"{request.node.nodeid} left streams on the shared nats-server: {'; '.join(left)}",
                          stacklevel=1)


def stream_names(cfg: LogConfig) -> list[str]:
    """The streams behind ``cfg``'s log, ready stream, KV buckets and object store."""
    return [cfg.stream, cfg.ready_stream, f"KV_{cfg.projections_bucket}", f"KV_{cfg.markers_bucket}",
            f"KV_{cfg.leases_bucket}", f"KV_{cfg.prompts_bucket}", f"KV_{cfg.session_index_bucket}",
            f"OBJ_{cfg.pieces_bucket}"]


async def drop(url: str, cfg: LogConfig, timeout_s: float = DROP_TIMEOUT_S) -> list[str]:
    """Delete the test's streams and buckets; what could not be deleted, each with why (none never made)."""
    try:
        client = await connect(url, name="pytest-cleanup", timeout_s=timeout_s)
    except LogUnavailable as exc:
        return [f"all of {cfg.stream}'s ({exc.message})"]
    js, left = client.jetstream(), []
    for name in stream_names(cfg):
        try:
            await asyncio.wait_for(js.delete_stream(name), timeout_s)
        except NotFoundError:  # never made (a test that did not provision), or gone
            pass
        except (TimeoutError, NatsError) as exc:
            left.append(f"{name} ({exc!r})")
    with contextlib.suppress(TimeoutError, NatsError):
        await client.close()
    return left


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
