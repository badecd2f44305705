"""How rollbus tries a call again: every retry loop is a :mod:`tenacity` ``AsyncRetrying``.

Each loop says, in tenacity's words, which errors it retries (``retry=``), how long it waits
between tries (``wait=``) and when it gives up (``stop=``: a number of attempts, a total
deadline, or a stop event); what it raises in the end stays the caller's (``reraise=True``
raises the last error as it was; a caller that names the attempts catches
:class:`tenacity.RetryError` and raises its own). The policies shared by more than one loop
are here:

- :func:`until_stopped`: a component's start-up call (subscribing its durable consumer,
  recovering staged batches) against a server that may not answer yet: tried again after
  ``first`` seconds, doubling, at most ``most`` apart, for as long as the component runs; a
  stop cuts the wait short, and nothing is tried after it.
- :func:`replay_first`: a loop whose first try runs outside tenacity because it is on a hot
  path (an append: ~50 us of tenacity's bookkeeping a call, against ~700 us of edge CPU a
  turn), its failure handed to tenacity as the first attempt's outcome.

What is not here, on purpose: poll loops (a consumer's fetch, waiting for a server's ports
file, a TransferQueue tag), which wait for something to happen rather than retry something that
failed; JetStream's redelivery of a batch the materializer could not write (the materializer
only pauses before it gives the batch back: :func:`eventlog.consumer.backoff`); and the HTTP
engines' single retry of a refused or dropped request (:mod:`edge.engines.http`), which moves
the request to another server inside a stream and is on the turn's path; the embedded
nats-server's supervisor (:class:`stack.nats_server.NatsSupervisor`), whose restart schedule
spans the server's deaths (a run of fast failures, counted across deaths and failed restarts,
reset by a server that served long enough): a supervision policy, on a thread of its own, not
a call tried again; and the optimistic loops (a compare-and-set that lost re-reads the key and
tries again at once, a bounded number of times), which never wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, RetryError, retry_if_exception_type, wait_exponential

T = TypeVar("T")


async def until_stopped(stop: asyncio.Event, retry_on: tuple[type[BaseException], ...],
                        call: Callable[[], Awaitable[T]], *, first: float, most: float, logger: logging.Logger,
                        what: str) -> T | None:
    """``call()``, tried again on ``retry_on`` errors ``first``, ``2 * first``, ... at most ``most`` seconds apart
    until it returns, or ``stop`` is set (None: not tried again once it is, the wait cut short); each failure is a
    warning naming ``what`` was not done and when it is tried again. Another error is raised at once."""

    async def sleep(seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), seconds)

    def warn(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        logger.warning("%s (%r); trying again in %.1fs", what, exc, delay)

    retrying = AsyncRetrying(retry=retry_if_exception_type(retry_on), wait=wait_exponential(multiplier=first, max=most),
                             stop=lambda _state: stop.is_set(), sleep=sleep, before_sleep=warn)
    try:
        async for attempt in retrying:
            if stop.is_set():
                return None
            with attempt:
                return await call()
    except RetryError:  # stopped after a failure
        return None
    raise AssertionError("unreachable: tenacity returns or raises")


async def replay_first(retrying: AsyncRetrying, first_failure: BaseException, call: Callable[[int], Awaitable[T]]) -> T:
    """Go on with a loop whose first try failed outside tenacity with ``first_failure``: tenacity takes that as
    its first attempt's outcome (its wait, its stop, its logging apply to it), then calls ``call(attempt)``
    from attempt 2 on."""
    pending: BaseException | None = first_failure
    async for attempt in retrying:
        with attempt:
            if pending is not None:
                failure, pending = pending, None
                raise failure
            return await call(attempt.retry_state.attempt_number)
    raise AssertionError("unreachable: tenacity returns or raises")
