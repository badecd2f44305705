"""Acknowledged JetStream publishes with less per-call work than ``js.publish``.

Every append waits for JetStream's acknowledgement, so its cost is on every model turn.
:class:`AckedPublisher` keeps one wildcard reply subscription per connection and a table
of pending futures keyed by a counter; a publish is one ``HPUB`` plus a timer, and the
acknowledgement is decoded with msgspec into a small struct. What it returns (or raises)
is what ``js.publish`` would: the stream and sequence, the duplicate flag, or the API
error (``err_code``) and the no-responders status.

While the connection is up, the ``HPUB`` is built here and queued on the client's write
buffer directly: nats-py's ``publish`` re-validates and re-encodes every header and copies
the payload twice, about three quarters of a publish's cost. Our headers are fixed names
and values we made (a value with a line break goes the client's way). Otherwise (not
connected, or a nats-py without those internals) the client's own ``publish`` is used,
with its buffering and errors.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

NO_RESPONDERS = "503"


class ApiError(msgspec.Struct, frozen=True, kw_only=True):
    code: int = 0
    err_code: int = 0
    description: str = ""


class Ack(msgspec.Struct, frozen=True, kw_only=True):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: ApiError | None = None


class PublishRejected(Exception):
    """JetStream answered with an API error."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(f"{error.code} {error.err_code}: {error.description}")
        self.error = error


class NoResponders(Exception):
    """Nothing listens on the subject: no stream takes it (JetStream down or not provisioned)."""


decode_ack = msgspec.json.Decoder(Ack).decode


class AckWaits:
    """Publishes waiting for their acknowledgement, by the reply token each was sent with."""

    def __init__(self) -> None:
        self.pending: dict[str, asyncio.Future[Ack]] = {}
        self._counter = itertools.count(1)

    def take(self, token: str) -> asyncio.Future[Ack] | None:
        """The future waiting for ``token``'s reply, if one still is."""
        return self.pending.pop(token, None)

    async def wait(self, send: Callable[[str], Awaitable[None] | None], timeout: float) -> Ack:
        """``send(token)`` a publish and wait for its reply; ``TimeoutError`` when none came in time."""
        token = str(next(self._counter))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Ack] = loop.create_future()
        self.pending[token] = future
        timer = loop.call_later(timeout, _expire, future)
        try:
            sending = send(token)
            if sending is not None:
                await sending
            return await future
        finally:
            timer.cancel()
            self.pending.pop(token, None)


class AckedPublisher:
    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = ""
        self._sub: Subscription | None = None
        self._waits = AckWaits()
        self._starting: asyncio.Lock | None = None
        # The client internals a direct HPUB needs (see the module docstring).
        self._direct = all(hasattr(nc, name) for name in ("_send_command", "_flush_pending", "_flush_queue"))

    async def _start(self) -> None:
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self._sub is None:
                prefix = self._nc.new_inbox()
                self._sub = await self._nc.subscribe(prefix + ".*", cb=self._on_reply)
                self._prefix = prefix + "."

    async def _on_reply(self, msg: Msg) -> None:
        future = self._waits.take(msg.subject[len(self._prefix):])
        if future is None:
            return
        no_responders = not msg.data and bool(msg.headers) and msg.headers.get("Status") == NO_RESPONDERS
        settle(future, msg.data, no_responders=no_responders, subject=msg.subject)

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str], timeout: float) -> Ack:
        """Publish and wait for the acknowledgement; raises ``TimeoutError`` when none came in time."""
        if self._sub is None:
            await self._start()
        return await self._waits.wait(lambda token: self._send(subject, self._prefix + token, payload, headers),
                                      timeout)


    async def _send(self, subject: str, reply: str, payload: bytes, headers: dict[str, str]) -> None:
        nc = self._nc
        block = header_block(headers) if self._direct and nc.is_connected and not nc.is_draining_pubs else None
        if block is None or len(payload) > nc.max_payload:
            await nc.publish(subject, payload, reply=reply, headers=headers)
            return
        await nc._send_command(hpub(subject, reply, block, payload))
        if nc._flush_queue is not None and nc._flush_queue.empty():
            await nc._flush_pending()


def settle(future: asyncio.Future[Ack], payload: bytes, *, no_responders: bool, subject: str) -> None:
    """Resolve a publish's future from JetStream's reply: the ack, or the error it stands for."""
    if future.done():
        return
    if no_responders:
        future.set_exception(NoResponders(subject))
        return
    try:
        ack = decode_ack(payload)
    except msgspec.DecodeError as exc:  # an undecodable reply is that publish's error
        future.set_exception(exc)
        return
    if ack.error is not None:
        future.set_exception(PublishRejected(ack.error))
    else:
        future.set_result(ack)


def hpub(subject: str, reply: str, block: bytes, payload: bytes) -> bytes:
    """The ``HPUB`` command for a payload with the header ``block`` (see :func:`header_block`)."""
    line = b"HPUB %s %s %d %d\r\n" % (subject.encode(), reply.encode(), len(block), len(block) + len(payload))
    return b"".join((line, block, payload, b"\r\n"))


def header_block(headers: dict[str, str]) -> bytes | None:
    """``NATS/1.0`` and the headers, or None when a value would need the client's sanitizing."""
    text = "NATS/1.0\r\n" + "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
    return None if text.count("\n") != len(headers) + 2 or text.count("\r") != len(headers) + 2 else text.encode()


def _expire(future: asyncio.Future[Ack]) -> None:
    if not future.done():
        future.set_exception(TimeoutError("no acknowledgement"))
