"""Which reward a session's trajectories carry: task reward, else a scorer's, else 0 with a warning.

Pure apart from the one awaited scorer call in :func:`resolve_reward`. The decision is
broadcast to every trajectory of the session (verl's agent loop does the same with the
score of its final output).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec

from reward.intake import reward_info_of
from reward.scorer import RewardScorer, ScoreResult
from schemas.events import RewardReported

log = logging.getLogger(__name__)

RewardSource = Literal["task", "scorer", "default"]


class RewardDecision(msgspec.Struct, frozen=True, kw_only=True):
    reward: float
    extra: dict[str, Any]  # reward extra info: posted keys but reward/finished, merged with the scorer's
    source: RewardSource
    unfinished: bool = False  # the task posted finished=false


def task_reward(posted: RewardReported | None) -> RewardDecision | None:
    """The task-posted reward, when the task posted a number."""
    info = reward_info_of(posted)
    if info.reward is None:
        return None
    return RewardDecision(reward=info.reward, extra=info.extra, source="task", unfinished=info.unfinished)


def scored_reward(posted: RewardReported | None, result: ScoreResult) -> RewardDecision:
    info = reward_info_of(posted)
    return RewardDecision(reward=float(result.reward), extra={**info.extra, **result.extra}, source="scorer",
                          unfinished=info.unfinished)


def default_reward(posted: RewardReported | None, session_id: str) -> RewardDecision:
    log.warning("session %s: no reward reported and no reward scorer; using 0.0", session_id)
    info = reward_info_of(posted)
    return RewardDecision(reward=0.0, extra=info.extra, source="default", unfinished=info.unfinished)


def decide_reward(posted: RewardReported | None, session_id: str) -> RewardDecision:
    """Without a scorer: the task reward, else 0 with a warning."""
    return task_reward(posted) or default_reward(posted, session_id)


async def resolve_reward(posted: RewardReported | None, session_id: str, scorer: RewardScorer | None,
                         score: Callable[[RewardScorer], Awaitable[ScoreResult]] | None) -> RewardDecision:
    """The precedence in full: task reward, then ``score(scorer)`` when there is a scorer, then 0."""
    decided = task_reward(posted)
    if decided is not None:
        return decided
    if scorer is not None and score is not None:
        return scored_reward(posted, await score(scorer))
    return default_reward(posted, session_id)
