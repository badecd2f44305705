"""Reading the log while NATS is gone is :class:`LogUnavailable` (503), never an answer taken from the
silence: not "no such session", not "another edge holds it", not "another writer appended" (409).
A private nats-server per test, stopped (the client reconnecting), with its connection closed, or
paused (SIGSTOP) and resumed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from edge.app import create_app
from edge.ownership import KvLeases
from edge.service import OpenSession
from edge.session_index import KvSessionIndex, index_key
from edge.tokens.tokenizer import load_tokenizer
from eventlog.acks import AckedPublisher
from eventlog.publisher import JetStreamLog
from eventlog.reader import last_stream_seq, load_state, read_session
from rollbus.testing.scripted import ScriptedEngineServer
from schemas.errors import FoldError, LogUnavailable, PublishRejected
from schemas.events import TurnCompleted
from schemas.log import LogConfig
from session_projector.projections import read_projection
from stack.nats_server import EmbeddedNats
from stack.provision import connect, provision
from tests.helpers import SessionScript
from tests.integration.edges import make_edge, responder
from tests.integration.test_append_path import free_port

SESSION = "0123456789abcdef0123456789abcdef"
CFG = LogConfig.namespaced("outage")


class Private:
    def __init__(self, server: EmbeddedNats, nc: Client) -> None:
        self.server = server
        self.nc = nc

    async def stop(self) -> None:
        await asyncio.to_thread(self.server.stop)


@pytest_asyncio.fixture
async def private(tmp_path: Path) -> AsyncIterator[Private]:
    server = EmbeddedNats(tmp_path / "store", name="outage", port=free_port()).start()
    nc = await connect(server.url, name="outage")
    try:
        await provision(nc.jetstream(), CFG)
        yield Private(server, nc)
    finally:
        with contextlib.suppress(OSError):  # nats-py's close flushes, which fails on a dead link
            await nc.close()
        server.stop()


async def _a_session(nc: Client) -> SessionScript:
    script = SessionScript(session_id=SESSION)
    await JetStreamLog(nc, CFG).append(SESSION, script.events, 0)
    return script


@pytest.mark.parametrize("outage", ["server stopped", "connection closed"])
async def test_reading_a_session_during_an_outage_is_log_unavailable(private: Private, outage: str) -> None:
    await _a_session(private.nc)
    assert (await read_session(private.nc.jetstream(), CFG, SESSION)).last_stream_seq == 1
    await (private.stop() if outage == "server stopped" else private.nc.close())
    js = private.nc.jetstream()
    with pytest.raises(LogUnavailable):
        await last_stream_seq(js, CFG, CFG.session_filter(SESSION), timeout=1.0)
    with pytest.raises(LogUnavailable):  # not SessionNotFound: the log did not say there is none
        await load_state(js, CFG, "f" * 32)
    with pytest.raises(LogUnavailable):
        await read_session(js, CFG, SESSION, until=1)  # straight to the reader, past the lookup


@pytest.mark.parametrize("outage", ["server stopped", "connection closed"])
async def test_leases_during_an_outage_are_log_unavailable_not_owned_or_lost(private: Private, outage: str) -> None:
    js = private.nc.jetstream()
    mine = KvLeases.on(js, CFG, edge_id="a", timeout=1.0)
    handle = await mine.create(SESSION)
    other = KvLeases.on(js, CFG, edge_id="b", timeout=1.0)
    await other._store.bind()  # bound before the outage, as a running edge's is
    await (private.stop() if outage == "server stopped" else private.nc.close())
    with pytest.raises(LogUnavailable):
        await mine.read(SESSION)
    with pytest.raises(LogUnavailable):  # the write times out and its read-back fails too: unknown, not lost
        await handle.renew()
    with pytest.raises(LogUnavailable):  # not SessionOwned: nobody said who holds it
        await other.acquire(SESSION)


async def test_an_append_whose_read_back_meets_the_outage_is_log_unavailable_not_ownership_lost(
        private: Private) -> None:
    """The first attempt is stored but its acknowledgement lost; the retry is refused as "wrong last
    sequence"; the read-back that would tell this envelope from another writer's finds NATS gone."""
    script = SessionScript(session_id=SESSION)
    log = JetStreamLog(private.nc, CFG, timeout=1.0)
    inner = AckedPublisher(private.nc)
    calls: list[str] = []

    async def publish(subject: str, payload: bytes, headers: dict[str, str], timeout: float):
        calls.append(subject)
        if len(calls) == 1:
            await inner.publish(subject, payload, headers, timeout)
            raise TimeoutError("no acknowledgement")  # stored, the answer lost
        try:
            return await inner.publish(subject, payload, headers, timeout)
        except PublishRejected:
            await private.stop()  # the outage begins before the read-back
            raise

    log._publisher.publish = publish  # type: ignore[method-assign]
    with pytest.raises(LogUnavailable, match="read back"):
        await log.append(SESSION, script.events, 0)
    assert len(calls) == 2
    await asyncio.to_thread(private.server.start)  # back: the envelope was stored, once
    assert (await read_session(private.nc.jetstream(), CFG, SESSION)).last_stream_seq == 1


