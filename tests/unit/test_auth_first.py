"""Authorization from the headers alone (EdgeService.authorize), on an in-memory log: one refusal for
every client without the session's key, whatever the session is; with the key, a closed session is
closed; a session this edge does not hold is not taken over for a wrong key."""

from __future__ import annotations

import pytest

from edge.service import REFUSED, EdgeService, OpenSession
from edge.tokens.fidelity import load_codec
from rollbus.testing.engine import HandlerEngine, result
from rollbus.testing.memory_log import InMemoryLog, in_memory_service
from schemas.errors import SessionClosed, Unauthorized
from schemas.events import RewardReported

CODEC = load_codec("builtin:qwen2.5", "hermes")


def service(log: InMemoryLog) -> EdgeService:
    return in_memory_service(HandlerEngine(lambda request: result([151645])), log=log, codec=CODEC)


async def refusal(edge: EdgeService, session_id: str, key: str | None) -> str:
    with pytest.raises(Unauthorized) as refused:
        await edge.authorize(session_id, key)
    return refused.value.message


async def test_every_client_without_the_key_gets_the_same_refusal() -> None:
    log = InMemoryLog()
    edge = service(log)
    open_, finalized, aborted = [await edge.open_session(OpenSession()) for _ in range(3)]
    await edge.finalize(finalized.session_id)
    await edge.abort(aborted.session_id, "test")
    cases = [(open_.session_id, None), (open_.session_id, "rb-wrong"), (open_.session_id, aborted.api_key),
             ("f" * 32, open_.api_key), ("../../x", open_.api_key), ("a" * 5000, "k"), ("", "k"),
             (finalized.session_id, None), (finalized.session_id, "rb-wrong"), (aborted.session_id, open_.api_key)]
    restarted = service(log)  # holds nothing: every session is read from the log
    for edge_ in (edge, restarted):
        assert {await refusal(edge_, sid, key) for sid, key in cases} == {REFUSED}
    assert not restarted.registry.holds(open_.session_id)  # not taken over for a wrong key
    assert (await edge.authorize(open_.session_id, open_.api_key)).session_id == open_.session_id


async def test_with_its_key_a_closed_session_is_closed_from_memory_or_from_the_log() -> None:
    log = InMemoryLog()
    edge = service(log)
    finalized, aborted = [await edge.open_session(OpenSession()) for _ in range(2)]
    await edge.finalize(finalized.session_id)
    await edge.abort(aborted.session_id, "test")
    restarted = service(log)
    await restarted.summary(aborted.session_id)  # known to the restarted edge by its summary first
    for edge_ in (edge, restarted):
        for opened in (finalized, aborted):
            with pytest.raises(SessionClosed):
                await edge_.authorize(opened.session_id, opened.api_key)
            assert await refusal(edge_, opened.session_id, "rb-wrong") == REFUSED


async def test_a_session_held_elsewhere_is_taken_over_with_its_key_only() -> None:
    log = InMemoryLog()
    opened = await service(log).open_session(OpenSession())
    restarted = service(log)
    assert await refusal(restarted, opened.session_id, "rb-wrong") == REFUSED
    assert not restarted.registry.holds(opened.session_id)
    live = await restarted.authorize(opened.session_id, opened.api_key)
    assert restarted.registry.peek(opened.session_id) is live and live.verified_key == opened.api_key
    assert await restarted.authorize(opened.session_id, opened.api_key) is live  # then from memory
    assert await refusal(restarted, opened.session_id, "rb-wrong") == REFUSED


async def test_a_late_reward_is_recorded_for_its_key_and_answered_closed() -> None:
    log = InMemoryLog()
    edge = service(log)
    opened = await edge.open_session(OpenSession())
    await edge.finalize(opened.session_id)
    assert await refusal(edge, opened.session_id, None) == REFUSED
    with pytest.raises(Unauthorized):
        await edge.reward_access(opened.session_id, "rb-wrong")
    late = await edge.reward_access(opened.session_id, opened.api_key)
    with pytest.raises(SessionClosed, match="recorded in the log for audit"):
        await edge.report_reward(late, {"reward": 1.0})
    events = (await log.read_session(opened.session_id)).events
    assert isinstance(events[-1], RewardReported) and events[-1].reward == 1.0
