"""Acknowledged JetStream publishes with less per-call work than ``js.publish``.

Every append waits for JetStream's acknowledgement, so its cost is on every model turn.
:class:`AckWaits` is a table of pending futures keyed by a counter (the reply subject's
last token), their deadlines enforced by one shared timer; a publish is one ``HPUB``, and
:func:`settle` decodes the acknowledgement with msgspec into a small struct. What a publisher returns (or raises) is
what ``js.publish`` would: the stream and sequence, the duplicate flag, or the API error
(``err_code``) and the no-responders status.

Two publishers share this: :class:`AckedPublisher` on nats-py's connection (one wildcard
reply subscription per connection), and the edge's own connection
(:mod:`edge.nats_direct`), which the edge uses where the server's URL allows it.
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
    """Publishes waiting for their acknowledgement, by the reply token each was sent with.

    Deadlines are kept per publish and enforced by one timer for all of them, armed for the
    earliest: a timer per publish (created, then cancelled a quarter of a millisecond later)
    cost more than the rest of the bookkeeping together."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[asyncio.Future[Ack], float]] = {}  # token -> (future, deadline)
        self._counter = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def take(self, token: str) -> asyncio.Future[Ack] | None:
        """The future waiting for ``token``'s reply, if one still is."""
        waiting = self.pending.pop(token, None)
        return waiting[0] if waiting is not None else None

    def fail_all(self, error: Callable[[], BaseException]) -> None:
        """Fail every publish still waiting (its connection is gone), each with an ``error()`` of its own."""
        pending, self.pending = self.pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(error())

    async def wait(self, send: Callable[[str], Awaitable[None] | None], timeout: float) -> Ack:
        """``send(token)`` a publish and wait for its reply; ``TimeoutError`` when none came in time."""
        token = str(next(self._counter))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Ack] = loop.create_future()
        deadline = loop.time() + timeout
        self.pending[token] = (future, deadline)
        if self._timer is None or deadline < self._timer_at:
            self._arm(loop, deadline)
        try:
            sending = send(token)
            if sending is not None:
                await sending
            return await future
        finally:
            self.pending.pop(token, None)

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(at, self._expire, loop)
        self._timer_at = at

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """Fail the publishes past their deadline; re-arm for the earliest one left."""
        self._timer = None
        now = loop.time()
        earliest = None
        for token, (future, deadline) in list(self.pending.items()):
            if deadline <= now:
                del self.pending[token]
                if not future.done():
                    future.set_exception(TimeoutError("no acknowledgement"))
            elif earliest is None or deadline < earliest:
                earliest = deadline
        if earliest is not None:
            self._arm(loop, earliest)


class AckedPublisher:
    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = ""
        self._sub: Subscription | None = None
        self._waits = AckWaits()
        self._starting: asyncio.Lock | None = None

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
        return await self._waits.wait(
            lambda token: self._nc.publish(subject, payload, reply=self._prefix + token, headers=headers), timeout)


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
