import pytest

from schemas import envelope, tokens
from schemas.errors import FoldError, OutOfOrderEvent
from schemas.events import ChainStarted, ForkPoint
from session.fold import apply, fold, release_buffers
from tests.helpers import SessionScript


def _two_turns() -> SessionScript:
    script = SessionScript()
    script.turn(0, [10, 11, 12], [20, 21], new_chain=True, logprobs=[-0.1, -0.2])
    script.turn(0, [30], [40, 41, 42], logprobs=[-0.3, -0.4, -0.5], n_messages=4, tip="tip2")
    return script


def test_fold_builds_chain_segments():
    state = fold(_two_turns().events)
    assert state is not None
    (chain,) = state.chains
    assert tokens.unpack_ids(chain.prompt_ids).tolist() == [10, 11, 12]
    assert [s.generated for s in chain.segments] == [True, False, True]
    assert chain.response_len == 6 and chain.generated_len == 5
    assert chain.token_ids() == [10, 11, 12, 20, 21, 30, 40, 41, 42]
    assert chain.last_token() == 42
    assert chain.tip_digest == "tip2" and chain.n_messages == 5
    assert len(chain.turns) == 2 and state.turns == 2 and state.requests == 2
    assert chain.turns[1].response_len_before == 2


def test_fold_is_idempotent_on_redelivery():
    events = _two_turns().events
    once = fold(events)
    twice = fold(events + events[3:], fold(events[:5]))
    assert once == twice


def test_out_of_order_event_raises_named_error():
    events = _two_turns().events
    state = fold(events[:3])
    with pytest.raises(OutOfOrderEvent):
        apply(state, events[4])


def test_log_must_start_with_opened():
    with pytest.raises(OutOfOrderEvent):
        apply(None, _two_turns().events[1])


def test_states_share_segments_between_versions():
    events = _two_turns().events
    before = fold(events[:5])
    after = fold(events[5:], before)
    assert before.chains[0].segments[0] is after.chains[0].segments[0]
    assert len(before.chains[0].segments) == 1  # the old state is untouched


def test_closed_chain_rejects_more_tokens():
    script = SessionScript()
    script.turn(0, [1], [2], new_chain=True)
    script.close(0)
    script.turn(0, [3], [4])
    with pytest.raises(FoldError, match="closed"):
        fold(script.events)


def test_finalized_session_rejects_turns_and_records_late_rewards_without_applying_them():
    script = SessionScript()
    script.turn(0, [1], [2], new_chain=True)
    script.finalize()
    script.reward(1.0)
    state = fold(script.events)
    assert state.status == "finalized" and state.reward is None and state.seq == len(script.events)
    script.turn(0, [3], [4])
    with pytest.raises(FoldError, match="finalized"):
        fold(script.events)


def test_logprob_count_must_match_token_count():
    script = SessionScript()
    script.turn(0, [1], [2, 3], new_chain=True, logprobs=[-1.0])
    with pytest.raises(FoldError, match="log probs"):
        fold(script.events)


def test_chain_numbers_must_be_consecutive():
    script = SessionScript()
    script.turn(1, [1], [2], new_chain=True)
    with pytest.raises(FoldError, match="expected 0"):
        fold(script.events)


def test_trajectory_chains_skip_chains_without_turns():
    script = SessionScript()
    script.turn(0, [1], [2], new_chain=True)
    script.turn(1, [5], [6], new_chain=True)
    state = fold(script.events)
    assert [c.index for c in state.trajectory_chains()] == [0, 1]


def test_rollback_drops_the_last_replys_sampled_tokens():
    script = SessionScript()
    script.turn(0, [10, 11, 12], [20, 21], new_chain=True)
    script.turn(0, [30, 31], [40, 41, 42], n_messages=4, tip="t2")
    script.roll_back(0, turn_request_no=2, dropped=3)
    script.turn(0, [50], [60], n_messages=6, tip="t3")  # the rewritten reply (context) and a new turn
    state = fold(script.events)
    (chain,) = state.chains
    assert chain.token_ids() == [10, 11, 12, 20, 21, 30, 31, 50, 60]
    assert [s.generated for s in chain.segments] == [True, False, False, True]
    assert [t.request_no for t in chain.turns] == [1, 3] and chain.generated_len == 3
    # user, reply 1, user, (reply 2 rolled back), rewritten reply 2 (context), reply 3
    assert chain.chat_turns == 5


def test_rollback_must_match_the_last_turn():
    script = SessionScript()
    script.turn(0, [1], [2], new_chain=True)
    script.turn(0, [3], [4, 5])
    script.roll_back(0, turn_request_no=2, dropped=1)
    with pytest.raises(FoldError, match="does not match"):
        fold(script.events)


def test_sibling_chains_share_their_prompt_buffer():
    script = SessionScript()
    script.turn(0, [1, 2, 3], [4], new_chain=True)
    script.turn(1, [1, 2, 3], [5], new_chain=True)
    script.turn(2, [1, 2, 9], [6], new_chain=True)
    first, sibling, other = fold(script.events).chains
    assert sibling.prompt_ids is first.prompt_ids and other.prompt_ids is not first.prompt_ids


def test_a_chain_keeps_its_fork_and_a_log_without_forks_folds_as_before():
    script = SessionScript()
    script.turn(0, [1, 2, 3], [4], new_chain=True)  # as written before forks were recorded
    fork = ForkPoint(cause="sibling", parent=0, message_index=2, token_offset=3)
    script.turn(1, [1, 2, 3], [5], new_chain=True, fork=fork)
    state = fold(script.events)
    assert state.chains[0].fork is None and state.chains[1].fork == fork
    old, new = (e for e in script.events if isinstance(e, ChainStarted))
    assert b"fork" not in envelope.encode([old])  # an old event re-encodes byte for byte
    assert envelope.decode(envelope.encode([old, new])) == [old, new]


def test_a_fork_from_a_chain_that_does_not_precede_it_is_refused():
    script = SessionScript()
    script.turn(0, [1], [2], new_chain=True, fork=ForkPoint(cause="sibling", parent=0))
    with pytest.raises(FoldError):
        fold(script.events)


def _with_rollback_and_sibling() -> SessionScript:
    script = SessionScript()
    script.turn(0, [10, 11, 12], [20, 21], new_chain=True)
    script.turn(0, [30, 31], [40, 41, 42], n_messages=4, tip="t2")
    script.roll_back(0, turn_request_no=2, dropped=3)
    script.turn(0, [50], [60], n_messages=6, tip="t3")
    script.turn(1, [10, 11, 12], [70], new_chain=True)
    script.turn(0, [80, 81], [90], n_messages=8, tip="t4")
    script.finalize()
    return script


@pytest.mark.parametrize("script", [_two_turns, _with_rollback_and_sibling])
def test_a_fold_resumed_on_a_released_state_equals_the_whole_fold_released(script):
    """The projector stores released states and folds the log's next events onto them after a restart: whatever
    event it stopped after, what it stores is what a fold of the whole log stores."""
    events = script().events
    whole = release_buffers(fold(events))
    for cut in range(1, len(events)):
        resumed = release_buffers(fold(events[cut:], release_buffers(fold(events[:cut]))))
        assert resumed == whole, f"resumed after event {cut} ({type(events[cut - 1]).__name__})"
