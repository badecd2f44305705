"""Clients that misbehave, against the real edge app on the edge's server (stack.runtime.EdgeServer,
granian) in front of real JetStream and a scripted SGLang engine: half a request that stalls, a huge
header, a body that stops after the edge answered. Each is cut off while the other clients are served.
RL agents are optimised against whatever they can reach, so the server must hold its ground."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from nats.aio.client import Client

from edge.app import create_app
from edge.engines.sglang import SGLangEngine
from edge.settings import EdgeSettings
from rollbus.testing.scripted import ScriptedEngineServer
from schemas.log import LogConfig
from stack.runtime import EdgeServer, bind, build_edge_service

ADMIN = "hostile-admin"
TIMEOUT_S = 2.0  # the server's header read timeout here
MAX_BODY = 1 << 20  # the edge's request body limit here
BODY_TIMEOUT_S = 1.0  # the edge's limit on a body that sends nothing, here
HALF_A_REQUEST = b"POST /sessions/0123/v1/chat/completions HTTP/1.1\r\nHost: edge\r\nContent-Ty"


class Edge:
    def __init__(self, url: str, port: int) -> None:
        self.url = url
        self.port = port

    async def turn(self, client: httpx.AsyncClient) -> None:
        """A whole session and one model turn: the edge serves."""
        opened = await client.post("/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
        assert opened.status_code == 201, opened.text
        session = opened.json()
        reply = await client.post(f"{session['base_url']}/chat/completions",
                                  json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                                  headers={"Authorization": f"Bearer {session['api_key']}"})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["role"] == "assistant"

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)


@pytest.fixture
async def edge(nc: Client, log_config: LogConfig, engine: ScriptedEngineServer) -> AsyncIterator[Edge]:
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    settings = EdgeSettings(public_url=url, admin_token=ADMIN, log=log_config, edge_id=f"hostile:{port}",
                            max_trajectory_length=4096, max_request_bytes=MAX_BODY, body_timeout_s=BODY_TIMEOUT_S)
    service = build_edge_service(settings, nc, SGLangEngine([engine.url]))
    server = EdgeServer(create_app(service), sock, header_read_timeout=TIMEOUT_S)
    task = asyncio.ensure_future(server.serve())
    try:
        yield Edge(url, port)
    finally:
        server.stop()
        await asyncio.wait_for(task, 10)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(service.registry.close(), 5)
        await service.close_log()
        await service._turns._engine.aclose()


async def _until_closed(reader: asyncio.StreamReader, limit: float) -> bytes:
    """What the server sends until it closes the connection (within ``limit`` seconds, else the test fails)."""
    try:
        return await asyncio.wait_for(reader.read(-1), limit)
    except ConnectionResetError:
        return b""


async def test_half_a_request_that_stalls_is_cut_off_while_other_clients_are_served(edge: Edge) -> None:
    loop = asyncio.get_running_loop()
    stalled = []
    for _ in range(16):
        reader, writer = await edge.connect()
        writer.write(HALF_A_REQUEST)  # and nothing more, ever
        stalled.append((reader, writer))
    started = loop.time()
    closing = [asyncio.ensure_future(_until_closed(reader, 5 * TIMEOUT_S)) for reader, _ in stalled]
    async with httpx.AsyncClient(base_url=edge.url, timeout=5) as client:
        await edge.turn(client)  # served at once, while the stalled clients hold their connections
        assert (await client.get("/healthz")).status_code == 200
    assert loop.time() - started < TIMEOUT_S and not any(task.done() for task in closing)
    outs = await asyncio.gather(*closing)
    waited = loop.time() - started
    assert all(out == b"" or out.startswith(b"HTTP/1.1 408") for out in outs)  # no request ever reached the app
    assert 0.5 * TIMEOUT_S < waited < 4 * TIMEOUT_S  # cut off after the server's timeout, not held forever
    for _, writer in stalled:
        writer.close()
    async with httpx.AsyncClient(base_url=edge.url, timeout=5) as client:
        await edge.turn(client)


async def test_an_idle_connection_is_closed_after_the_timeout(edge: Edge) -> None:
    reader, writer = await edge.connect()
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: edge\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    started = asyncio.get_running_loop().time()
    await _until_closed(reader, 5 * TIMEOUT_S)  # the rest of the reply, then the close
    assert asyncio.get_running_loop().time() - started > 0.5 * TIMEOUT_S
    writer.close()


async def test_a_huge_header_is_refused_and_the_edge_keeps_serving(edge: Edge) -> None:
    reader, writer = await edge.connect()
    writer.write(HALF_A_REQUEST + b"pe: application/json\r\nX-Pad: " + b"a" * (2 << 20) + b"\r\n\r\n")
    with contextlib.suppress(ConnectionError):  # the server may stop reading before it is all sent
        await writer.drain()
    out = await _until_closed(reader, 5)
    assert out == b"" or out.startswith(b"HTTP/1.1 431")
    writer.close()
    async with httpx.AsyncClient(base_url=edge.url, timeout=5) as client:
        await edge.turn(client)


async def test_a_body_that_stalls_after_the_edge_answered_does_not_hold_the_connection(edge: Edge) -> None:
    async with httpx.AsyncClient(base_url=edge.url, timeout=5) as client:
        opened = await client.post("/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
    session = opened.json()
    path = session["base_url"].removeprefix(edge.url) + "/chat/completions"
    reader, writer = await edge.connect()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer {session['api_key']}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {4 * MAX_BODY}\r\n\r\n".encode()
                 + b'{"model": "m", "messages": [')  # the rest never comes
    out = await _until_closed(reader, 3 * TIMEOUT_S)  # answered at once (declared too large), then closed
    assert out.startswith(b"HTTP/1.1 413"), out[:200]
    writer.close()
    async with httpx.AsyncClient(base_url=edge.url, timeout=5) as client:
        await edge.turn(client)


@pytest.mark.parametrize("route", ["model", "admin"])
async def test_a_body_that_stalls_while_it_is_read_is_refused_after_the_timeout(edge: Edge, route: str) -> None:
    """The server bounds the time to the headers only; the edge bounds a body that stops coming."""
    async with httpx.AsyncClient(base_url=edge.url, timeout=5) as client:
        opened = await client.post("/sessions", json={}, headers={"Authorization": f"Bearer {ADMIN}"})
    session = opened.json()
    path, key = (session["base_url"].removeprefix(edge.url) + "/chat/completions", session["api_key"]) \
        if route == "model" else ("/sessions", ADMIN)
    reader, writer = await edge.connect()
    started = asyncio.get_running_loop().time()
    writer.write(f"POST {path} HTTP/1.1\r\nHost: edge\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode() + b'{"model": ')
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10 * BODY_TIMEOUT_S)
    waited = asyncio.get_running_loop().time() - started
    assert head.startswith(b"HTTP/1.1 400"), head
    assert BODY_TIMEOUT_S * 0.9 < waited < 6 * BODY_TIMEOUT_S
    body = await asyncio.wait_for(reader.read(4096), 5)
    assert b"stalled" in body, body
    writer.close()
    async with httpx.AsyncClient(base_url=edge.url, timeout=5) as client:
        await edge.turn(client)
