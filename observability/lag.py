"""Consumer lag as metrics: :func:`watch_lag` samples the JetStream consumers' lag every ``interval`` seconds
(``--lag-interval``, default ``edge.settings.LAG_INTERVAL_S``) into
``rollbus_consumer_pending_messages`` and ``rollbus_consumer_lag_seconds``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from nats.js.client import JetStreamContext

from eventlog.lag import Watched, consumer_lag
from observability.registry import Metrics
from schemas.errors import RollbusError

log = logging.getLogger(__name__)

async def watch_lag(metrics: Metrics, js: JetStreamContext, watched: Sequence[Watched], stop: asyncio.Event, *,
                    interval: float, clock: Callable[[], float] = time.time) -> None:
    """Every ``interval`` seconds until ``stop``, each watched consumer's lag into the lag gauges (a consumer
    not created yet, or JetStream not answering, leaves its gauges as they were)."""
    while not stop.is_set():
        for consumer in watched:
            try:
                lag = await consumer_lag(js, consumer, clock=clock)
            except RollbusError as exc:
                log.debug("lag of %s not sampled: %s", consumer.name, exc)
                continue
            if lag is not None:
                metrics.consumer_pending.labels(consumer.name).set(lag.messages)
                metrics.consumer_lag.labels(consumer.name).set(lag.seconds)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
