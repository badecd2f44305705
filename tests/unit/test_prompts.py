"""Prompt status bookkeeping: running, then finished when any session succeeded (or, under
``all_success``, when all did), failure otherwise; attempts restart a prompt or are stale."""

import msgspec
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


def test_all_success_fails_a_prompt_with_one_failed_session_once_all_ended():
    def ended(rule, oks):
        progress = PromptProgress(uid="u", expected=len(oks), rule=rule)
        for index, ok in enumerate(oks):
            progress = progress.with_outcome(index, SessionOutcome(f"s{index}", ok))
        return progress

    assert ended("all_success", [True, False, True]).status == "failure"
    assert ended("all_success", [True, True, True]).status == "finished"
    assert ended("any_success", [True, False, True]).status == "finished"
    assert ended("any_success", [False, False]).status == ended("all_success", [False, False]).status == "failure"
    partial = PromptProgress(uid="u", expected=3, rule="all_success").with_outcome(0, SessionOutcome("s0", False))
    assert partial.status == "running"  # decided only once every expected session ended


def test_a_newer_attempt_starts_the_prompt_again_with_its_own_settings():
    old = PromptProgress(uid="u", expected=2, attempt=5, global_steps=3, published="running", publishing="finished",
                         outcomes={"0": SessionOutcome("s0", True), "1": SessionOutcome("s1", True)})
    fresh = PromptProgress(uid="u", expected=4, attempt=9, global_steps=7, rule="all_success", partition="val",
                           outcomes={"0": SessionOutcome("x", True)}, published="finished")
    restarted = old.for_attempt(fresh)
    assert restarted == PromptProgress(uid="u", expected=4, attempt=9, global_steps=7, rule="all_success",
                                       partition="val")  # nothing counted, nothing published: tagged running again
    assert restarted.to_publish() == "" and restarted.admits(0, "s0", 9) == "new"
    assert old.for_attempt(msgspec.structs.replace(fresh, attempt=5)) is old  # the same attempt: today's rules
    assert old.for_attempt(msgspec.structs.replace(fresh, attempt=2)) is old  # an older one changes nothing


def test_sessions_of_another_attempt_are_never_counted():
    progress = PromptProgress(uid="u", expected=2, attempt=5).with_outcome(0, SessionOutcome("s0", True), 5)
    assert progress.admits(1, "old", 4) == "stale" and progress.admits(0, "s0", 4) == "stale"
    assert progress.admits(1, "later", 6) == "newer"
    assert progress.with_outcome(1, SessionOutcome("old", True), 4) == progress
    assert progress.with_outcome(1, SessionOutcome("later", True), 6) == progress
    assert progress.with_outcome(1, SessionOutcome("s1", False), 5).status == "finished"
    assert PromptProgress(uid="u", expected=1).admits(0, "s", 0) == "new"  # no attempt anywhere: attempt 0


def test_progress_stored_before_attempts_existed_reads_as_attempt_0():
    legacy = b'{"uid":"u","expected":2,"global_steps":1,"outcomes":{"0":["s0",true]},"published":"running"}'
    progress = msgspec.json.decode(legacy, type=PromptProgress)
    assert (progress.attempt, progress.rule, progress.partition) == (0, "any_success", "")
    assert progress.admits(1, "s1") == "new"
