"""Durable pull consumers in memory: what JetStream does for :mod:`eventlog.consumer`, for tests without NATS.

A :class:`DurableConsumer` is kept by the in-memory log under its (stream, durable name), so that a
second subscription under the same name resumes where the first one's acknowledgements stopped, as a
restarted projector or materializer does on JetStream. It follows JetStream's rules for explicit acks:

* messages are delivered in stream order, those matching the consumer's filter only, at most
  ``max_ack_pending`` unacknowledged at once;
* an acked message is never delivered again; a nak'ed one is delivered again after the nak's delay
  (or the log's ``redelivery_delay``, when a test sets one, so that a redelivery takes no second);
* one neither acked nor nak'ed within ``ack_wait`` of its delivery (or of its last ``in_progress``)
  is delivered again;
* a consumer created again with another filter keeps the one it has (JetStream refuses the change and
  :mod:`eventlog.consumer` binds to it as it is); ``ack_wait`` and ``max_ack_pending`` are updated.

``fetch`` raises ``TimeoutError`` when nothing could be delivered within its timeout, as nats-py's does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from typing import NamedTuple

import msgspec


class StoredMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One message of a stream, as JetStream stores it."""

    seq: int  # stream sequence
    subject: str
    headers: dict[str, str]
    data: bytes


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


class Signal:
    """Wakes the fetches waiting for a message (one appended, or one nak'ed)."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def notify(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, timeout: float) -> None:
        """Until the next :meth:`notify`, or ``timeout`` seconds."""
        if self._event is None:
            self._event = asyncio.Event()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)


class SequencePair(NamedTuple):
    stream: int
    consumer: int


class Metadata(NamedTuple):
    """The part of ``nats.aio.msg.Msg.metadata`` the consumers read."""

    sequence: SequencePair
    num_delivered: int


class Delivered:
    """A delivered message (the part of ``nats.aio.msg.Msg`` a consumer uses)."""

    __slots__ = ("_consumer", "data", "headers", "metadata", "subject")

    def __init__(self, consumer: DurableConsumer, message: StoredMessage, delivered: int) -> None:
        self._consumer = consumer
        self.subject = message.subject
        self.data = message.data
        self.headers: dict[str, str] | None = dict(message.headers)
        self.metadata = Metadata(SequencePair(message.seq, delivered), consumer.deliveries[message.seq])

    async def ack(self) -> None:
        self._consumer.ack(self.metadata.sequence.stream)

    async def nak(self, delay: float | None = None) -> None:
        self._consumer.nak(self.metadata.sequence.stream, delay or 0.0)

    async def in_progress(self) -> None:
        self._consumer.in_progress(self.metadata.sequence.stream)


class DurableConsumer:
    """One durable consumer of one stream (see the module docstring)."""

    def __init__(
        self,
        messages: list[StoredMessage],
        subject: str,
        *,
        ack_wait: float,
        max_ack_pending: int,
        arrived: Signal,
        redelivery_delay: float | None,
    ) -> None:
        self._messages = messages  # the stream, shared with the log (appended to in place)
        self.subject = subject
        self.ack_wait = ack_wait
        self.max_ack_pending = max_ack_pending
        self._arrived = arrived
        self._redelivery_delay = redelivery_delay
        self._next = 0  # index into the stream of the next message never delivered
        self.pending: dict[int, float] = {}  # stream seq -> when it is delivered again (unacked)
        self.acked: set[int] = set()
        self.deliveries: Counter[int] = Counter()  # stream seq -> times delivered
        self.lose_acks = 0  # the next acks to lose (a server that died before it stored them): a test sets it
        self._delivered = 0  # consumer sequence

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def ack(self, seq: int) -> None:
        if self.lose_acks and seq in self.pending:
            self.lose_acks -= 1  # lost: the message is delivered again once its ack_wait is up
            return
        if self.pending.pop(seq, None) is not None:
            self.acked.add(seq)

    def nak(self, seq: int, delay: float) -> None:
        if seq in self.pending:
            delay = self._redelivery_delay if self._redelivery_delay is not None else delay
            self.pending[seq] = self._now() + delay
            self._arrived.notify()

    def in_progress(self, seq: int) -> None:
        if seq in self.pending:
            self.pending[seq] = self._now() + self.ack_wait

    def take(self, batch: int) -> list[StoredMessage]:
        """Up to ``batch`` messages due now: redeliveries first, then new ones."""
        now = self._now()
        by_seq = {m.seq: m for m in self._messages}  # (small streams: tests)
        due = sorted(seq for seq, at in self.pending.items() if at <= now)[:batch]
        taken = [by_seq[seq] for seq in due]
        while len(taken) < batch and self._next < len(self._messages) and len(self.pending) < self.max_ack_pending:
            message = self._messages[self._next]
            self._next += 1
            if subject_matches(self.subject, message.subject):
                taken.append(message)
                self.pending[message.seq] = now  # (counted as pending now; its deadline is set below)
        for message in taken:
            self.pending[message.seq] = now + self.ack_wait
            self.deliveries[message.seq] += 1
        return taken

    def next_due(self) -> float | None:
        return min(self.pending.values(), default=None)

    def deliver(self, message: StoredMessage) -> Delivered:
        self._delivered += 1
        return Delivered(self, message, self._delivered)


class MemorySubscription:
    """A bound durable consumer (a :class:`eventlog.port.Subscription`)."""

    def __init__(self, consumer: DurableConsumer, arrived: Signal, *, max_wait: float | None = None) -> None:
        self._consumer = consumer
        self._arrived = arrived
        self._max_wait = max_wait
        self.closed = False

    async def fetch(self, batch: int = 1, timeout: float | None = 5) -> list[Delivered]:
        loop = asyncio.get_running_loop()
        wait = timeout if timeout is not None else 5.0
        deadline = loop.time() + (min(wait, self._max_wait) if self._max_wait is not None else wait)
        while True:
            taken = self._consumer.take(batch)
            if taken:
                return [self._consumer.deliver(m) for m in taken]
            now = loop.time()
            if now >= deadline:
                raise TimeoutError("no messages")
            wake = min(deadline, self._consumer.next_due() or deadline)
            await self._arrived.wait(max(wake - now, 0.0))

    async def unsubscribe(self) -> None:
        self.closed = True
