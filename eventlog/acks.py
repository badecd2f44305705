"""Acknowledged JetStream publishes on nats-py's public ``Client`` API, with less work per call than ``js.publish``.

Every append waits for JetStream's acknowledgement, so its cost is on every model turn.
:class:`AckedPublisher` is a thin adapter over public nats-py calls only: one wildcard
reply subscription per connection (``nc.subscribe``), each publish one ``nc.publish`` with a
reply subject. What it returns (or raises) is what ``js.publish`` would: the stream and
sequence, the duplicate flag, or the API error (``err_code``) and the no-responders status.

Why not ``js.publish`` itself: measured by ``ops/bench/append_path.py`` (K concurrent writers
of 2-8 KB envelopes with the edge's headers, one private nats-server, the same run), this costs
0.83x / 0.59x / 0.54x the client CPU per append of ``js.publish`` at K=1 / 16 / 64 (over four
runs 0.73-0.83x, 0.55-0.64x, 0.53-0.59x) and gives 1.1-1.7x its appends/s. ``js.publish`` goes
through ``nc.request``, which arms an ``asyncio.wait_for`` per call and decodes the reply with
``json.loads`` into a dataclass; here :class:`AckWaits` is a table of pending futures keyed by
a counter (the reply subject's last token), their deadlines enforced by one shared timer, and
:func:`settle` decodes the acknowledgement with msgspec into a small struct. (The protocol
client of our own that this replaced, ``edge/nats_direct.py``, was cheaper still, 0.44x / 0.33x
/ 0.28x, and was removed: it did not ping, so it could not tell a dead link, and it had to
re-implement what nats-py maintains: reconnects, cluster discovery, lame-duck mode, TLS,
credentials.)

A publish that will never be answered is reported, not waited out. While publishes wait, the
shared timer also looks, every :data:`PROBE_S`, at each one's chances:

* a server that denies this connection's user the subject answers the ``PUB`` with a ``-ERR``
  (nats-py keeps it as ``nc.last_error``), never with a reply: when the client's last error since
  the publish was sent is a permissions violation naming its subject (or the reply
  subscription, without which no acknowledgement can come), the publish fails with
  :class:`PublishRefused`;
* when the connection it went out on is gone (nats-py is reconnecting, or has reconnected: its
  ``stats["reconnects"]`` moved; a half-open link is found by the client's pings), the ack would
  have come on that connection: the publish fails with ``ConnectionResetError``, for the caller
  to retry (with the same ``Nats-Msg-Id``) on the next one. A publish sent while the client was
  reconnecting goes out on the next connection (nats-py buffers it) and is left to wait.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import cast

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import MaxPayloadError

from schemas.errors import NoResponders, PublishRefused, PublishRejected

NO_RESPONDERS = "503"
PROBE_S = 0.05  # how often waiting publishes look for a refusal (nothing is looked at while none waits)
_PERMISSIONS_VIOLATION = "permissions violation"  # nats-py lower-cases the server's -ERR text


class ApiError(msgspec.Struct, frozen=True, kw_only=True):
    code: int = 0
    err_code: int = 0
    description: str = ""


class Ack(msgspec.Struct, frozen=True, kw_only=True):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: ApiError | None = None


decode_ack = msgspec.json.Decoder(Ack).decode

# Whether a publish to a subject was refused, given the client's last error when it was sent.
Refusal = Callable[[str, object], BaseException | None]


class AckWaits:
    """Publishes waiting for their acknowledgement, by the reply token each was sent with.

    Deadlines are kept per publish and enforced by one timer for all of them, armed for the
    earliest: a timer per publish (created, then cancelled a quarter of a millisecond later)
    cost more than the rest of the bookkeeping together. With a ``refusal`` check, the timer
    also fires every :data:`PROBE_S` while publishes wait, and fails those it finds refused."""

    def __init__(self, refusal: Refusal | None = None) -> None:
        # token -> (future, deadline, subject, the client's last error when it was sent)
        self.pending: dict[str, tuple[asyncio.Future[Ack], float, str, object]] = {}
        self._refusal = refusal
        self._counter = itertools.count(1)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def take(self, token: str) -> asyncio.Future[Ack] | None:
        """The future waiting for ``token``'s reply, if one still is."""
        waiting = self.pending.pop(token, None)
        return waiting[0] if waiting is not None else None

    async def wait(self, send: Callable[[str], Awaitable[None] | None], timeout: float, *, subject: str = "",
                   since: object = None) -> Ack:
        """``send(token)`` a publish and wait for its reply; ``TimeoutError`` when none came in time,
        or what the ``refusal`` check found for ``subject`` (``since``: the client's last error before)."""
        token = str(next(self._counter))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Ack] = loop.create_future()
        deadline = loop.time() + timeout
        self.pending[token] = (future, deadline, subject, since)
        due = deadline if self._refusal is None else min(deadline, loop.time() + PROBE_S)
        if self._timer is None or due < self._timer_at:
            self._arm(loop, due)
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
        """Fail the publishes past their deadline or refused; re-arm for the earliest one left."""
        self._timer = None
        now = loop.time()
        earliest = None
        for token, (future, deadline, subject, since) in list(self.pending.items()):
            error: BaseException | None = TimeoutError("no acknowledgement") if deadline <= now else None
            if error is None and self._refusal is not None:
                error = self._refusal(subject, since)
            if error is not None:
                del self.pending[token]
                if not future.done():
                    future.set_exception(error)
                continue
            due = deadline if self._refusal is None else min(deadline, now + PROBE_S)
            earliest = due if earliest is None else min(earliest, due)
        if earliest is not None:
            self._arm(loop, earliest)


