"""A connection of the edge's own, only for acknowledged JetStream publishes.

Every model turn waits for one JetStream acknowledgement, and with nats-py an
acknowledgement costs three task hops (its flusher writes the ``HPUB``; its read loop
parses the reply; the subscription's task runs the callback) plus the parsing in Python
of the protocol line by regular expressions. Measured on the edge benchmark, that path
was about a third of the edge's CPU per turn.

:class:`DirectPublisher` speaks the few parts of the NATS client protocol an acknowledged
publish needs, on an :class:`asyncio.Protocol`: ``HPUB`` goes to the socket at once, and
``data_received`` parses the replies and resolves the waiting futures directly, with no
task in between. It answers the server's ``PING``s, and after a lost connection it fails
what was pending (as a retryable :class:`ConnectionResetError`) and connects again on the
next publish. What it returns or raises is what :class:`edge.acks.AckedPublisher` does.

It covers plain TCP with no credentials, or a user/password or token (in the URL or as
nats-py's options; it logs in with what nats-py sends). Anything else (TLS, credential
files, nkeys, credentials given as callables) is left to nats-py: :func:`direct_publisher` returns
None and the edge keeps :class:`edge.acks.AckedPublisher`, which goes through the main
connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable
from typing import Any, cast
from urllib.parse import ParseResult

from nats.aio.client import Client
from nats.errors import MaxPayloadError

from edge.acks import NO_RESPONDERS, Ack, AckWaits, settle

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 2.0
_MAX_LINE = 64 * 1024  # a protocol line (INFO can be long in a large cluster)
_NO_RESPONDERS = NO_RESPONDERS.encode()  # the status of a reply header block ("NATS/1.0 503")


class ProtocolError(ConnectionResetError):
    """The server said something this client cannot follow: the connection is dropped."""


class _Connection(asyncio.Protocol):
    """One TCP connection: writes commands, parses what the server sends."""

    def __init__(self, on_reply: Any) -> None:
        self._on_reply = on_reply  # (token, headers block | None, payload) -> None
        self._buffer = bytearray()
        self._out: list[bytes] = []  # written in the next pass of the loop (see write)
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.info: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self.pong: asyncio.Future[None] | None = None
        self.closed = False
        self.max_payload = 1024 * 1024  # until the server's INFO says
        self.error: BaseException | None = None
        self.on_lost: Any = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        lost = ConnectionResetError(f"NATS connection lost: {exc or 'closed by the server'}")
        self.error = self.error or lost
        for future in (self.info, self.pong):
            if future is not None and not future.done():
                future.set_exception(self.error)
        if self.on_lost is not None:
            self.on_lost(self.error)

    def write(self, data: bytes, *, alone: bool = False) -> None:
        """Queue ``data``; everything queued in one pass of the event loop goes out in one write
        (concurrent turns' publishes share a system call, as nats-py's flusher has them do).
        ``alone``: the caller knows of nothing else to send with it, so it goes out at once, when
        nothing is queued before it (a lone turn saves the loop pass the queue waits for)."""
        if self.closed or self.transport is None:
            raise self.error or ConnectionResetError("NATS connection closed")
        if alone and not self._out:
            self.transport.write(data)
            return
        self._out.append(data)
        if len(self._out) == 1:
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and not self.closed and self.transport is not None:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        try:
            while True:
                end = buffer.find(b"\r\n", start)
                if end < 0:
                    if len(buffer) - start > _MAX_LINE:
                        raise ProtocolError("protocol line too long")
                    break
                line = bytes(buffer[start:end])
                if line.startswith(b"HMSG ") or line.startswith(b"MSG "):
                    consumed = self._message(line, buffer, end + 2)
                    if consumed < 0:
                        break  # the payload has not fully arrived
                    start = consumed
                    continue
                start = end + 2
                self._control(line)
        except ProtocolError as exc:
            self.error = exc
            log.warning("dropping the direct NATS connection: %s", exc)
            self.close()
            return
        del buffer[:start]

    def _message(self, line: bytes, buffer: bytearray, body_start: int) -> int:
        """Deliver one ``MSG``/``HMSG``; the offset after it, or -1 when its bytes are not all here."""
        fields = line.split()
        try:
            if fields[0] == b"HMSG":  # HMSG subject sid [reply] header_size total_size
                header_size, total = int(fields[-2]), int(fields[-1])
            else:  # MSG subject sid [reply] size
                header_size, total = 0, int(fields[-1])
        except (ValueError, IndexError) as exc:
            raise ProtocolError(f"bad message line {line[:80]!r}") from exc
        end = body_start + total
        if len(buffer) < end + 2:
            return -1
        headers = bytes(buffer[body_start: body_start + header_size]) if header_size else None
        payload = bytes(buffer[body_start + header_size: end])
        subject = fields[1].decode()
        self._on_reply(subject, headers, payload)
        return end + 2

    def _control(self, line: bytes) -> None:
        if line == b"PING":
            self.write(b"PONG\r\n")
        elif line == b"PONG":
            if self.pong is not None and not self.pong.done():
                self.pong.set_result(None)
        elif line.startswith(b"INFO "):
            info = json.loads(line[5:])
            self.max_payload = int(info.get("max_payload", self.max_payload))
            if not self.info.done():
                self.info.set_result(info)
        elif line.startswith(b"-ERR"):
            message = line[4:].strip().strip(b"'").decode(errors="replace")
            if not self.info.done() or (self.pong is not None and not self.pong.done()):
                raise ProtocolError(f"NATS refused the connection: {message}")
            log.warning("NATS error on the direct publish connection: %s", message)
        elif line and line != b"+OK":
            raise ProtocolError(f"unexpected protocol line {line[:80]!r}")


class DirectPublisher:
    """Acknowledged publishes on a connection of its own (see the module docstring)."""

    def __init__(self, host: str, port: int, *, user: str | None = None, password: str | None = None,
                 token: str | None = None, name: str = "rollbus-edge-publish",
                 follow: Callable[[], tuple[str, int] | None] | None = None) -> None:
        """``follow``: where the main connection is now (a cluster client moves between servers);
        asked before each new connection."""
        self._address = (host, port)
        self._follow = follow
        self._auth = {k: v for k, v in (("user", user), ("pass", password), ("auth_token", token)) if v}
        self._name = name
        self._inbox = f"_INBOX.{secrets.token_hex(11)}"
        self._prefix = self._inbox + "."
        self._waits = AckWaits()
        self._conn: _Connection | None = None
        self._connecting: asyncio.Lock | None = None

    async def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        self._connecting = self._connecting or asyncio.Lock()
        async with self._connecting:
            if self._conn is None or self._conn.closed:
                try:
                    self._conn = await asyncio.wait_for(self._connect(), _CONNECT_TIMEOUT_S)
                except ConnectionResetError:
                    raise
                except (OSError, TimeoutError) as exc:  # refused, unreachable, silent: retry later
                    raise ConnectionResetError(f"cannot reach NATS at {self._address}: {exc!r}") from exc
            return self._conn

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        if self._follow is not None and (address := self._follow()) is not None:
            self._address = address
        _, conn = await loop.create_connection(lambda: _Connection(self._on_reply), *self._address)
        try:
            info = await conn.info
            if info.get("tls_required"):
                raise ProtocolError("the server requires TLS")
            options = {"verbose": False, "pedantic": False, "headers": True, "no_responders": True, "protocol": 1,
                       "name": self._name, "lang": "python-rollbus", "version": "1", **self._auth}
            conn.pong = loop.create_future()
            conn.write(b"CONNECT " + json.dumps(options).encode() + b"\r\nPING\r\n")
            await conn.pong  # the server accepted CONNECT (or said -ERR)
            conn.on_lost = self._fail_pending
            conn.write(f"SUB {self._prefix}* 1\r\nPING\r\n".encode())
            conn.pong = loop.create_future()
            await conn.pong  # the subscription is in place before any publish relies on it
        except BaseException:
            conn.close()
            raise
        return conn

    def _fail_pending(self, error: BaseException) -> None:
        self._waits.fail_all(lambda: ConnectionResetError(str(error)))

    def _on_reply(self, subject: str, headers: bytes | None, payload: bytes) -> None:
        future = self._waits.take(subject[len(self._prefix):])
        if future is not None:
            status = headers.split(b"\r\n", 1)[0].split()[1:2] if headers is not None else []
            settle(future, payload, no_responders=not payload and status == [_NO_RESPONDERS], subject=subject)

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str], timeout: float) -> Ack:
        """Publish and wait for JetStream's acknowledgement. Raises ``TimeoutError`` when none
        came in time, ``ConnectionResetError`` when the connection was lost (both: retry)."""
        block = header_block(headers)
        if block is None:
            raise ValueError("header values must not contain line breaks")
        conn = self._conn
        if conn is None or conn.closed:
            conn = await self._connection()
        if len(block) + len(payload) > conn.max_payload:  # the server would drop the connection for it
            raise MaxPayloadError
        alone = not self._waits.pending  # no other publish in flight: none to share a write with
        return await self._waits.wait(
            lambda token: conn.write(hpub(subject, self._prefix + token, block, payload), alone=alone), timeout)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def hpub(subject: str, reply: str, block: bytes, payload: bytes) -> bytes:
    """The ``HPUB`` command for a payload with the header ``block`` (see :func:`header_block`)."""
    line = b"HPUB %s %s %d %d\r\n" % (subject.encode(), reply.encode(), len(block), len(block) + len(payload))
    return b"".join((line, block, payload, b"\r\n"))


def header_block(headers: dict[str, str]) -> bytes | None:
    """``NATS/1.0`` and the headers, or None when a value holds a line break."""
    text = "\r\n".join(("NATS/1.0", *map(": ".join, headers.items()), "", ""))
    return None if text.count("\n") != len(headers) + 2 or text.count("\r") != len(headers) + 2 else text.encode()


def direct_publisher(nc: Client) -> DirectPublisher | None:
    """A direct publisher to the server ``nc`` is connected to, when its URL is plain TCP with
    at most a user/password or token (else None: use nats-py's connection)."""
    url: ParseResult | None = nc.connected_url
    options = nc.options
    if url is None or url.scheme not in ("nats", "") or options.get("tls") is not None:
        return None
    if any(getattr(nc, name, None) for name in ("_user_credentials", "_nkeys_seed", "_nkeys_seed_str")):
        return None
    if any(callable(options.get(name)) for name in ("user", "password", "token")):
        return None  # asked anew at each (re)connect: nats-py's to ask
    # The credentials nats-py's CONNECT sends, in its order: the user and password options, the
    # token option, else the URL's (as written: nats-py does not percent-decode them).
    user, password, token = None, None, None
    if options.get("user") is not None and options.get("password") is not None:
        user, password = options["user"], options["password"]
    elif options.get("token") is not None:
        token = options["token"]
    elif url.username is not None:
        if url.password is None:  # nats://TOKEN@host
            token = url.username
        else:
            user, password = url.username, url.password

    def follow() -> tuple[str, int] | None:
        now = nc.connected_url
        return (now.hostname or "127.0.0.1", now.port or 4222) if now is not None and nc.is_connected else None

    return DirectPublisher(url.hostname or "127.0.0.1", url.port or 4222, user=user, password=password, token=token,
                           follow=follow)
