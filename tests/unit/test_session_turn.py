"""A turn decided as pure functions (session.turn, session.numbering): plans from the fold state, and
events numbered consecutively from the session's last sequence, whatever was appended meanwhile."""

from __future__ import annotations

import copy

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import tokens
from schemas.bodies import literal
from schemas.errors import OutOfOrderEvent
from schemas.events import (
    ChainClosed,
    ChainStarted,
    ContextAppended,
    EngineFailed,
    Event,
    ForkPoint,
    RequestReceived,
    RewardReported,
    TokensGenerated,
    TurnAbandoned,
    TurnCompleted,
    TurnRolledBack,
    body_digest,
)
from session.chains import Continue, NewChain, Rollback
from session.fold import SessionState, apply, fold
from session.numbering import UNNUMBERED, numbered
from session.turn import (
    CAPACITY,
    Received,
    Sampled,
    TurnFacts,
    TurnPlan,
    abandoned_events,
    engine_ids,
    failure_events,
    fills,
    kept_ids,
    plan_turn,
    refusal_events,
    refuses,
    turn_events,
)
from tests.helpers import SessionScript

LIMIT = 1000


def opened() -> SessionState:
    state = fold(SessionScript(max_len=LIMIT).events)
    assert state is not None
    return state


def received(request_no: int, body: bytes = b"{}") -> Received:
    return Received(request_no=request_no, wire="openai", parts=literal(body), body_size=len(body),
                    body_digest=body_digest(body), time=float(request_no))


def facts(request_no: int, context: list[int], **more: object) -> TurnFacts:
    return TurnFacts(request_no=request_no, context=tokens.pack_ids(context), n_messages=2 * request_no,
                     chat_turns=1, prefix_digest=f"p{request_no}", **more)


def sampled(ids: list[int], tip: str = "tip") -> Sampled:
    return Sampled(token_ids=tokens.pack_ids(ids), finish_reason="stop", text="reply", tip_digest=tip)


def appended(state: SessionState, events: tuple[Event, ...]) -> SessionState:
    """``events`` applied after ``state``, checked to be numbered from its last sequence on."""
    assert [e.seq for e in events] == list(range(state.seq + 1, state.seq + 1 + len(events)))
    for event in events:
        state = apply(state, event)
    return state


def take_turn(state: SessionState, selection: Continue | Rollback | NewChain, request_no: int, context: list[int],
              reply: list[int], **more: object) -> SessionState:
    plan = plan_turn(state, selection, facts(request_no, context, **more))
    return appended(state, turn_events(state, plan, received(request_no), sampled(reply, f"tip{request_no}"),
                                       limit=LIMIT, time=9.0))


def two_turn_chain() -> SessionState:
    state = take_turn(opened(), NewChain(), 1, [1, 2, 3], [4, 5])
    return take_turn(state, Continue(state.chain(0), 2), 2, [6], [7, 8, 9])


def test_numbered_numbers_from_after_the_last_sequence_and_keeps_what_is_numbered_already() -> None:
    drafts = [RewardReported(session_id="s", seq=UNNUMBERED, time=0.0, reward=1.0)] * 3
    assert [e.seq for e in numbered(drafts, 41)] == [42, 43, 44]
    already = RewardReported(session_id="s", seq=5, time=0.0, reward=1.0)
    assert numbered([already], 4)[0] is already
    assert numbered([], 7) == ()


