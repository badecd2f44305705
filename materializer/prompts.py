"""Prompt status, verl's GRPO group protocol: pure bookkeeping, no I/O.

A prompt (``uid``) expects ``expected`` sessions (verl's ``rollout.n``: the session's
``metadata["rollout_n"]``, else the materializer's ``--rollout-n``). Its status is a
function of the sessions that have *ended* (been materialized), which only grows, so the
status only moves forward::

    pending   (registered by whoever samples prompts, e.g. verl's trainer; rank 1)
    running   some sessions ended, fewer than expected                  (rank 2)
    finished  all expected sessions ended and at least one succeeded    (rank 3)
    failure   all expected sessions ended and none succeeded            (rank 3)

A session *succeeds* when it was finalized with at least one trajectory; an aborted
session, or one finalized without trajectories, fails. :class:`PromptProgress` also
records what was published to TransferQueue (``published``) and what is being published
(``publishing``), so a restart knows whether a terminal status may already be out.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PromptStatus = Literal["pending", "running", "finished", "failure"]
RANK: dict[str, int] = {"": 0, "pending": 1, "running": 2, "finished": 3, "failure": 3}
TERMINAL = frozenset({"finished", "failure"})


class SessionOutcome(msgspec.Struct, frozen=True, array_like=True):
    session_id: str
    succeeded: bool


class PromptProgress(msgspec.Struct, frozen=True, kw_only=True):
    uid: str
    expected: int
    global_steps: int = 0
    outcomes: dict[str, SessionOutcome] = {}  # str(session_index) -> the session that ended with that index
    published: str = ""  # the last status known to be in TransferQueue
    publishing: str = ""  # a status being written (set before the write, cleared into `published` after)

    @property
    def status(self) -> PromptStatus:
        if len(self.outcomes) < self.expected:
            return "running" if self.outcomes else "pending"
        return "finished" if any(o.succeeded for o in self.outcomes.values()) else "failure"

    @property
    def terminal_published(self) -> bool:
        return self.published in TERMINAL

    def admits(self, session_index: int, session_id: str) -> str:
        """``"new"``, ``"known"`` (this session already counted), ``"duplicate"`` (its index is another
        session's) or ``"late"`` (the prompt's terminal status is already out)."""
        had = self.outcomes.get(str(session_index))
        if had is not None:
            return "known" if had.session_id == session_id else "duplicate"
        return "late" if self.terminal_published or len(self.outcomes) >= self.expected else "new"

    def with_outcome(self, session_index: int, outcome: SessionOutcome) -> PromptProgress:
        """Count a session that ended (idempotent; a duplicate index or a late session changes nothing)."""
        if self.admits(session_index, outcome.session_id) != "new":
            return self
        return msgspec.structs.replace(self, outcomes={**self.outcomes, str(session_index): outcome})

    def to_publish(self) -> str:
        """The status to write now ("" when TransferQueue already has it, or a later one)."""
        status = self.status
        if status == "pending" or RANK[status] <= RANK[self.published]:
            return ""
        return status
