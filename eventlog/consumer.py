"""A durable pull-consumer loop shared by the projector and the materializer.

At-least-once: a message is acked only after its handler returned; a handler that raised
a :class:`RollbusError` is nak'ed with a delay and redelivered (handlers are idempotent).
Any other exception is a bug: it is logged, the message is nak'ed, and the loop goes on.

:func:`pull_batches` is the loop itself (fetched batches, for consumers that handle a
batch at once and ack themselves); :func:`consume_batches` gathers them into batches (up
to ``max_batch`` messages, waiting at most ``max_delay`` seconds after the first), keeps
them in progress while the handler works, and acks or naks each.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import APIError, ServiceUnavailableError

from eventlog.port import Delivery, Subscriber, Subscription
from eventlog.retrying import until_stopped
from schemas.errors import RollbusError

_log = logging.getLogger(__name__)

# Handles a batch; returns the messages that failed (nak'ed and redelivered), the rest are acked.
BatchHandler = Callable[[list[Delivery]], Awaitable[list[Delivery]]]
# A fetch answered "no JetStream now": on a cluster, the consumer's leader is being elected (its node
# died); the fetch is tried again after RETRY_FETCH_S, as after a timeout.
_NO_LEADER = (ServiceUnavailableError, NoRespondersError)
RETRY_FETCH_S = 0.25
SUBSCRIBE_RETRY_MAX_S = 10.0


def _config(durable: str, subject: str, ack_wait: float, max_ack_pending: int) -> ConsumerConfig:
    return ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                          ack_wait=ack_wait, filter_subject=subject, max_ack_pending=max_ack_pending)


def backoff(failures: int, first: float, most: float) -> float:
    """Seconds to wait after ``failures`` failures in a row: ``first``, doubling, at most ``most``. For a
    consumer's pause before it gives back a batch it could not handle (JetStream's redelivery is the retry, not
    a loop of ours); retry loops are tenacity's (:mod:`eventlog.retrying`)."""
    return min(first * 2.0 ** max(failures - 1, 0), most)