def test_a_new_chain_starts_at_the_next_index_with_its_fork_point_and_prompt_as_the_engine_input() -> None:
    state = take_turn(opened(), NewChain(), 1, [1, 2, 3, 4], [5])
    sibling = ForkPoint(cause="sibling", parent=0, message_index=1)
    plan = plan_turn(state, NewChain(), facts(2, [1, 2, 9], fork=sibling))
    assert plan.chain is None and plan.input_length == 3 and plan.fork == msgspec.structs.replace(sibling,
                                                                                                   token_offset=2)
    assert engine_ids(state, plan) == tokens.pack_ids([1, 2, 9]) and not refuses(plan, LIMIT)
    events = turn_events(state, plan, received(2), sampled([7, 8]), limit=LIMIT, time=9.0)
    assert [type(e) for e in events] == [RequestReceived, ChainStarted, TokensGenerated, TurnCompleted]
    assert all(getattr(e, "chain", 1) == 1 for e in events) and events[1].fork == plan.fork
    after = appended(state, events)
    assert after.chain(1).token_ids() == [1, 2, 9, 7, 8] and after.chain(1).n_messages == 5


def test_a_continued_chain_appends_its_increment_after_the_chains_tokens() -> None:
    state = take_turn(opened(), NewChain(), 1, [1, 2, 3], [4, 5])
    chain = state.chain(0)
    plan = plan_turn(state, Continue(chain, 2), facts(2, [6, 7], reserialized="reasoning_dropped"))
    assert (plan.chain, plan.input_length, plan.rollback) == (0, 7, None)
    assert engine_ids(state, plan) == chain.packed_ids() + tokens.pack_ids([6, 7])
    events = turn_events(state, plan, received(2), sampled([8]), limit=LIMIT, time=9.0)
    assert [type(e) for e in events] == [RequestReceived, ContextAppended, TokensGenerated, TurnCompleted]
    assert events[1].reserialized == "reasoning_dropped"
    assert appended(state, events).chain(0).token_ids() == [1, 2, 3, 4, 5, 6, 7, 8]


def test_a_rewritten_reply_is_rolled_back_and_the_engine_sees_the_chain_without_it() -> None:
    state = two_turn_chain()
    chain = state.chain(0)
    plan = plan_turn(state, Rollback(chain, 3), facts(3, [10, 11]))
    assert plan.rollback == (2, 3) and plan.input_length == chain.length - 3 + 2
    assert engine_ids(state, plan) == kept_ids(chain) + tokens.pack_ids([10, 11])
    assert tokens.unpack_ids(kept_ids(chain)).tolist() == [1, 2, 3, 4, 5, 6]
    events = turn_events(state, plan, received(3), sampled([12]), limit=LIMIT, time=9.0)
    assert [type(e) for e in events][:3] == [RequestReceived, TurnRolledBack, ContextAppended]
    assert appended(state, events).chain(0).token_ids() == [1, 2, 3, 4, 5, 6, 10, 11, 12]


def test_no_room_refuses_and_closes_the_chain_it_would_extend() -> None:
    state = take_turn(opened(), NewChain(), 1, [1] * 10, [2] * 10)
    plan = plan_turn(state, Continue(state.chain(0), 2), facts(2, [3] * (LIMIT - 20)))
    assert refuses(plan, LIMIT) and not refuses(plan, LIMIT + 1)
    events = refusal_events(state, received(2), plan.chain)
    assert [type(e) for e in events] == [RequestReceived, ChainClosed] and events[1].reason == CAPACITY
    after = appended(state, events)
    assert after.chain(0).closed == CAPACITY and after.requests == 2
    assert [type(e) for e in refusal_events(after, received(3), None)] == [RequestReceived]


def test_a_turn_that_fills_its_chain_closes_it() -> None:
    state = opened()
    plan = plan_turn(state, NewChain(), facts(1, [1] * 990))
    assert not fills(plan, 9, LIMIT) and fills(plan, 10, LIMIT)
    events = turn_events(state, plan, received(1), sampled([2] * 10), limit=LIMIT, time=9.0)
    assert type(events[-1]) is ChainClosed and appended(state, events).chain(0).closed_by == 1


