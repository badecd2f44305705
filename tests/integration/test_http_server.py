"""The edge's HTTP/1.1 protocol (edge.http_server) under uvicorn, over real sockets: framing,
keep-alive, pipelining, bodies, flow control, errors, disconnects and the reply extension."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn

from edge.http_server import DISCONNECT_EXTENSION, HIGH_WATER, REPLY_EXTENSION, EdgeHttpProtocol

Seen = dict[str, Any]


def make_app(seen: Seen) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]
        seen["scope"] = scope
        body = b""
        if path != "/no-read":
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    seen["disconnected_early"] = True
                    return
                body += message["body"]
                seen.setdefault("chunks", []).append(len(message["body"]))
                if not message["more_body"]:
                    break
        seen["body"] = body
        if path == "/echo":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/octet-stream"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
        elif path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for part in (b"one ", b"two ", b"three"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        elif path == "/reply":
            scope["extensions"][REPLY_EXTENSION](201, b"application/json", b'{"ok":true}')
        elif path == "/fail-before":
            raise ValueError("before the response")
        elif path == "/fail-after":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]})
            await send({"type": "http.response.body", "body": b"12345", "more_body": True})
            raise ValueError("after the response started")
        elif path == "/bad-header":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"x-evil", b"a\r\nset-cookie: b")]})
        elif path == "/close":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"connection", b"close"), (b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
        elif path == "/slow":
            seen["waiting"].set()
            message = await receive()  # the body is in: the next message is the client leaving
            seen["after_body"] = message["type"]
            seen["done"].set()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
        elif path == "/watch":
            scope["extensions"][DISCONNECT_EXTENSION](seen["done"].set)
            seen["waiting"].set()
            await seen["done"].wait()  # no response: the client is gone
        elif path == "/hold":
            seen["waiting"].set()
            await seen["release"].wait()
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
            await send({"type": "http.response.body", "body": b"held"})
        else:
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})

    return app


class Served:
    def __init__(self, server: uvicorn.Server, port: int, seen: Seen) -> None:
        self.server = server
        self.port = port
        self.seen = seen
        self.url = f"http://127.0.0.1:{port}"

    async def raw(self, data: bytes, *, read_until_close: bool = True, timeout: float = 5.0) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(data)
        await writer.drain()
        try:
            if read_until_close:
                return await asyncio.wait_for(reader.read(-1), timeout)
            return await asyncio.wait_for(reader.read(65536), timeout)
        finally:
            writer.close()


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    seen: Seen = {"waiting": asyncio.Event(), "done": asyncio.Event(), "release": asyncio.Event()}
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(make_app(seen), lifespan="off", log_level="warning", access_log=False,
                            http=EdgeHttpProtocol, timeout_keep_alive=1)
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:  # noqa: ASYNC110 - uvicorn offers no started event
        await asyncio.sleep(0.01)
    yield Served(server, port, seen)
    server.should_exit = True
    await asyncio.wait_for(task, 10)


def request(path: str, body: bytes = b"", *, method: str = "POST", extra: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


async def test_keep_alive_requests_on_one_connection_with_date_header(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url) as client:
        first = await client.post("/echo", content=b"hello")
        second = await client.post("/echo", content=b"again")
    assert (first.status_code, first.content, second.content) == (200, b"hello", b"again")
    assert first.headers["content-length"] == "5" and "date" in first.headers


async def test_scope_is_asgi_http(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url) as client:
        await client.post("/echo/caf%C3%A9?x=1", content=b"", headers={"X-Thing": "V"})
    scope = served.seen["scope"]
    assert scope["type"] == "http" and scope["asgi"]["version"] == "3.0" and scope["http_version"] == "1.1"
    assert scope["method"] == "POST" and scope["path"] == "/echo/café" and scope["raw_path"] == b"/echo/caf%C3%A9"
    assert scope["query_string"] == b"x=1" and scope["client"][0] == "127.0.0.1" and scope["server"][1] == served.port
    assert (b"x-thing", b"V") in scope["headers"]  # names lowercased, values as sent


async def test_pipelined_requests_are_answered_in_order(served: Served) -> None:
    out = await served.raw(request("/echo", b"first") + request("/echo", b"second")
                           + request("/echo", b"third", extra="Connection: close\r\n"))
    bodies = [part.split(b"\r\n\r\n", 1)[1][:6] for part in out.split(b"HTTP/1.1 200 OK")[1:]]
    assert bodies == [b"first", b"second", b"third"]
    assert out.count(b"connection: close") == 1


async def test_chunked_request_body_and_streamed_response(served: Served) -> None:
    async def parts() -> AsyncIterator[bytes]:
        for part in (b"ab", b"cd", b"ef"):
            yield part

    async with httpx.AsyncClient(base_url=served.url) as client:
        echoed = await client.post("/echo", content=parts())
        streamed = await client.post("/stream", content=b"")
    assert echoed.content == b"abcdef"
    assert streamed.headers["transfer-encoding"] == "chunked" and streamed.content == b"one two three"


async def test_a_large_body_flows_through_paused_reading(served: Served) -> None:
    body = bytes(range(256)) * (4 * HIGH_WATER // 256)
    async with httpx.AsyncClient(base_url=served.url) as client:
        echoed = await client.post("/echo", content=body)
    assert echoed.content == body


async def test_expect_100_continue_is_answered_when_the_body_is_read(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"body")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 OK") and await reader.readexactly(4) == b"body"
    writer.close()


async def test_head_gets_headers_without_a_body(served: Served) -> None:
    out = await served.raw(request("/echo", b"xyz", method="HEAD", extra="Connection: close\r\n"))
    assert out.startswith(b"HTTP/1.1 200 OK") and b"content-length: 3\r\n" in out and out.endswith(b"\r\n\r\n")


async def test_a_malformed_request_gets_400_and_the_connection_closes(served: Served) -> None:
    out = await served.raw(b"NOT HTTP AT ALL\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 400 Bad Request") and b"connection: close" in out
    assert out.endswith(b"Invalid HTTP request received.")


async def test_too_many_headers_or_too_long_a_target_is_a_400(served: Served) -> None:
    many = "".join(f"X-H{i}: v\r\n" for i in range(300))
    out = await served.raw(request("/echo", b"x", extra=many))
    assert out.startswith(b"HTTP/1.1 400 Bad Request") and "scope" not in served.seen
    out = await served.raw(request("/" + "a" * 70000, b"x"))
    assert out.startswith(b"HTTP/1.1 400 Bad Request") and "scope" not in served.seen


async def test_app_failure_before_the_response_is_a_500(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url) as client:
        failed = await client.post("/fail-before", content=b"x")
        refused = await client.post("/bad-header", content=b"x")
        ok = await client.post("/echo", content=b"still serving")
    assert failed.status_code == 500 and failed.headers["connection"] == "close"
    assert refused.status_code == 500  # a header that would split the response is never written
    assert b"set-cookie" not in refused.content and ok.content == b"still serving"


async def test_app_failure_after_the_response_started_closes_the_connection(served: Served) -> None:
    out = await served.raw(request("/fail-after", b"x"))
    assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(b"12345")  # cut short: the client sees the close


async def test_app_connection_close_header_closes_after_the_response(served: Served) -> None:
    out = await served.raw(request("/close"))
    assert out.count(b"connection: close") == 1 and out.endswith(b"\r\n\r\nok")


async def test_reply_extension_writes_a_whole_response(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url) as client:
        replied = await client.post("/reply", content=b"{}")
        after = await client.post("/echo", content=b"next")
    assert replied.status_code == 201 and replied.headers["content-type"] == "application/json"
    assert replied.json() == {"ok": True} and after.content == b"next"


async def test_client_leaving_is_an_http_disconnect(served: Served) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(request("/slow", b"data"))
    await asyncio.wait_for(served.seen["waiting"].wait(), 5)
    writer.close()
    await asyncio.wait_for(served.seen["done"].wait(), 5)
    assert served.seen["after_body"] == "http.disconnect" and served.seen["body"] == b"data"


async def test_on_disconnect_extension_calls_back_when_the_client_leaves(served: Served) -> None:
    _, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(request("/watch", b"data"))
    await asyncio.wait_for(served.seen["waiting"].wait(), 5)
    assert not served.seen["done"].is_set()
    writer.close()
    await asyncio.wait_for(served.seen["done"].wait(), 5)  # called from the connection's loss, no receive


async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(request("/echo", b"x"))
    await reader.readuntil(b"\r\n\r\n")
    assert await reader.readexactly(1) == b"x"
    started = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(reader.read(1), 5) == b""  # closed by the server
    assert 0.5 < asyncio.get_running_loop().time() - started < 3.0  # timeout_keep_alive=1
    writer.close()


async def test_shutdown_lets_the_request_in_flight_finish(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(request("/hold", b"data"))
    await asyncio.wait_for(served.seen["waiting"].wait(), 5)
    served.server.should_exit = True
    await asyncio.sleep(0.3)  # the server is shutting down, the response is not out yet
    served.seen["release"].set()
    out = await asyncio.wait_for(reader.read(-1), 5)  # the whole response, then the close
    assert out.startswith(b"HTTP/1.1 200 OK") and b"connection: close\r\n" in out and out.endswith(b"held")
    writer.close()
