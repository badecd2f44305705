"""The session projector on the in-memory log and KV: no NATS, milliseconds.

The same :class:`session_projector.service.Projector` that runs on JetStream (``tests/integration/test_projector.py``),
given :class:`rollbus.testing.memory_log.InMemoryLog`, whose consumers follow JetStream's ack and redelivery rules
(the log contract holds both to them)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import msgspec

from rollbus.testing.memory_log import InMemoryLog
from schemas.log import ReadySignal
from session.fold import SessionState, fold, release_buffers
from session_projector.projections import Projection, decode
from session_projector.service import Projector
from tests.helpers import SessionScript
from tests.sessions import append, envelopes

A, B = "a" * 32, "b" * 32


def script(session_id: str, *, ended: bool = True) -> SessionScript:
    s = SessionScript(session_id=session_id, uid=f"u{session_id[0]}")
    s.turn(0, [1, 2], [3, 4], new_chain=True)
    s.turn(0, [5], [6, 7])
    if ended:
        s.reward(1.0)
        s.finalize()
    return s


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


@contextlib.asynccontextmanager
async def running(projector: Projector) -> AsyncIterator[Projector]:
    stop = asyncio.Event()
    task = asyncio.ensure_future(projector.run(stop))
    try:
        yield projector
    finally:
        stop.set()
        await task


def counters(state: SessionState) -> tuple[object, ...]:
    """What a projection promises whichever way it was folded (from the start, or onto a stored projection,
    whose released chains number their segments afresh): statuses, sequence, counters, reward."""
    return (
        state.status,
        state.seq,
        state.turns,
        state.reward,
        state.updated_at,
        [(c.prompt_len, c.response_len, c.generated_len, len(c.turns)) for c in state.chains],
    )


def projection(log: InMemoryLog, session_id: str) -> Projection | None:
    found = log.kv(log.cfg.projections_bucket)._entries.get(session_id)
    return decode(found.value) if found is not None and found.value is not None else None


def acked(log: InMemoryLog, durable: str = "rollbus-projections") -> set[int]:
    consumer = log.consumers.get((log.cfg.stream, durable))
    return consumer.acked if consumer is not None else set()


def signals(log: InMemoryLog) -> list[ReadySignal]:
    return [msgspec.json.decode(m.data, type=ReadySignal) for m in log.ready]


async def test_a_sessions_events_fold_into_its_projection_and_one_ready_signal() -> None:
    log = InMemoryLog(max_wait=0.005)
    ended, open_ = script(A), script(B, ended=False)
    async with running(Projector(log)):
        last = await append(log, ended)
        await append(log, open_)
        await until(lambda: len(acked(log)) == len(log.messages))
    stored = projection(log, A)
    assert stored is not None
    assert (stored.state, stored.stream_seq, stored.status) == (release_buffers(fold(ended.events)), last, "finalized")
    still_open = projection(log, B)
    assert still_open is not None and still_open.status == "open"
    assert signals(log) == [ReadySignal(session_id=A, stream_seq=last)]  # the ended session only


async def test_a_group_whose_projection_write_fails_is_redelivered_and_written_later() -> None:
    log = InMemoryLog(redelivery_delay=0.0, max_wait=0.005)
    s = script(A)
    log.kv(log.cfg.projections_bucket).fail_next("the bucket did not answer")
    async with running(Projector(log)):
        last = await append(log, s)
        await until(lambda: len(acked(log)) == len(log.messages))
    consumer = log.consumers[(log.cfg.stream, "rollbus-projections")]
    assert max(consumer.deliveries.values()) == 2  # the failed group came back once
    written = projection(log, A)
    assert written is not None and written.state == release_buffers(fold(s.events))
    assert signals(log) == [ReadySignal(session_id=A, stream_seq=last)]


async def test_a_restarted_projector_resumes_and_a_new_one_repeats_nothing() -> None:
    log = InMemoryLog(max_wait=0.005)
    s = script(A)
    groups = envelopes(s.events)
    async with running(Projector(log)):
        after = 0
        for group in groups[:2]:
            after = (await log.append(A, group, after)).stream_seq
        await until(lambda: len(acked(log)) == 2)
    async with running(Projector(log)):  # the same durable: resumes after its acks
        for group in groups[2:]:
            after = (await log.append(A, group, after)).stream_seq
        await until(lambda: len(acked(log)) == len(groups))
    assert log.consumers[(log.cfg.stream, "rollbus-projections")].deliveries.total() == len(groups)
    first = projection(log, A)
    async with running(Projector(log, durable="again")):  # reads it all again: every envelope is a redelivery
        await until(lambda: len(acked(log, "again")) == len(groups))
    assert projection(log, A) == first and first is not None and counters(first.state) == counters(fold(s.events))
    assert len(log.ready) == 1  # the second signal had the same Nats-Msg-Id


async def test_a_lost_projection_is_rebuilt_from_the_log() -> None:
    log = InMemoryLog(max_wait=0.005)
    s = script(A)
    groups = envelopes(s.events)
    async with running(Projector(log)) as projector:
        after = 0
        for group in groups[:2]:
            after = (await log.append(A, group, after)).stream_seq
        await until(lambda: len(acked(log)) == 2)
        await log.kv(log.cfg.projections_bucket).delete(A)
        projector.store.forget(A)
        for group in groups[2:]:
            after = (await log.append(A, group, after)).stream_seq
        await until(lambda: len(acked(log)) == len(groups))
    assert projector.rebuilt == 1
    rebuilt = projection(log, A)
    assert rebuilt is not None and counters(rebuilt.state) == counters(fold(s.events))