class JetStreamConsumers:
    """Durable pull consumers on JetStream (a :class:`eventlog.port.Subscriber`)."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js

    async def subscribe(self, stream: str, subject: str, durable: str, *, ack_wait: float,
                        max_ack_pending: int) -> Subscription:
        return await _subscribe(self._js, stream, subject, _config(durable, subject, ack_wait, max_ack_pending))


async def _subscribe_when_answered(log: Subscriber, stream: str, subject: str, durable: str, *, ack_wait: float,
                                  max_ack_pending: int, stop: asyncio.Event) -> Subscription | None:
    """:func:`_subscribe`, tried again (1 s, 2 s, ... 10 s apart) while the server does not answer, as a
    stalled or restarting nats-server does not, until it does or ``stop`` is set (None)."""
    what = f"consumer {durable} on {stream}: the server did not answer"
    return await until_stopped(stop, (TimeoutError, NatsTimeoutError, *_NO_LEADER),
                               lambda: log.subscribe(stream, subject, durable, ack_wait=ack_wait,
                                                     max_ack_pending=max_ack_pending),
                               first=1.0, most=SUBSCRIBE_RETRY_MAX_S, logger=_log, what=what)


async def _subscribe(js: JetStreamContext, stream: str, subject: str, config: ConsumerConfig
                     ) -> JetStreamContext.PullSubscription:
    """Bind to the durable consumer with this process's configuration. nats-py's ``pull_subscribe`` only
    binds to a durable that exists, keeping the configuration it was created with (an ``--ack-wait`` given
    later would never apply; a stack killed while it ran with a long one would have its signals wait that
    long), so the consumer is created or updated first: JetStream updates the editable fields (``ack_wait``,
    ``max_ack_pending``) in place, and messages already delivered are redelivered by the new ``ack_wait``.
    A consumer that cannot take this configuration (another filter) is bound to as it is, with a warning."""
    try:
        await asyncio.wait_for(js.add_consumer(stream, config), 10)
    except APIError as exc:
        _log.warning("consumer %s on %s keeps its configuration (%s)", config.durable_name, stream, exc.description)
    return await asyncio.wait_for(js.pull_subscribe(subject, durable=config.durable_name, stream=stream,
                                                    config=config), 10)


async def pull_batches(log: Subscriber, *, stream: str, durable: str, subject: str, stop: asyncio.Event,
                       batch: int = 64, ack_wait: float = 30.0) -> AsyncIterator[list[Delivery]]:
    """Batches of up to ``batch`` messages from a durable pull consumer of ``log``, until ``stop`` is set."""
    sub = await _subscribe_when_answered(log, stream, subject, durable, ack_wait=ack_wait,
                                         max_ack_pending=max(batch * 4, 256), stop=stop)
    if sub is None:
        return
    try:
        while not stop.is_set():
            try:
                msgs = await sub.fetch(batch, timeout=0.5)
            except (TimeoutError, NatsTimeoutError):
                continue
            except _NO_LEADER:
                await asyncio.sleep(RETRY_FETCH_S)
                continue
            yield msgs
    finally:
        await sub.unsubscribe()


async def settle(msgs: Sequence[Delivery], work: Awaitable[None], retry_delay: float = 1.0) -> bool:
    """Await ``work`` for these messages, then ack them all, or nak them all if it raised."""
    try:
        await work
    except RollbusError as exc:
        _log.warning("%s: %s; will retry", msgs[0].subject, exc)
    except Exception:
        _log.exception("%s: handler failed; will retry", msgs[0].subject)
    else:
        for msg in msgs:
            await msg.ack()
        return True
    for msg in msgs:
        await msg.nak(delay=retry_delay)
    return False


async def consume_batches(log: Subscriber, *, stream: str, durable: str, subject: str, handler: BatchHandler,
                          stop: asyncio.Event, max_batch: int = 256, max_delay: float = 0.5, ack_wait: float = 30.0,
                          retry_delay: float = 1.0) -> None:
    """Batches from a durable pull consumer of ``log`` through ``handler``, acked or nak'ed, until ``stop``."""
    sub = await _subscribe_when_answered(log, stream, subject, durable, ack_wait=ack_wait,
                                         max_ack_pending=max(max_batch * 4, 256), stop=stop)
    if sub is None:
        return
    try:
        while not stop.is_set():
            msgs = await _gather(sub, max_batch, max_delay)
            if msgs:
                await _handle_batch(msgs, handler, retry_delay, ack_wait)
    finally:
        await sub.unsubscribe()


async def _gather(sub: Subscription, max_batch: int, max_delay: float) -> list[Delivery]:
    """Up to ``max_batch`` messages: the first one (waiting up to 0.5 s), then whatever arrives within ``max_delay``."""
    msgs: list[Delivery] = []
    deadline: float | None = None
    loop = asyncio.get_running_loop()
    while len(msgs) < max_batch:
        wait = 0.5 if deadline is None else deadline - loop.time()
        if wait <= 0.001:
            break
        try:
            msgs += await sub.fetch(max_batch - len(msgs), timeout=wait)
        except (TimeoutError, NatsTimeoutError):
            if deadline is None:
                return msgs
        except _NO_LEADER:
            await asyncio.sleep(RETRY_FETCH_S)
            if deadline is None:
                return msgs
        if deadline is None and msgs:
            deadline = loop.time() + max_delay
    return msgs


async def _handle_batch(msgs: list[Delivery], handler: BatchHandler, retry_delay: float, ack_wait: float) -> None:
    keepalive = asyncio.ensure_future(_keep_in_progress(msgs, ack_wait / 3))
    try:
        failed = await handler(msgs)
    except RollbusError as exc:
        _log.warning("batch of %d: %s; will retry", len(msgs), exc)
        failed = msgs
    except Exception:
        _log.exception("batch of %d: handler failed; will retry", len(msgs))
        failed = msgs
    finally:
        keepalive.cancel()
    failed_ids = {id(m) for m in failed}
    for msg in msgs:
        if id(msg) in failed_ids:
            await msg.nak(delay=retry_delay)
        else:
            await msg.ack()


async def _keep_in_progress(msgs: list[Delivery], every: float) -> None:
    """Tell JetStream the batch is still being worked on, so a slow batch is not redelivered meanwhile."""
    while True:
        await asyncio.sleep(every)
        for msg in msgs:
            await msg.in_progress()