def test_failed_and_abandoned_turns_record_the_request_and_leave_the_chain_as_it_was() -> None:
    state = two_turn_chain()
    failed = failure_events(state, received(3), 0, error="EngineTimeout", message="slow", time=9.0)
    after = appended(state, failed)
    assert type(failed[1]) is EngineFailed and after.chains == state.chains
    abandoned = abandoned_events(after, received(4), None, reason="client_disconnected", tokens_sampled=3,
                                 time=9.0)
    assert type(abandoned[1]) is TurnAbandoned and appended(after, abandoned).chains == state.chains


def test_a_turn_planned_before_another_was_appended_is_numbered_after_it() -> None:
    """Two requests planned from one state: the second appended is numbered after the first, and its
    new chain takes the next index then, not the one it would have taken when planned."""
    state = take_turn(opened(), NewChain(), 1, [1, 2], [3])
    first = plan_turn(state, Continue(state.chain(0), 2), facts(2, [4]))
    second = plan_turn(state, NewChain(), facts(3, [1, 9]))
    after_first = appended(state, turn_events(state, first, received(2), sampled([5]), limit=LIMIT, time=9.0))
    events = turn_events(after_first, second, received(3), sampled([6]), limit=LIMIT, time=9.0)
    assert events[0].seq == after_first.seq + 1 and events[1].chain == 1
    appended(after_first, events)
    stale = turn_events(state, second, received(3), sampled([6]), limit=LIMIT, time=9.0)
    assert stale[0].seq == state.seq + 1
    with pytest.raises(OutOfOrderEvent):  # numbered from the state it was planned from: the fold refuses it
        apply(after_first, stale[0])


# --- the property: consecutive numbering from the session's last sequence ------------------------------

ACTIONS = st.lists(st.tuples(st.sampled_from(["new", "continue", "rollback", "refuse", "fail", "abandon", "reward"]),
                             st.integers(0, 7), st.lists(st.integers(0, 50_000), max_size=6),
                             st.lists(st.integers(0, 50_000), max_size=6)), max_size=14)


def _events_for(state: SessionState, action: str, pick: int, context: list[int], reply: list[int]) -> tuple[Event,
                                                                                                          ...]:
    request_no = state.requests + 1
    open_chains = [c for c in state.chains if c.closed is None]
    chain = open_chains[pick % len(open_chains)] if open_chains else None
    if action == "reward":
        return numbered([RewardReported(session_id=state.session_id, seq=UNNUMBERED, time=1.0, reward=1.0)],
                        state.seq)
    if action == "fail":
        return failure_events(state, received(request_no), chain and chain.index, error="EngineError", message="x",
                              time=1.0)
    if action == "abandon":
        return abandoned_events(state, received(request_no), chain and chain.index, reason="client_disconnected",
                                tokens_sampled=len(reply), time=1.0)
    if action == "refuse":
        return refusal_events(state, received(request_no), chain and chain.index)
    selection: Continue | Rollback | NewChain = NewChain()
    if chain is not None and action == "continue":
        selection = Continue(chain, chain.n_messages)
    elif chain is not None and action == "rollback" and len(chain.turns) >= 2:
        selection = Rollback(chain, chain.turns[-1].n_prefix_messages)
    if isinstance(selection, NewChain) and not context:
        context = [1]  # a prompt is never empty
    before = copy.deepcopy(state)
    plan: TurnPlan = plan_turn(state, selection, facts(request_no, context))
    events = turn_events(state, plan, received(request_no), sampled(reply), limit=LIMIT, time=1.0)
    assert state == before  # deciding changed nothing
    return events


@settings(max_examples=150, deadline=None)
@given(ACTIONS)
def test_a_turns_events_are_numbered_consecutively_from_the_sessions_last_sequence(actions: list) -> None:
    state = opened()
    total = 1
    for action, pick, context, reply in actions:
        events = _events_for(state, action, pick, context, reply)
        assert [e.seq for e in events] == list(range(state.seq + 1, state.seq + 1 + len(events)))
        assert all(e.session_id == state.session_id for e in events)
        state = appended(state, events)  # and the fold takes them as they are
        total += len(events)
    assert state.seq == total
