"""Prompt status, verl's GRPO group protocol: pure bookkeeping, no I/O.

A prompt (``uid``) expects ``expected`` sessions (verl's ``rollout.n``: the session's
``metadata["rollout_n"]``, else the materializer's ``--rollout-n``). Its status is a
function of the sessions that have *ended* (been materialized), which only grows, so the
status only moves forward::

    pending   (registered by whoever samples prompts, e.g. verl's trainer; rank 1)
    running   some sessions ended, fewer than expected                  (rank 2)
    finished  all expected sessions ended, and the rule says success    (rank 3)
    failure   all expected sessions ended, and the rule says failure    (rank 3)

A session *succeeds* when it was finalized with at least one trajectory; an aborted
session, or one finalized without trajectories, fails. The ``rule`` (the session's
``metadata["prompt_status_rule"]``) decides once every expected session ended:
``any_success`` (the default) finishes a prompt when any session succeeded,
``all_success`` (verl's own stricter rule) fails it when any session failed.

**Attempts.** A prompt may be dispatched more than once (``metadata["attempt"]``, 0 when
absent): verl's resume path re-issues a uid left pending or running. The progress belongs
to one attempt. A session of a newer attempt starts the prompt again
(:meth:`PromptProgress.for_attempt`: no outcomes, nothing published, the new attempt's
expected count, steps, partition and rule); a session of an older one is ``stale``: it is
never counted and its records never reach TransferQueue.

:class:`PromptProgress` also records what was published to TransferQueue (``published``)
and what is being published (``publishing``), so a restart knows whether a terminal
status may already be out, and in which ``partition`` (``""``: the sink's own).
"""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.metadata import StatusRule

PromptStatus = Literal["pending", "running", "finished", "failure"]
# "newer": a session of a later attempt than the progress's; the caller starts the prompt again first (for_attempt)
Admission = Literal["new", "known", "duplicate", "late", "stale", "newer"]
RANK: dict[str, int] = {"": 0, "pending": 1, "running": 2, "finished": 3, "failure": 3}
TERMINAL = frozenset({"finished", "failure"})


class SessionOutcome(msgspec.Struct, frozen=True, array_like=True):
    session_id: str
    succeeded: bool


class PromptProgress(msgspec.Struct, frozen=True, kw_only=True):
    uid: str
    expected: int
    global_steps: int = 0
    attempt: int = 0  # the dispatch attempt these outcomes belong to
    rule: StatusRule = "any_success"
    partition: str = ""  # the TransferQueue partition of the prompt's key and trajectories ("": the sink's)
    outcomes: dict[str, SessionOutcome] = {}  # str(session_index) -> the session that ended with that index
    published: str = ""  # the last status known to be in TransferQueue
    publishing: str = ""  # a status being written (set before the write, cleared into `published` after)

    @property
    def status(self) -> PromptStatus:
        if len(self.outcomes) < self.expected:
            return "running" if self.outcomes else "pending"
        succeeded = [o.succeeded for o in self.outcomes.values()]
        success = all(succeeded) if self.rule == "all_success" else any(succeeded)
        return "finished" if success else "failure"

    @property
    def terminal_published(self) -> bool:
        return self.published in TERMINAL

    def for_attempt(self, fresh: PromptProgress) -> PromptProgress:
        """The progress a session whose own progress would be ``fresh`` counts into: this one when ``fresh``
        is of the same or an older attempt, else ``fresh`` with no outcomes and nothing published."""
        if fresh.attempt <= self.attempt:
            return self
        return msgspec.structs.replace(fresh, outcomes={}, published="", publishing="")

    def admits(self, session_index: int, session_id: str, attempt: int = 0) -> Admission:
        """``"new"``, ``"known"`` (this session already counted), ``"duplicate"`` (its index is another
        session's), ``"late"`` (the prompt's terminal status is already out), ``"stale"`` (an older attempt)
        or ``"newer"`` (a later attempt: see :meth:`for_attempt`)."""
        if attempt != self.attempt:
            return "stale" if attempt < self.attempt else "newer"
        had = self.outcomes.get(str(session_index))
        if had is not None:
            return "known" if had.session_id == session_id else "duplicate"
        return "late" if self.terminal_published or len(self.outcomes) >= self.expected else "new"

    def with_outcome(self, session_index: int, outcome: SessionOutcome, attempt: int = 0) -> PromptProgress:
        """Count a session that ended (idempotent; only a ``"new"`` session changes anything)."""
        if self.admits(session_index, outcome.session_id, attempt) != "new":
            return self
        return msgspec.structs.replace(self, outcomes={**self.outcomes, str(session_index): outcome})

    def to_publish(self) -> str:
        """The status to write now ("" when TransferQueue already has it, or a later one)."""
        status = self.status
        if status == "pending" or RANK[status] <= RANK[self.published]:
            return ""
        return status
