"""The edge's HTTP/1.1 protocol: uvicorn's server, a leaner connection.

uvicorn runs the edge (sockets, startup, graceful shutdown, the ``date`` header); this is
the protocol class it is given (``uvicorn.Config(http=EdgeHttpProtocol)``), in place of
its own httptools protocol. It parses with httptools too and serves any ASGI app, with
less per-request work: uvicorn's protocol spends about as much Python on a request as
the edge's whole chain matching and encoding (a scope built in steps, a cycle object
with an ``asyncio.Event``, a keep-alive timer created and cancelled per request, every
response header checked by two regular expressions). Measured with
``ops/bench/edge_overhead.py``: see the README.

What it implements (and uvicorn's protocol does alike):

* keep-alive, with ``timeout_keep_alive`` for an idle connection (one timer per
  connection, re-armed only when it fires early; a connection sending a request is not
  idle); ``Connection: close`` and HTTP/1.0;
* pipelined requests, answered in order (reading pauses while one is queued);
* request bodies as they arrive, with reading paused while more than 64 KiB wait for the
  app; ``Expect: 100-continue`` answered when the app first asks for the body;
* responses with ``content-length`` (head and body in one write when the app sends them
  back to back) or chunked; ``HEAD``; write flow control (``send`` waits while the
  transport's buffer is full);
* ``http.disconnect`` once the client is gone (or the response is complete);
* uvicorn's settings it reads: ``root_path``, ``timeout_keep_alive``, the default headers
  (``date``, ``server``) and the app as uvicorn wraps it (proxy headers); it writes no access
  log and does not apply ``limit_concurrency`` (the edge limits sessions itself);
* a malformed request (or one with over 256 headers or a 64 KiB target) gets 400 and the
  connection is closed; an upgrade request (the edge serves no WebSockets) is served as
  plain HTTP/1.1, then the connection is closed; an app that fails before its response
  starts gets 500, after it started the connection is closed.

Two ASGI extensions (``scope["extensions"]``) serve the edge's plain model replies:
``rollbus.reply(status, content_type, body)`` sends a whole response in one call and one
write, and ``rollbus.on_disconnect(callback)`` has ``callback()`` called if the client
leaves before the response is complete (``None`` stops it), so a turn needs no task
waiting on ``receive`` to notice. An app finds them absent under another server.
"""

from __future__ import annotations

import asyncio
import http
import logging
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httptools

log = logging.getLogger("rollbus.edge.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

HIGH_WATER = 65536  # request body bytes waiting for the app before reading pauses
MAX_URL = 65536  # a longer request target is refused (400)
MAX_HEADERS = 256  # more request headers are refused (400)
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in http.HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
REPLY_EXTENSION = "rollbus.reply"  # scope["extensions"][REPLY_EXTENSION]: Exchange.reply
DISCONNECT_EXTENSION = "rollbus.on_disconnect"  # scope["extensions"][DISCONNECT_EXTENSION]: Exchange.on_disconnect
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_FORMATTED: list[Any] = [None, b""]  # uvicorn's default headers list, and it formatted
_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"connection"))


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d \r\n" % status