async def test_a_lease_index_or_projection_entry_that_does_not_decode_is_a_named_error(private: Private) -> None:
    """Not a ``msgspec.DecodeError`` escaping as an unnamed 500: who holds a lease or an index pair is
    unknown (503, as when NATS does not answer); a projection is corrupt (the log can rebuild it)."""
    js = private.nc.jetstream()
    await (await js.key_value(CFG.projections_bucket)).put(SESSION, b"\xc1")
    with pytest.raises(FoldError, match="projection does not decode"):
        await read_projection(js, CFG, SESSION)
    await (await js.key_value(CFG.leases_bucket)).put(SESSION, b"<not a lease>")
    await (await js.key_value(CFG.session_index_bucket)).put(index_key("task", 0), b"[1, 2")
    leases = KvLeases.on(js, CFG, edge_id="a", timeout=1.0)
    with pytest.raises(LogUnavailable, match="not a lease"):
        await leases.acquire(SESSION)
    with pytest.raises(LogUnavailable, match="not a session index entry"):
        await KvSessionIndex.on(js, CFG, timeout=1.0).claim("task", 0, 0, SESSION)


async def test_the_edge_answers_503_in_each_wires_shape_when_the_log_is_gone(private: Private) -> None:
    """A session another edge opened, asked of an edge whose connection is closed: it has to read the log."""
    opener = make_edge(private.nc, CFG, "http://127.0.0.1:9", edge_id="opener", clock=lambda: 0.0)
    opened = await opener.open_session(OpenSession(uid="task"))
    other_nc = await connect(private.server.url, name="other")
    asked = make_edge(other_nc, CFG, "http://127.0.0.1:9", edge_id="asked", clock=lambda: 0.0)
    await other_nc.close()
    transport = httpx.ASGITransport(app=create_app(asked))
    base = f"/sessions/{opened.session_id}"
    key = {"Authorization": f"Bearer {opened.api_key}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
        summary = await client.get(base)
        chat = await client.post(f"{base}/v1/chat/completions", headers=key,
                                 json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        messages = await client.post(f"{base}/v1/messages", headers=key,
                                     json={"model": "m", "max_tokens": 8, "messages": [{"role": "user",
                                                                                        "content": "hi"}]})
    assert summary.status_code == chat.status_code == messages.status_code == 503
    assert summary.json()["error"]["code"] == chat.json()["error"]["code"] == "log_unavailable"
    assert messages.json()["type"] == "error" and messages.json()["error"]["type"] == "overloaded_error"
    await opener._turns._engine.aclose()
    await asked._turns._engine.aclose()


async def test_an_acknowledgement_that_does_not_decode_is_a_503_at_the_edge(private: Private) -> None:
    """Something other than JetStream answers the log's subjects (its stream is gone, the KV buckets are
    not): the ack path's ``msgspec.DecodeError`` is the append's LogUnavailable, answered 503, not a 500."""
    js = private.nc.jetstream()
    await js.delete_stream(CFG.stream)

    async def garble(msg: Msg) -> None:
        await msg.respond(b"<html>502 Bad Gateway</html>")

    await private.nc.subscribe(CFG.subjects, cb=garble)
    await private.nc.flush()
    edge = make_edge(private.nc, CFG, "http://127.0.0.1:9", edge_id="garbled", clock=lambda: 0.0)
    transport = httpx.ASGITransport(app=create_app(edge))
    async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
        opened = await client.post("/sessions", json={"uid": "task"})
    await edge._turns._engine.aclose()
    assert opened.status_code == 503
    error = opened.json()["error"]
    assert error["code"] == "log_unavailable" and "not an acknowledgement" in error["message"]


async def test_a_turn_answered_503_while_the_log_stalls_is_kept_and_its_retry_is_answered_from_it(
        private: Private) -> None:
    """nats-server paused (SIGSTOP) while a turn is appended: the edge gives up (503, with Retry-After), the
    server, resumed, stores the envelope all the same. The turn is kept (docs/crashes.md, *Such a turn is kept*):
    the retry the SDKs make after a 503 (x-stainless-retry-count) is answered with it, from the log, sampling
    nothing again, so the agent sees what the record holds; the log holds it once."""
    tokenizer = load_tokenizer("builtin:qwen2.5")
    with ScriptedEngineServer(responder=responder(tokenizer)) as engine:
        edge = make_edge(private.nc, CFG, engine.url, edge_id="stalled", clock=time.time)
        edge._turns._log.inner = JetStreamLog(private.nc, CFG, timeout=1.0, attempts=2)  # gives up in ~2 s
        transport = httpx.ASGITransport(app=create_app(edge))
        async with httpx.AsyncClient(transport=transport, base_url="http://edge", timeout=60) as client:
            opened = (await client.post("/sessions", json={"uid": "stall"})).json()
            url, key = f"/sessions/{opened['session_id']}/v1/chat/completions", opened["api_key"]
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            os.kill(private.server.pid, signal.SIGSTOP)
            try:
                stalled = await client.post(url, headers={"Authorization": f"Bearer {key}"}, json=body)
            finally:
                os.kill(private.server.pid, signal.SIGCONT)
            assert stalled.status_code == 503 and stalled.json()["error"]["code"] == "log_unavailable"
            assert int(stalled.headers["retry-after"]) >= 1  # the SDKs wait that long, then retry
            stored = await _completed(private.nc, opened["session_id"])  # the resumed server took the envelope
            retried = await client.post(url, headers={"Authorization": f"Bearer {key}", "x-stainless-retry-count": "1"},
                                        json=body)
        await edge._turns._engine.aclose()
    assert retried.status_code == 200, retried.text
    assert retried.json()["choices"][0]["message"]["content"] == stored[0].text  # what the agent sees is the record
    assert retried.json()["id"].endswith(f"-{stored[0].request_no}")
    assert len(engine.requests) == 1  # sampled once: the retry was answered from the log
    assert len(await _completed(private.nc, opened["session_id"])) == 1


async def _completed(nc: Client, session_id: str, timeout: float = 30.0) -> list[TurnCompleted]:
    """The session's completed turns, once the log holds one (it may take the stalled server a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(LogUnavailable):
            events = (await read_session(nc.jetstream(), CFG, session_id)).events
            if completed := [e for e in events if isinstance(e, TurnCompleted)]:
                return completed
        assert time.monotonic() < deadline, "the stalled turn never reached the log"
        await asyncio.sleep(0.2)
