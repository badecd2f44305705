"""AckWaits: one timer enforces every waiting publish's deadline."""

from __future__ import annotations

import asyncio

import pytest

from eventlog.acks import PROBE_S, Ack, AckWaits
from schemas.errors import PublishRefused


async def _timed_out(waits: AckWaits, timeout: float) -> float:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TimeoutError):
        await waits.wait(lambda token: None, timeout)
    return loop.time() - started


async def test_unanswered_publishes_time_out_at_their_own_deadlines() -> None:
    waits = AckWaits()
    long, short, later = await asyncio.gather(_timed_out(waits, 0.3), _timed_out(waits, 0.05),
                                              _timed_out(waits, 0.15))
    assert 0.05 <= short < 0.15  # shorter than the one armed first: the timer was moved up for it
    assert 0.15 <= later < 0.25 and 0.3 <= long < 0.4
    assert waits.pending == {}


async def test_an_answered_publish_returns_its_ack_and_leaves_nothing_waiting() -> None:
    waits = AckWaits()

    def send(token: str) -> None:
        asyncio.get_running_loop().call_soon(lambda: waits.take(token).set_result(Ack(stream="S", seq=7)))

    ack = await waits.wait(send, 0.05)
    assert ack == Ack(stream="S", seq=7) and waits.pending == {}
    await asyncio.sleep(0.1)  # the deadline passes: nothing is failed, nothing re-armed
    assert waits.pending == {} and waits._timer is None


async def test_a_publish_outlives_the_deadline_of_one_answered_before_it() -> None:
    waits = AckWaits()
    first = asyncio.ensure_future(waits.wait(lambda token: None, 0.05))
    await asyncio.sleep(0.01)
    waits.take("1").set_result(Ack(seq=1))
    assert (await first).seq == 1
    elapsed = await _timed_out(waits, 0.2)  # armed behind the first one's timer, re-armed when it fired
    assert 0.2 <= elapsed < 0.3


async def test_a_publish_found_refused_fails_at_the_next_probe_and_the_others_wait_on() -> None:
    refused = {"rb.denied"}
    seen: list[tuple[str, object]] = []

    def refusal(subject: str, since: object) -> BaseException | None:
        seen.append((subject, since))
        return PublishRefused(subject) if subject in refused else None

    waits = AckWaits(refusal)
    loop = asyncio.get_running_loop()
    started = loop.time()
    denied = asyncio.ensure_future(waits.wait(lambda token: None, 5.0, subject="rb.denied", since="before"))
    allowed = asyncio.ensure_future(waits.wait(lambda token: None, 0.3, subject="rb.allowed"))
    with pytest.raises(PublishRefused):
        await denied
    assert loop.time() - started < 20 * PROBE_S  # found at a probe, not at its 5 s deadline
    assert ("rb.denied", "before") in seen
    with pytest.raises(TimeoutError):  # not refused: it waits for its ack until its own deadline
        await allowed
    assert 0.3 <= loop.time() - started < 0.6 and waits.pending == {}


async def test_without_a_refusal_check_nothing_is_probed() -> None:
    waits = AckWaits()
    waiting = asyncio.ensure_future(waits.wait(lambda token: None, 5.0))
    await asyncio.sleep(0)
    assert waits._timer_at - asyncio.get_running_loop().time() > 4.9  # armed for the deadline only
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert waits.pending == {}