class EdgeHttpProtocol(asyncio.Protocol):
    """One client connection. Constructed by uvicorn as its ``http`` protocol class."""

    def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not config.loaded:
            config.load()
        self.app: ASGIApp = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.root_path: str = config.root_path
        self.keep_alive_s: float = config.timeout_keep_alive
        self.server_state = server_state
        self.app_state = app_state
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.parsing: Exchange | None = None  # the request the parser's callbacks are for
        self.running: Exchange | None = None  # the request the app is answering
        self.queued: deque[Exchange] = deque()  # pipelined requests waiting for ``running``
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_continue = False
        self.read_paused = False
        self.write_paused = False
        self.writable: asyncio.Future[None] | None = None
        self.idle_since = 0.0
        self.idle_timer: asyncio.TimerHandle | None = None
        self.closed = False

    # --- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server_state.connections.add(self)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        self._idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server_state.connections.discard(self)
        for exchange in (self.running, self.parsing, *self.queued):
            if exchange is not None:
                exchange.gone()
        self.queued.clear()
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None
        self._release_writers()

    def data_received(self, data: bytes) -> None:
        self.idle_since = 0.0  # a request is coming in: the idle timer leaves the connection open
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # served as plain HTTP/1.1; the parser reads no further
            log.debug("unsupported upgrade request from %s: served without it, then closed", self.client)
            for exchange in (self.running, self.parsing, *self.queued):
                if exchange is not None:
                    exchange.keep_alive = False
        except httptools.HttpParserError:
            self._refuse("Invalid HTTP request received.")

    def eof_received(self) -> None:
        return None

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._release_writers()

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close when idle, else after the response in flight."""
        if self.running is None:
            self._close()
        else:
            self.running.keep_alive = False
            self.queued.clear()

    # --- httptools callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.expect_continue = False

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_URL:
            raise ValueError("request line too long")  # the parser's error: 400

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= MAX_HEADERS:
            raise ValueError("too many headers")  # the parser's error: 400
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        url = httptools.parse_url(self.url)
        raw_path: bytes = url.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope: Scope = {
            "type": "http", "asgi": _ASGI, "http_version": parser.get_http_version(),
            "server": self.server, "client": self.client, "scheme": "http",
            "method": parser.get_method().decode("ascii"), "root_path": self.root_path,
            "path": self.root_path + path if self.root_path else path,
            "raw_path": self.root_path.encode("ascii") + raw_path if self.root_path else raw_path,
            "query_string": url.query or b"", "headers": self.headers, "state": self.app_state.copy(),
        }
        exchange = Exchange(self, scope, parser.should_keep_alive(), self.expect_continue)
        scope["extensions"] = {REPLY_EXTENSION: exchange.reply, DISCONNECT_EXTENSION: exchange.on_disconnect}
        self.parsing = exchange
        if self.running is None:
            self._start(exchange)
        else:  # pipelined behind the one in flight: read no further until its turn
            self.queued.append(exchange)
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        exchange = self.parsing
        if exchange is None or exchange.complete:
            return
        exchange.chunks.append(body)
        exchange.buffered += len(body)
        if exchange.buffered > HIGH_WATER:
            self._pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        exchange = self.parsing
        if exchange is None:
            return
        exchange.more_body = False
        exchange.wake()
        self.parsing = None

    # --- requests ----------------------------------------------------------------------

    def _start(self, exchange: Exchange) -> None:
        self.running = exchange
        self.idle_since = 0.0  # busy: the idle timer, if it fires, leaves the connection open
        # uvicorn's shutdown waits for its tasks; the task takes itself off as it ends (a done
        # callback would cost every request one more pass of the event loop)
        exchange.task = self.loop.create_task(exchange.run(self.app))
        self.server_state.tasks.add(exchange.task)

    def response_done(self, exchange: Exchange) -> None:
        """``exchange`` sent its whole response: close, or go on with the next request."""
        self.server_state.total_requests += 1
        if self.running is exchange:
            self.running = None
        if not exchange.keep_alive or self.closed:
            self._close()
            return
        if self.queued:
            self._start(self.queued.popleft())
            if not self.queued:
                self._resume_reading()
            return
        self._resume_reading()
        self._idle()

    def _idle(self) -> None:
        self.idle_since = self.loop.time()
        if self.idle_timer is None:
            self.idle_timer = self.loop.call_at(self.idle_since + self.keep_alive_s, self._idle_check)

    def _idle_check(self) -> None:
        self.idle_timer = None
        if self.closed or self.running is not None or self.parsing is not None or not self.idle_since:
            return
        due = self.idle_since + self.keep_alive_s
        if self.loop.time() >= due:
            self._close()
        else:
            self.idle_timer = self.loop.call_at(due, self._idle_check)

    def _refuse(self, message: str) -> None:
        """400 for a request that cannot be served, and close."""
        log.warning("%s (from %s)", message, self.client)
        if self.running is None or self.running.started:  # else the 400 would interleave with a response
            self.write(self.plain(400, message))
        self._close()

    # --- transport -----------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def _default_headers(self) -> bytes:
        """uvicorn's default headers (``date``, renewed every second), formatted once per renewal."""
        headers = self.server_state.default_headers
        if _FORMATTED[0] is not headers:
            _FORMATTED[:] = [headers, b"".join([b"%s: %s\r\n" % pair for pair in headers])]
        return _FORMATTED[1]

    def plain(self, status: int, text: str) -> bytes:
        """A whole text/plain response after which the connection closes."""
        body = text.encode("ascii")
        return self.head(status, b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n" % len(body),
                         False) + body

    def head(self, status: int, headers: bytes, keep_alive: bool) -> bytes:
        """A response's status line and headers: uvicorn's defaults, then ``headers`` (formatted)."""
        return b"".join((status_line(status), self._default_headers(), headers,
                         b"\r\n" if keep_alive else b"connection: close\r\n\r\n"))

    async def drain(self) -> None:
        if self.writable is None:
            self.writable = self.loop.create_future()
        await self.writable

    def _release_writers(self) -> None:
        if self.writable is not None:
            if not self.writable.done():
                self.writable.set_result(None)
            self.writable = None

    def _pause_reading(self) -> None:
        if not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.read_paused and self.transport is not None and not self.closed:
            self.read_paused = False
            self.transport.resume_reading()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()


