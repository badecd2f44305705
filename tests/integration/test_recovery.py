"""Ownership and recovery of open sessions across edges, and idempotent retries, against a real
nats-server and a scripted SGLang engine. Each "edge" is an EdgeService of its own (its own
registry, leases instance and engine client), as a separate process would have."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from edge.turns import TurnOutcome
from eventlog.jetstream import JetStreamPort
from eventlog.publisher import JetStreamLog
from eventlog.reader import load_state, read_session
from schemas.errors import IdempotencyKeyReused, OwnershipLost, SessionOwned
from schemas.events import RewardReported
from session.fold import fold
from session.summary import summarize
from session_projector.service import Projector
from tests.integration.edges import Agent, FakeClock, edges
from tests.integration.projecting import running, wait_projected


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def same(replayed: TurnOutcome, original: TurnOutcome) -> bool:
    """Equal, log probs as stored (float32; the engine's own values may carry more digits)."""
    stored = np.float32(original.logprobs or ())
    return (msgspec.structs.replace(replayed, logprobs=None) == msgspec.structs.replace(original, logprobs=None)
            and np.array_equal(np.float32(replayed.logprobs or ()), stored))


async def stored_tokens(js, cfg, session_id: str) -> list[int]:
    state, _ = await load_state(js, cfg, session_id)
    return state.chains[0].token_ids()


async def test_another_edge_takes_over_once_the_lease_lapses_and_the_old_one_stops(nc, js, log_config, engine, clock):
    async with edges(nc, log_config, engine.url, clock, "a", "b") as (a, b):
        agent = await Agent.open(a)
        await agent.turn(a, "one")
        before = await stored_tokens(js, log_config, agent.session_id)

        with pytest.raises(SessionOwned) as refused:
            await agent.send(b, agent.request("two"))
        assert 0 < refused.value.retry_after <= 10 + 2
        clock.advance(13)  # a's lease lapses (ttl 10 + grace 2)
        await agent.send(b, agent.request(None))
        assert engine.requests[-1]["input_ids"][: len(before)] == before  # b continued the stored tokens
        assert len((await load_state(js, log_config, agent.session_id))[0].chains) == 1

        # a still holds its stale live state: not trusted for reads, its lease having lapsed ...
        assert (await a.summary(agent.session_id)).turns == 2
        # ... and its next write is refused and the state dropped.
        with pytest.raises(OwnershipLost):
            await agent.send(a, agent.request(None, key="x"))
        assert not a.registry.holds(agent.session_id)
        with pytest.raises(SessionOwned):  # b's lease is fresh
            await agent.send(a, agent.request(None, key="y"))
    state, _ = await load_state(js, log_config, agent.session_id)
    assert state.turns == 2 and state.requests == 2


async def test_an_edge_restarted_with_the_same_id_takes_its_sessions_back_at_once(nc, js, log_config, engine, clock):
    async with edges(nc, log_config, engine.url, clock, "a", "a") as (first, restarted):
        agent = await Agent.open(first)
        await agent.turn(first, "one")
        before = await stored_tokens(js, log_config, agent.session_id)
        await agent.turn(restarted, "two")  # no waiting for the lease
        after = await stored_tokens(js, log_config, agent.session_id)
    assert after[: len(before)] == before and len(after) > len(before)


async def test_a_foreign_append_drops_the_live_state_and_the_session_reloads(nc, js, log_config, engine, clock):
    async with edges(nc, log_config, engine.url, clock, "a") as (a,):
        agent = await Agent.open(a)
        await agent.turn(a, "one")
        live = await a.registry.get(agent.session_id)
        # Someone else writes the session behind this edge's back (the log's sequence check still holds).
        foreign = RewardReported(session_id=agent.session_id, seq=live.state.seq + 1, time=clock(), reward=0.5)
        await JetStreamLog(nc, log_config).append(agent.session_id, [foreign], live.stream_seq)
        with pytest.raises(OwnershipLost):
            await agent.send(a, agent.request("two"))
        assert not a.registry.holds(agent.session_id)
        await agent.send(a, agent.request(None))  # reloaded from the log, foreign event included
    state, _ = await load_state(js, log_config, agent.session_id)
    assert state.reward is not None and state.reward.reward == 0.5 and state.turns == 2


async def test_retries_get_the_recorded_completion_also_after_a_restart(nc, js, log_config, engine, clock):
    async with edges(nc, log_config, engine.url, clock, "a", "a") as (first, restarted):
        agent = await Agent.open(first)
        request = agent.request("one", key="req-1")
        original = await agent.send(first, request)
        calls = len(engine.requests)

        again = await agent.send(restarted, request)  # same key, same body, another process
        assert same(again, original) and len(engine.requests) == calls
        retried = await agent.send(restarted, agent.request(None, retries=1))  # the SDK's retry header
        assert same(retried, original) and len(engine.requests) == calls
        with pytest.raises(IdempotencyKeyReused):
            await agent.send(restarted, agent.request("changed", key="req-1"))
        agent.messages.pop()

        sibling = await agent.send(restarted, agent.request(None))  # no key, no retry: a new sample
        assert len(engine.requests) == calls + 1 and sibling.request_no != original.request_no
    events = (await read_session(js, log_config, agent.session_id)).events
    assert sum(type(e).__name__ == "TurnCompleted" for e in events) == 2


async def test_a_summary_of_a_session_held_elsewhere_comes_from_its_projection_without_taking_it(
        nc, js, log_config, engine, clock):
    async with edges(nc, log_config, engine.url, clock, "a", "b") as (a, b):
        agent = await Agent.open(a)
        await agent.turn(a, "one")
        unprojected = await b.summary(agent.session_id)  # no projection yet: replayed
        async with running(Projector(JetStreamPort(nc, log_config))):
            await wait_projected(js, log_config, {agent.session_id: 5})
        await agent.turn(a, "two")  # past the projection: b folds the log's tail onto it
        summary = await b.summary(agent.session_id)
        log = (await read_session(js, log_config, agent.session_id)).events
        assert summary == summarize(fold(log)) == await a.summary(agent.session_id)
        assert unprojected.turns == 1 and summary.turns == 2
        assert not b.registry.holds(agent.session_id)
        lease, _ = await b.leases.read(agent.session_id)
        assert lease is not None and lease.edge_id == "a"  # reading took nothing over


async def test_concurrent_takeovers_have_exactly_one_winner(nc, js, log_config, engine, clock):
    async with edges(nc, log_config, engine.url, clock, "a", "b", "c", "d") as (a, *others):
        agent = await Agent.open(a)
        await agent.turn(a, "one")
        clock.advance(13)
        results = await asyncio.gather(*(edge.registry.get(agent.session_id) for edge in others),
                                       return_exceptions=True)
        winners = [edge for edge, result in zip(others, results, strict=True) if not isinstance(result, Exception)]
        assert len(winners) == 1, results
        assert all(isinstance(r, SessionOwned) for r in results if isinstance(r, Exception))
        await agent.turn(winners[0], "two")
    state, _ = await load_state(js, log_config, agent.session_id)
    assert state.turns == 2


async def test_a_renewal_racing_a_commits_ensure_on_one_edge_is_not_ownership_lost(js, log_config, clock):
    """The keeper renews without the session's lock while a request commits and ensures the lease: both
    write the lease, each over the revision the other wrote (before, the second refused its own edge)."""
    from edge.ownership import KvLeases

    leases = KvLeases.on(js, log_config, edge_id="edge-a", ttl=10.0, clock=clock)
    handle = await leases.create("0123456789abcdef0123456789abcdef")
    clock.advance(6)  # past half the TTL: ensure() writes too
    for _ in range(5):
        await asyncio.gather(handle.renew(), handle.ensure(), handle.renew())
        clock.advance(6)
    current, revision = await leases.read(handle.session_id)
    assert current is not None and current.edge_id == "edge-a" and revision == handle.revision
    await handle.release()
    assert (await leases.read(handle.session_id))[0] is None