class AckedPublisher:
    """Acknowledged publishes on ``nc`` (see the module docstring); :meth:`close` drops its subscription."""

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = ""
        self._sub: Subscription | None = None
        self._before_sub: object = None  # the client's last error before the reply subscription was made
        self._waits = AckWaits(self._refused)
        self._starting: asyncio.Lock | None = None

    async def _start(self) -> None:
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self._sub is None:
                prefix = self._nc.new_inbox()
                self._before_sub = self._nc.last_error
                self._prefix = prefix + "."
                replies = cast(asyncio.Future, _Replies(self._on_reply))
                self._sub = await self._nc.subscribe(prefix + ".*", future=replies)

    def _on_reply(self, msg: Msg) -> None:
        future = self._waits.take(msg.subject[len(self._prefix):])
        if future is None:
            return
        no_responders = not msg.data and bool(msg.headers) and msg.headers.get("Status") == NO_RESPONDERS
        settle(future, msg.data, no_responders=no_responders, subject=msg.subject)

    def _connection(self) -> int | None:
        """The connection the client is on now (how many times it has reconnected), None while it has none."""
        return self._nc.stats["reconnects"] if self._nc.is_connected else None

    def _refused(self, subject: str, sent: object) -> BaseException | None:
        """Why a publish ``sent`` (the client's last error and connection then) will never be answered:
        the connection it went out on is gone, its subject was refused since, or the reply
        subscription was."""
        last_error, connection = cast(tuple[object, int | None], sent)
        if connection is not None and self._connection() != connection:  # its ack went to a dead link
            return ConnectionResetError("the NATS connection the publish went out on was lost")
        error = self._nc.last_error
        return (_permission_error(error, last_error, subject, "this NATS user may not publish to the subject")
                or _permission_error(error, self._before_sub, self._prefix + "*",
                                     "this NATS user may not subscribe to its reply inbox (_INBOX.>), so no "
                                     "acknowledgement can come; the message may have been stored"))

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str], timeout: float) -> Ack:
        """Publish and wait for the acknowledgement; raises ``TimeoutError`` when none came in time,
        :class:`PublishRefused` when the server refused the subject, ``MaxPayloadError`` (sending
        nothing) when the message with its headers is over the server's ``max_payload``."""
        if self._sub is None:
            await self._start()
        if len(payload) + _header_bytes(headers) > self._nc.max_payload:
            # nats-py checks the payload alone, the server the headers too: it would drop the
            # connection for it, and nats-py, on that -ERR, close the client for good.
            raise MaxPayloadError
        return await self._waits.wait(
            lambda token: self._nc.publish(subject, payload, reply=self._prefix + token, headers=headers), timeout,
            subject=subject, since=(self._nc.last_error, self._connection()))

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and not self._nc.is_closed:
            await sub.unsubscribe()


class _Replies:
    """What the reply subscription is given as its ``future``: nats-py hands each message of a subscription made
    with one to ``future.set_result`` from its read loop (unless ``future.cancelled()``), where a ``cb``
    subscription queues it for a task of its own to call back: one task hop less on every append. nats-py means
    ``future=`` for a single reply (its old-style requests) but calls it for every message and never looks at
    ``done()``; ``tests/integration/test_acks.py`` fails if a release changes that."""

    def __init__(self, on_reply: Callable[[Msg], None]) -> None:
        self.set_result = on_reply

    @staticmethod
    def cancelled() -> bool:
        return False


def _header_bytes(headers: dict[str, str]) -> int:
    """The size of the header block nats-py sends for ``headers`` ("NATS/1.0", a line each, a blank line)."""
    return 12 + sum(len(name.encode()) + len(value.encode()) + 4 for name, value in headers.items())


def _permission_error(error: object, since: object, subject: str, meaning: str) -> PublishRefused | None:
    """A :class:`PublishRefused` saying ``meaning`` when ``error`` (the client's last) is new since
    ``since`` and is the server's permissions violation for ``subject``."""
    if error is None or error is since:
        return None
    text = str(error)
    if _PERMISSIONS_VIOLATION in text.lower() and f'"{subject.lower()}"' in text.lower():
        return PublishRefused(f"{meaning} ({text})")
    return None


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
