"""A durable pull-consumer loop shared by the projector and the materializer.

At-least-once: a message is acked only after its handler returned; a handler that raised
a :class:`RollbusError` is nak'ed with a delay and redelivered (handlers are idempotent).
Any other exception is a bug: it is logged, the message is nak'ed, and the loop goes on.

:func:`pull_batches` is the loop itself (fetched batches, for consumers that handle a
batch at once and ack themselves); :func:`consume` hands messages one by one to a handler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext

from schemas.errors import RollbusError

log = logging.getLogger(__name__)

Handler = Callable[[Msg], Awaitable[None]]


async def pull_batches(js: JetStreamContext, *, stream: str, durable: str, subject: str, stop: asyncio.Event,
                       batch: int = 64, ack_wait: float = 30.0) -> AsyncIterator[list[Msg]]:
    """Batches of up to ``batch`` messages from a durable pull consumer, until ``stop`` is set."""
    config = ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                            ack_wait=ack_wait, filter_subject=subject, max_ack_pending=max(batch * 4, 256))
    sub = await asyncio.wait_for(js.pull_subscribe(subject, durable=durable, stream=stream, config=config), 10)
    try:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(batch, timeout=0.5)
            except (TimeoutError, NatsTimeoutError):
                continue
            yield msgs
    finally:
        await sub.unsubscribe()


async def consume(js: JetStreamContext, *, stream: str, durable: str, subject: str, handler: Handler,
                  stop: asyncio.Event, batch: int = 64, ack_wait: float = 30.0, retry_delay: float = 1.0) -> None:
    async for msgs in pull_batches(js, stream=stream, durable=durable, subject=subject, stop=stop, batch=batch,
                                   ack_wait=ack_wait):
        for msg in msgs:
            await _handle(msg, handler, retry_delay)


async def settle(msgs: Sequence[Msg], work: Awaitable[None], retry_delay: float = 1.0) -> bool:
    """Await ``work`` for these messages, then ack them all, or nak them all if it raised."""
    try:
        await work
    except RollbusError as exc:
        log.warning("%s: %s; will retry", msgs[0].subject, exc)
    except Exception:
        log.exception("%s: handler failed; will retry", msgs[0].subject)
    else:
        for msg in msgs:
            await msg.ack()
        return True
    for msg in msgs:
        await msg.nak(delay=retry_delay)
    return False


async def _handle(msg: Msg, handler: Handler, retry_delay: float) -> None:
    await settle([msg], handler(msg), retry_delay)
