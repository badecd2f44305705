"""Which requests repeat a recorded one, and the answer rebuilt from the fold state."""

from __future__ import annotations

import asyncio

import pytest

from edge.idempotency import InFlight, identify, recorded_outcome, repeated_request, retry_count
from schemas.errors import IdempotencyKeyReused, MalformedRequest
from schemas.events import ToolCall, TurnCompleted
from session.fold import fold
from tests.helpers import SessionScript

BODY, OTHER = b'{"messages":[1]}', b'{"messages":[2]}'


def _session():
    script = SessionScript()
    script.turn(0, [1, 2, 3], [4, 5], new_chain=True, body=BODY, key="k1", logprobs=[-0.5, -0.25])
    script.turn(0, [6, 7], [8, 9, 10], n_messages=4, tip="t2", body=OTHER)
    script.close(0, request_no=2)
    return script


def test_retry_count_header():
    assert retry_count({"x-stainless-retry-count": "2"}) == 2
    assert retry_count({}) == 0 and retry_count({"x-stainless-retry-count": "x"}) == 0


def test_a_key_repeats_the_request_that_carried_it():
    state = fold(_session().events)
    assert repeated_request(state, identify(BODY, "k1")) == 1
    assert repeated_request(state, identify(BODY, "k2")) is None
    with pytest.raises(IdempotencyKeyReused):
        repeated_request(state, identify(OTHER, "k1"))


def test_without_a_key_only_a_retry_repeats_an_identical_body():
    state = fold(_session().events)
    assert repeated_request(state, identify(OTHER, None, retries=1)) == 2
    assert repeated_request(state, identify(OTHER, None, retries=0)) is None  # a sibling sample
    assert repeated_request(state, identify(b"{}", None, retries=3)) is None


@pytest.mark.parametrize("key", ["", "x" * 256, "é", "a\nb"])
def test_bad_keys_are_refused(key):
    with pytest.raises(MalformedRequest):
        identify(BODY, key)


def test_recorded_outcome_is_the_answer_the_turn_gave():
    state = fold(_session().events)
    first = recorded_outcome(state, 1)
    assert first is not None
    assert first.token_ids == (4, 5) and first.logprobs == (-0.5, -0.25)
    assert first.prompt_tokens == 3 and first.completion_tokens == 2 and first.finish_reason == "stop"
    second = recorded_outcome(state, 2)
    assert second is not None
    assert second.token_ids == (8, 9, 10) and second.prompt_tokens == 3 + 2 + 2
    assert second.finish_reason == "length"  # the turn closed the chain
    assert second.created == int(state.chains[0].turns[1].time)
    assert recorded_outcome(state, 3) is None


def test_recorded_tool_calls_finish_with_tool_calls():
    script = SessionScript()
    script.turn(0, [1], [2], new_chain=True)
    last = script.events[-1]
    assert isinstance(last, TurnCompleted)
    call = ToolCall(id="call_1_0", name="calc", arguments="{}")
    script.events[-1] = TurnCompleted(session_id=last.session_id, seq=last.seq, time=last.time, chain=0,
                                      request_no=1, finish_reason="stop", text="", tool_calls=(call,),
                                      tip_digest="t", n_messages=3)
    outcome = recorded_outcome(fold(script.events), 1)
    assert outcome is not None and outcome.finish_reason == "tool_calls" and outcome.tool_calls == (call,)


async def test_a_repeat_waits_for_its_original_and_a_new_request_does_not():
    inflight = InFlight()
    gate = asyncio.Event()
    order: list[str] = []

    async def run_original():
        with inflight.running(identify(BODY, "k")):
            await gate.wait()
            order.append("original")

    task = asyncio.create_task(run_original())
    await asyncio.sleep(0)  # it registers
    await inflight.settled(identify(BODY, None))  # a new request does not wait
    order.append("new")
    waiter = asyncio.create_task(inflight.settled(identify(BODY, "k")))
    await asyncio.sleep(0)
    assert not waiter.done()
    gate.set()
    await waiter
    order.append("repeat")
    await task
    assert order == ["new", "original", "repeat"]
    await inflight.settled(identify(BODY, None, retries=1))  # nothing running any more
