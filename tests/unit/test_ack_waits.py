"""AckWaits: one timer enforces every waiting publish's deadline."""

from __future__ import annotations

import asyncio

import pytest

from edge.acks import Ack, AckWaits


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


async def test_fail_all_gives_each_publish_an_error_of_its_own() -> None:
    waits = AckWaits()
    tasks = [asyncio.ensure_future(waits.wait(lambda token: None, 5.0)) for _ in range(3)]
    await asyncio.sleep(0)
    waits.fail_all(lambda: ConnectionResetError("gone"))
    errors = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(e, ConnectionResetError) for e in errors) and len({id(e) for e in errors}) == 3
    assert waits.pending == {}
