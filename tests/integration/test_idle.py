"""Idle sessions are aborted with a reason, by their edge or (orphans) by another one; a closed
session's memory and lease are released."""

from __future__ import annotations

import asyncio
import gc
import sys
import time
import weakref

from edge.keeper import SessionKeeper
from eventlog.jetstream import JetStreamPort
from eventlog.publisher import JetStreamLog
from eventlog.reader import read_session
from schemas.events import RewardReported, SessionAborted
from session_projector.projections import iter_projections
from session_projector.service import Projector
from tests.integration.edges import Agent, FakeClock, edges
from tests.integration.projecting import running, wait_projected


def keeper(edge, js, cfg, clock, idle: float) -> SessionKeeper:
    return SessionKeeper(edge, idle_timeout=idle, leases=edge.leases,
                         orphans=lambda: iter_projections(js, cfg, heads_only=True), clock=clock)


async def aborted_reason(js, cfg, session_id: str) -> str | None:
    last = (await read_session(js, cfg, session_id)).events[-1]
    return last.reason if isinstance(last, SessionAborted) else None


async def test_idle_sessions_are_aborted_and_their_memory_and_lease_released(nc, js, log_config, engine):
    clock = FakeClock()
    async with edges(nc, log_config, engine.url, clock, "a", idle=60) as (edge,):
        idle, busy, recent = [await Agent.open(edge) for _ in range(3)]
        await idle.turn(edge, "hello")
        live = await edge.registry.get(idle.session_id)
        watch = weakref.ref(live)
        token_buffer = live.state.chains[0].segments[0].token_ids
        clock.advance(45)
        await recent.turn(edge, "still here")
        clock.advance(16)
        with (await edge.registry.get(busy.session_id)).in_use():  # a request in flight is not idleness
            await keeper(edge, js, log_config, clock, 60).tick()
        assert not edge.registry.holds(idle.session_id)
        assert edge.registry.holds(busy.session_id) and edge.registry.holds(recent.session_id)
        assert await aborted_reason(js, log_config, idle.session_id) == "idle_timeout"
        assert await aborted_reason(js, log_config, recent.session_id) is None
        assert (await edge.summary(idle.session_id)).close_reason == "idle_timeout"
        lease, _ = await edge.leases.read(idle.session_id)
        assert lease is None
        del live
        gc.collect()
        assert watch() is None
        assert sys.getrefcount(token_buffer) == 2  # this test's name and the call's argument: nothing else


async def test_finalize_releases_the_live_state_and_the_lease(nc, js, log_config, engine):
    async with edges(nc, log_config, engine.url, FakeClock(), "a") as (edge,):
        agent = await Agent.open(edge)
        await agent.turn(edge, "hello")
        watch = weakref.ref(await edge.registry.get(agent.session_id))
        await edge.finalize(agent.session_id)
        gc.collect()
        assert watch() is None and not edge.registry.holds(agent.session_id)
        lease, _ = await edge.leases.read(agent.session_id)
        assert lease is None
        assert (await edge.summary(agent.session_id)).status == "finalized"


async def test_an_orphan_left_by_a_dead_edge_is_aborted_by_another(nc, js, log_config, engine):
    clock = FakeClock()
    async with edges(nc, log_config, engine.url, clock, "dead", "other", idle=60) as (dead, other):
        orphan, alive = await Agent.open(dead), await Agent.open(dead)
        await orphan.turn(dead, "hello")
        clock.advance(61)
        await alive.turn(dead, "still talking")  # its lease was just renewed by its edge
        async with running(Projector(JetStreamPort(nc, log_config))):
            await wait_projected(js, log_config, {orphan.session_id: 5, alive.session_id: 5})
        assert await keeper(other, js, log_config, clock, 60).sweep() == 1
        assert await aborted_reason(js, log_config, orphan.session_id) == "idle_timeout"
        assert await aborted_reason(js, log_config, alive.session_id) is None
        assert not other.registry.holds(orphan.session_id) and not other.registry.holds(alive.session_id)


async def test_the_running_keeper_aborts_an_idle_session(nc, js, log_config, engine):
    async with edges(nc, log_config, engine.url, time.time, "a", idle=0.3) as (edge,):
        agent = await Agent.open(edge)
        stop = asyncio.Event()
        task = asyncio.create_task(keeper(edge, js, log_config, time.time, 0.3).run(stop))
        deadline = time.monotonic() + 20
        while edge.registry.holds(agent.session_id):
            assert time.monotonic() < deadline, "the keeper never aborted the idle session"
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 5)
        assert await aborted_reason(js, log_config, agent.session_id) == "idle_timeout"


async def test_a_sweep_lets_go_of_a_session_that_is_not_idle_after_all(nc, js, log_config, engine):
    clock = FakeClock()
    async with edges(nc, log_config, engine.url, clock, "dead", "other", idle=60) as (dead, other):
        agent = await Agent.open(dead)
        await agent.turn(dead, "hello")
        async with running(Projector(JetStreamPort(nc, log_config))):
            await wait_projected(js, log_config, {agent.session_id: 5})
        clock.advance(61)
        live = await dead.registry.get(agent.session_id)
        late = RewardReported(session_id=agent.session_id, seq=live.state.seq + 1, time=clock(), reward=1.0)
        await JetStreamLog(nc, log_config).append(agent.session_id, [late], live.stream_seq)  # the projection lags
        assert await keeper(other, js, log_config, clock, 60).sweep() == 0
        assert await aborted_reason(js, log_config, agent.session_id) is None
        assert not other.registry.holds(agent.session_id)
        lease, _ = await other.leases.read(agent.session_id)
        assert lease is None  # let go: the next edge asked for it takes it at once