class Exchange:
    """One request and its response: the ASGI ``receive`` and ``send`` of one app call."""

    __slots__ = ("buffered", "chunked", "chunks", "complete", "conn", "delivered", "disconnected", "expect_continue",
                 "head", "keep_alive", "left", "more_body", "notify", "scope", "started", "task", "waiter")

    def __init__(self, conn: EdgeHttpProtocol, scope: Scope, keep_alive: bool, expect_continue: bool) -> None:
        self.conn = conn
        self.scope = scope
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.more_body = True  # the parser has more of the body to come
        self.delivered = False  # the app has had the whole body
        self.waiter: asyncio.Future[None] | None = None
        self.disconnected = False
        self.started = False
        self.complete = False
        self.chunked = False
        self.left = -1  # content-length bytes still to send (-1: chunked, or no body)
        self.head: bytes | None = None  # a content-length response's head, written with its first body
        self.notify: Callable[[], None] | None = None  # on_disconnect's callback
        self.task: asyncio.Task[None] | None = None  # the app's call

    def on_disconnect(self, callback: Callable[[], None] | None) -> None:
        """The ``rollbus.on_disconnect`` extension: ``callback()`` once the client is gone before the
        response is complete (``None``: no longer). Saves an app a task waiting on ``receive``."""
        self.notify = callback

    def gone(self) -> None:
        """The connection was lost."""
        self.disconnected = True
        self.wake()
        notify, self.notify = self.notify, None
        if notify is not None and not self.complete:
            try:
                notify()
            except Exception:
                log.exception("the disconnect callback failed")

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def run(self, app: ASGIApp) -> None:
        try:
            await app(self.scope, self.receive, self.send)
        except Exception:
            log.exception("exception in the ASGI application")
            self._failed()
        else:
            if not self.complete and not self.disconnected:
                if self.started:
                    log.error("the ASGI application returned without completing its response")
                else:
                    log.error("the ASGI application returned without starting a response")
                self._failed()
        finally:
            self.conn.server_state.tasks.discard(self.task)

    def _failed(self) -> None:
        conn = self.conn
        if self.started or self.disconnected:
            conn._close()
        else:
            self.keep_alive = False
            conn.write(conn.plain(500, "Internal Server Error"))
            self.started = True
            self._finish()

    async def receive(self) -> Message:
        if self.expect_continue:
            self.expect_continue = False
            if not self.started:
                self.conn.write(_CONTINUE)
        while True:
            if self.disconnected or self.complete:
                return {"type": "http.disconnect"}
            if self.delivered:  # nothing more to read: wait for the client to leave or the response to end
                await self._wait()
                continue
            if self.chunks or not self.more_body:
                chunks, self.chunks = self.chunks, []
                self.buffered = 0
                self._read_on()
                more = self.more_body
                self.delivered = not more
                return {"type": "http.request", "body": chunks[0] if len(chunks) == 1 else b"".join(chunks),
                        "more_body": more}
            self._read_on()
            await self._wait()

    def _read_on(self) -> None:
        """The app wants (more of) its body: resume reading, unless a pipelined request holds it."""
        conn = self.conn
        if conn.read_paused and not conn.queued:
            conn._resume_reading()

    async def _wait(self) -> None:
        waiter = self.waiter
        if waiter is None:
            waiter = self.waiter = self.conn.loop.create_future()
        await waiter

    async def send(self, message: Message) -> None:
        conn = self.conn
        if conn.write_paused and not self.disconnected:
            await conn.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected ASGI message 'http.response.start', got {kind!r}")
            self._start(message)
        elif not self.complete:
            if kind != "http.response.body":
                raise RuntimeError(f"expected ASGI message 'http.response.body', got {kind!r}")
            self._body(message.get("body", b""), message.get("more_body", False))
        else:
            raise RuntimeError(f"ASGI message {kind!r} after the response was complete")

    def _start(self, message: Message) -> None:
        status: int = message["status"]
        lines = []
        length: int | None = None
        chunked = False
        for name, value in message.get("headers", ()):
            name = name.lower()
            if name in _FRAMING:
                if name == b"content-length":
                    length = int(value)
                elif name == b"transfer-encoding":
                    chunked = value.lower() == b"chunked"
                else:  # connection: the head says "close" itself when it closes
                    self.keep_alive = self.keep_alive and b"close" not in value.lower()
                    continue
            lines.append(b"%s: %s\r\n" % (name, value))
        headers = b"".join(lines)
        if headers.count(b"\n") != len(lines) or headers.count(b"\r") != len(lines):  # it would split the response
            raise RuntimeError("invalid HTTP response header: a line break in a name or value")
        bodiless = self.scope["method"] == "HEAD" or status in (204, 304) or 100 <= status < 200
        if length is None and not chunked and not bodiless:
            chunked = True
            headers += b"transfer-encoding: chunked\r\n"
        self.chunked = chunked and not bodiless
        self.left = 0 if bodiless else -1 if chunked else length or 0
        head = self.conn.head(status, headers, self.keep_alive)
        self.started = True  # only now: a start refused above leaves the app's failure a 500
        if self.chunked:
            self.conn.write(head)  # a stream's head goes out at once
        else:
            self.head = head

    def reply(self, status: int, content_type: bytes, body: bytes) -> None:
        """The ``rollbus.reply`` extension: a whole response with a body of known length, in
        one call and one write (the edge's plain model replies)."""
        if self.disconnected:
            return
        if self.started:
            raise RuntimeError("rollbus.reply after the response started")
        self.started = True
        conn = self.conn
        head = conn.head(status, b"content-type: %s\r\ncontent-length: %d\r\n" % (content_type, len(body)),
                         self.keep_alive)
        conn.write(head + body if self.scope["method"] != "HEAD" else head)
        self._finish()

    def _body(self, body: bytes, more: bool) -> None:
        conn = self.conn
        if self.chunked:
            out = [b"%x\r\n" % len(body), body, b"\r\n"] if body else []
            if not more:
                out.append(b"0\r\n\r\n")
            if out:
                conn.write(b"".join(out))
        else:
            if self.scope["method"] == "HEAD":
                body = b""
            if len(body) > self.left:
                raise RuntimeError("response content longer than its content-length")
            self.left -= len(body)
            head, self.head = self.head, None
            if head is not None:
                conn.write(head + body if body else head)
            elif body:
                conn.write(body)
            if not more and self.left:
                raise RuntimeError("response content shorter than its content-length")
        if not more:
            self._finish()

    def _finish(self) -> None:
        """The whole response is out: whoever waits on ``receive`` sees the end; the connection goes on."""
        self.complete = True
        self.wake()
        self.conn.response_done(self)


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, (tuple, list)) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None
