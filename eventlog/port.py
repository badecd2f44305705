"""The log's read-and-write port: what the projector and the materializer read and write.

:class:`LogPort` is one protocol with two implementations that ``tests/contract/log_contract.py``
holds to one contract: :class:`eventlog.jetstream.JetStreamPort` (JetStream, in production) and
``rollbus.testing.memory_log.InMemoryLog`` (in memory, for unit tests that need no NATS).

* **Appends** (:meth:`LogPort.append`) are the edge's: acknowledged, idempotent by ``Nats-Msg-Id``,
  refused with :class:`~schemas.errors.OwnershipLost` after another writer (the quarantine event too).
* **Publishes** (:meth:`LogPort.publish`) are one message as it is: the ready signal, deduplicated by
  its ``Nats-Msg-Id``.
* **Durable consumers** (:meth:`LogPort.subscribe`): at-least-once. A delivery is acked, nak'ed
  (redelivered after the delay), or kept in progress; one neither acked nor kept in progress within
  ``ack_wait`` is redelivered. A second subscription under the same durable name resumes where the
  acknowledgements stopped. :mod:`eventlog.consumer` runs the loops on either.
* **Reads**: a delivery's events (:meth:`LogPort.decode`), a session rebuilt (:meth:`LogPort.load_state`),
  its envelopes, its last message.
* **KV buckets** (:meth:`LogPort.kv`): :class:`eventlog.kv.Kv`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from eventlog.acks import Ack
from eventlog.kv import Kv
from eventlog.publisher import Appended
from eventlog.reader import LogMessage, SessionLog, Stored
from schemas.events import AnyEvent, Event
from schemas.log import LogConfig
from session.fold import SessionState


class StreamPosition(Protocol):
    @property
    def stream(self) -> int: ...


class DeliveryMetadata(Protocol):
    """What a consumer reads of ``nats.aio.msg.Msg.metadata``."""

    @property
    def sequence(self) -> StreamPosition: ...  # ``.stream``: where the message sits in its stream
    @property
    def num_delivered(self) -> int: ...  # 1 on its first delivery


class Delivery(Stored, Protocol):
    """A message a durable consumer delivered (a ``nats.aio.msg.Msg`` on JetStream): what decoding reads of
    it, and its delivery's metadata."""

    @property
    def metadata(self) -> DeliveryMetadata: ...

    async def ack(self) -> None: ...
    async def nak(self, delay: float | None = None) -> None: ...
    async def in_progress(self) -> None: ...


class Subscription(Protocol):
    """A bound durable consumer: ``fetch`` raises ``TimeoutError`` when nothing came within ``timeout``."""

    async def fetch(self, batch: int = 1, timeout: float | None = 5) -> list[Any]: ...  # Delivery (list[Msg])
    async def unsubscribe(self) -> None: ...


class Subscriber(Protocol):
    async def subscribe(
        self, stream: str, subject: str, durable: str, *, ack_wait: float, max_ack_pending: int
    ) -> Subscription:
        """Create (or update) the durable consumer and bind to it."""
        ...


class LogPort(Subscriber, Protocol):
    """The log as the projector and the materializer use it (see the module docstring)."""

    @property
    def cfg(self) -> LogConfig: ...

    async def append(self, session_id: str, events: Sequence[Event], expected_last: int) -> Appended: ...
    async def publish(self, subject: str, payload: bytes, headers: dict[str, str]) -> Ack: ...
    async def decode(self, msg: Delivery) -> list[AnyEvent]: ...
    async def read_session(self, session_id: str, *, until: int | None = None) -> SessionLog: ...
    async def load_state(self, session_id: str, *, until: int | None = None) -> tuple[SessionState, int]: ...
    async def last_stream_seq(self, session_id: str) -> int: ...
    async def last_message(self, subject: str) -> LogMessage | None:
        """The stream's last message on ``subject`` (a filter, e.g. a session's ``<prefix>.<id>.>``); None: none."""
        ...

    def envelopes(self, session_id: str) -> AsyncIterator[tuple[int, list[AnyEvent]]]:
        """(stream seq, events) of each of the session's envelopes, in order, up to its last one now."""
        ...

    async def image(self, session_id: str, digest: str) -> bytes | None:
        """The bytes of one of the session's images (sha256 hex ``digest``: ``schemas.events.ImageRef``) from the
        log's object store, unchecked; None when the store does not hold it."""
        ...

    def kv(self, bucket: str, *, timeout: float = 5.0) -> Kv: ...
    async def close(self) -> None: ...
