"""The fold's additions for idempotency and projections: the request index, each turn's
segments, and released states that fold on and summarize like the full ones."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import tokens
from schemas.events import RequestReceived, body_digest
from session.fold import fold, release_buffers
from session.summary import summarize
from tests.helpers import SessionScript


def test_requests_are_indexed_by_key_and_by_body():
    script = SessionScript()
    script.turn(0, [1, 2], [3], new_chain=True, body=b'{"a":1}', key="k1")
    script.turn(0, [4], [5], body=b'{"a":2}', tip="t2", n_messages=4)
    script.turn(1, [1, 2], [6], new_chain=True, body=b'{"a":1}')  # same body again: a sibling sample
    state = fold(script.events)
    assert state.idempotency_keys["k1"].request_no == 1
    assert state.idempotency_keys["k1"].body_digest == body_digest(b'{"a":1}')
    assert state.request_bodies == {body_digest(b'{"a":1}'): 3, body_digest(b'{"a":2}'): 2}


def test_a_recorded_body_digest_is_used_as_is():
    script = SessionScript()
    script.turn(0, [1], [2], new_chain=True, body=b"{}")
    received = script.events[1]
    assert isinstance(received, RequestReceived)
    script.events[1] = msgspec.structs.replace(received, body_digest="d" * 64)
    assert fold(script.events).request_bodies == {"d" * 64: 1}


def test_turns_know_their_segments_time_and_the_closing_request():
    script = SessionScript()
    script.turn(0, [1, 2, 3], [4, 5], new_chain=True)
    script.turn(0, [6], [7, 8, 9], n_messages=4, tip="t2")
    script.close(0, request_no=2)
    state = fold(script.events)
    chain = state.chains[0]
    first, second = chain.turns
    assert (first.first_segment, first.end_segment) == (0, 1)
    assert (second.first_segment, second.end_segment) == (1, 3)
    assert tokens.unpack_ids(chain.segments[2].token_ids).tolist() == [7, 8, 9]
    assert second.time == script.events[8].time
    assert chain.closed_by == 2 and chain.prompt_len == 3 and chain.generated_len == 5
    assert state.turn_of(2) == (chain, second) and state.turn_of(3) is None


def test_released_state_holds_no_buffers():
    script = SessionScript()
    script.turn(0, [1, 2, 3], [4, 5], new_chain=True, key="k")
    released = release_buffers(fold(script.events))
    chain = released.chains[0]
    assert chain.prompt_ids == b"" and chain.segments == () and chain.turns[0].text == ""
    assert released.idempotency_keys == {} and released.request_bodies == {}
    assert chain.prompt_len == 3 and chain.generated_len == 2 and len(chain.turns) == 1


@st.composite
def scripts(draw: st.DrawFn) -> SessionScript:
    script = SessionScript()
    chains = 0
    for _ in range(draw(st.integers(1, 8))):
        step = draw(st.sampled_from(["new", "turn", "reward", "close"] if chains else ["new"]))
        context = draw(st.lists(st.integers(0, 1000), min_size=1, max_size=5))
        generated = draw(st.lists(st.integers(0, 1000), max_size=5))
        if step == "new":
            script.turn(chains, context, generated, new_chain=True)
            chains += 1
        elif step == "turn":
            script.turn(chains - 1, context, generated, n_messages=draw(st.integers(2, 20)))
        elif step == "reward":
            script.reward(draw(st.floats(-1, 1)), acc=1.0)
        else:
            script.close(chains - 1)
            script.turn(chains, context, generated, new_chain=True)
            chains += 1
    if draw(st.booleans()):
        script.finalize()
    return script


@settings(max_examples=60, deadline=None)
@given(scripts(), st.data())
def test_folding_on_from_a_released_state_summarizes_like_the_full_fold(script: SessionScript, data: st.DataObject):
    cut = data.draw(st.integers(1, len(script.events)))
    resumed = fold(script.events[cut:], release_buffers(fold(script.events[:cut])))
    full = fold(script.events)
    assert resumed is not None and full is not None
    assert summarize(resumed) == summarize(full)
    assert (resumed.reward, resumed.sampling, resumed.metadata) == (full.reward, full.sampling, full.metadata)
    assert [len(c.turns) for c in resumed.chains] == [len(c.turns) for c in full.chains]
