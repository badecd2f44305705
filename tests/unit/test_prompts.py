"""Prompt status bookkeeping: running, then finished when any session succeeded, failure when none did."""

from hypothesis import given
from hypothesis import strategies as st

from materializer.prompts import RANK, PromptProgress, SessionOutcome


def _after(expected, outcomes):
    progress = PromptProgress(uid="u", expected=expected)
    for index, ok in outcomes:
        progress = progress.with_outcome(index, SessionOutcome(f"s{index}", ok))
    return progress


def test_status_follows_the_sessions_that_ended():
    assert _after(3, []).status == "pending"
    assert _after(3, [(0, False)]).status == "running"
    assert _after(3, [(0, False), (1, False), (2, True)]).status == "finished"
    assert _after(3, [(0, False), (1, False), (2, False)]).status == "failure"


def test_counting_is_idempotent_and_duplicates_or_late_sessions_change_nothing():
    progress = _after(2, [(0, True)])
    assert progress.with_outcome(0, SessionOutcome("s0", True)) == progress
    assert progress.admits(0, "s0") == "known" and progress.admits(0, "other") == "duplicate"
    assert progress.with_outcome(0, SessionOutcome("other", False)) == progress
    full = progress.with_outcome(1, SessionOutcome("s1", False))
    assert full.admits(2, "s2") == "late" and full.with_outcome(2, SessionOutcome("s2", True)) == full


def test_to_publish_never_goes_back():
    progress = _after(2, [(0, True)])
    assert progress.to_publish() == "running"
    published = PromptProgress(uid="u", expected=2, outcomes=progress.outcomes, published="running")
    assert published.to_publish() == ""
    done = published.with_outcome(1, SessionOutcome("s1", False))
    assert done.to_publish() == "finished"
    import msgspec

    assert msgspec.structs.replace(done, published="finished").to_publish() == ""
    assert done.terminal_published is False


@given(expected=st.integers(1, 5), outcomes=st.lists(st.tuples(st.integers(0, 6), st.booleans()), max_size=12))
def test_status_rank_only_grows(expected, outcomes):
    progress = PromptProgress(uid="u", expected=expected)
    rank = RANK[progress.status]
    for index, ok in outcomes:
        progress = progress.with_outcome(index, SessionOutcome(f"s{index}", ok))
        assert RANK[progress.status] >= rank
        rank = RANK[progress.status]
    assert len(progress.outcomes) <= expected
