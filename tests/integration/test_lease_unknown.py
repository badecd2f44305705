"""A lease write whose outcome is unknown (it timed out, e.g. after a stall of the event loop or of
NATS) is resolved by reading the lease back: a write that was applied is adopted, and only a lease
that is really someone else's is lost. Real nats-server, real leases, a scripted SGLang engine."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from nats.errors import TimeoutError as NatsTimeoutError

from edge.keeper import SessionKeeper
from edge.live import LiveSession
from edge.ownership import KvLeases
from edge.service import EdgeService
from eventlog.reader import load_state
from schemas.errors import LogUnavailable, OwnershipLost
from tests.integration.edges import Agent, FakeClock, edges

TTL = 10.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def stall(edge: EdgeService, method: str, *, apply: bool, times: int = 1) -> list[int]:
    """Make the edge's next ``times`` calls of the lease bucket's ``method`` time out, after the server
    carried them out when ``apply`` (the reply was lost); returns the revisions the server answered."""
    leases = edge.leases
    assert leases is not None
    kv = await leases._store._bound()
    original: Callable[..., Awaitable[Any]] = getattr(kv, method)
    answered: list[int] = []
    left = [times]

    async def stalled(*args: Any, **kwargs: Any) -> Any:
        if left[0] <= 0:
            return await original(*args, **kwargs)
        left[0] -= 1
        if apply:
            result = await original(*args, **kwargs)
            answered.append(int(result) if isinstance(result, int) else -1)
        raise NatsTimeoutError

    setattr(kv, method, stalled)
    return answered


async def renew_during_a_request(edge: EdgeService, live: LiveSession, clock: FakeClock) -> None:
    """What the keeper does for a session with a request in flight once half its lease is gone."""
    clock.advance(TTL / 2 + 1)
    keeper = SessionKeeper(edge, idle_timeout=3600.0, leases=edge.leases, clock=clock)
    with live.in_use():
        await keeper.tick()


async def test_a_renewal_applied_but_timed_out_keeps_the_session(nc, js, log_config, engine, clock) -> None:
    async with edges(nc, log_config, engine.url, clock, "edge-a", ttl=TTL) as (edge,):
        agent = await Agent.open(edge)
        await agent.turn(edge, "one")
        live = edge.registry.peek(agent.session_id)
        assert live is not None and live.lease is not None
        answered = await stall(edge, "update", apply=True)

        await renew_during_a_request(edge, live, clock)

        assert answered, "the renewal reached the server"
        assert not live.lost and edge.registry.peek(agent.session_id) is live
        assert live.lease is not None and live.lease.revision == answered[0]  # the applied write, adopted
        clock.advance(TTL / 2 + 1)  # the next commit renews over the adopted revision
        await agent.turn(edge, "two")
        current, revision = await edge.leases.read(agent.session_id)  # type: ignore[union-attr]
        assert current is not None and current.edge_id == "edge-a" and revision == live.lease.revision
    state, _ = await load_state(js, log_config, agent.session_id)
    assert state.turns == 2


async def test_a_renewal_whose_read_back_also_fails_is_resolved_by_the_next_write(nc, js, log_config, engine,
                                                                                  clock) -> None:
    async with edges(nc, log_config, engine.url, clock, "edge-a", ttl=TTL) as (edge,):
        agent = await Agent.open(edge)
        await agent.turn(edge, "one")
        live = edge.registry.peek(agent.session_id)
        assert live is not None and live.lease is not None
        stale = live.lease.revision
        await stall(edge, "update", apply=True)
        await stall(edge, "get", apply=False)

        with pytest.raises(LogUnavailable):  # still unknown: the keeper logs it and tries again
            await live.lease.renew()
        assert live.lease.revision == stale and not live.lost

        clock.advance(TTL / 2 + 1)
        await agent.turn(edge, "two")  # its ensure() names the stale revision, reads back, adopts
        assert not live.lost and edge.registry.peek(agent.session_id) is live
        current, revision = await edge.leases.read(agent.session_id)  # type: ignore[union-attr]
        assert current is not None and current.edge_id == "edge-a" and revision == live.lease.revision > stale


async def test_a_timed_out_renewal_of_a_lease_taken_elsewhere_is_lost(nc, js, log_config, engine, clock) -> None:
    async with edges(nc, log_config, engine.url, clock, "edge-a", ttl=TTL) as (edge,):
        agent = await Agent.open(edge)
        await agent.turn(edge, "one")
        live = edge.registry.peek(agent.session_id)
        assert live is not None and live.lease is not None
        other = KvLeases.on(js, log_config, edge_id="edge-b", ttl=TTL, clock=clock)
        _, revision = await other.read(agent.session_id)
        await other.write(agent.session_id, revision)  # edge b took the session meanwhile
        await stall(edge, "update", apply=False)

        await renew_during_a_request(edge, live, clock)

        assert live.lost and edge.registry.peek(agent.session_id) is None


async def test_releasing_a_lease_taken_over_elsewhere_is_ownership_lost(js, log_config, clock) -> None:
    """A delete over a revision that moved is refused as lost ownership (nats-py answers a delete's wrong last
    sequence with a bare BadRequestError, which escaped the lease's release before), and the taker keeps it."""
    session_id = "0123456789abcdef0123456789abcdef"
    mine = KvLeases.on(js, log_config, edge_id="edge-a", ttl=TTL, clock=clock)
    handle = await mine.create(session_id)
    clock.advance(TTL + 5)
    other = KvLeases.on(js, log_config, edge_id="edge-b", ttl=TTL, clock=clock)
    await other.acquire(session_id)
    with pytest.raises(OwnershipLost):
        await mine.delete(session_id, handle.revision)
    await handle.release()  # best effort: says so in the log, raises nothing
    lease, _ = await other.read(session_id)
    assert lease is not None and lease.edge_id == "edge-b"
