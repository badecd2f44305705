"""How far a durable JetStream consumer is behind its stream, in messages and in seconds.

Messages: what the consumer has not processed yet, from its consumer info (``num_pending``, not
delivered yet, plus ``num_ack_pending``, delivered and not acknowledged). Seconds: the age of the
oldest message past its ack floor (the first of its subjects after ``ack_floor.stream_seq``; 0 when
it has processed everything), read with one direct message get.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable

import msgspec
from nats.errors import Error as NatsError
from nats.js.api import ConsumerInfo
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from schemas.errors import LogUnavailable


class Watched(msgspec.Struct, frozen=True, kw_only=True):
    """A durable consumer to watch, and the name its lag is reported under (``consumer`` label)."""

    name: str
    stream: str
    durable: str
    subject: str


class Lag(msgspec.Struct, frozen=True):
    messages: int
    seconds: float


def unprocessed(info: ConsumerInfo) -> int:
    return (info.num_pending or 0) + (info.num_ack_pending or 0)


def lag_of(messages: int, oldest: datetime.datetime | None, now: float) -> Lag:
    """The lag, given the unprocessed count and the oldest unacknowledged message's time (pure)."""
    if messages == 0 or oldest is None:
        return Lag(messages, 0.0)
    return Lag(messages, max(0.0, now - oldest.timestamp()))


async def consumer_lag(js: JetStreamContext, watched: Watched, *, clock: Callable[[], float] = time.time,
                       timeout: float = 2.0) -> Lag | None:
    """The consumer's lag now; None when it does not exist yet. :class:`LogUnavailable` when JetStream
    does not answer."""
    try:
        info = await asyncio.wait_for(js.consumer_info(watched.stream, watched.durable), timeout)
        messages = unprocessed(info)
        if messages == 0:
            return Lag(0, 0.0)
        floor = info.ack_floor.stream_seq if info.ack_floor is not None and info.ack_floor.stream_seq else 0
        oldest = await asyncio.wait_for(js.get_msg(watched.stream, seq=floor + 1, subject=watched.subject,
                                                   next=True), timeout)
    except NotFoundError:  # no such consumer (not started yet), or the message was removed meanwhile
        return None
    except (TimeoutError, NatsError) as exc:
        raise LogUnavailable(f"JetStream did not report consumer {watched.durable}: {exc!r}") from exc
    return lag_of(messages, oldest.time, clock())
