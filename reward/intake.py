"""Reward intake: what a task posts to ``POST /sessions/{id}/reward_info``.

``{"reward_info": {"reward": 1.0, "acc": 1.0, "finished": true}}``:

- ``reward`` (a number, or absent/null when the task reports extra info only) is the
  task reward, the first in the precedence (task reward, then a reward scorer, then 0);
- ``finished`` (a bool, or absent/null) is a completion fact, not a metric: with
  ``mask_unfinished_episode`` an episode that says ``finished: false`` trains nothing;
- every other key is *reward extra info*, carried with each trajectory of the session
  (verl reads it as ``extra_fields["reward_extra_info"]``, e.g. for DAPO group filtering).

The log keeps the posted map as it came (``reward_reported``: ``reward`` apart, every other key
in ``extra``); :func:`reward_info_of` reads it as a typed :class:`schemas.events.RewardInfo`.

Every value must be one the log and the records can hold: an integer (the reward's, or any
inside the extra info) within 64 bits, nothing nested deeper than ``schemas.values.MAX_DEPTH``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.errors import MalformedRequest
from schemas.events import RewardInfo, RewardReported
from schemas.values import INT64_MAX, INT64_MIN, check_free_form

REWARD_KEY = "reward"
FINISHED_KEY = "finished"
NOT_EXTRA = frozenset({REWARD_KEY, FINISHED_KEY})


class PostedReward(msgspec.Struct, frozen=True, kw_only=True):
    """A validated ``reward_info``, as its ``reward_reported`` event holds it (typed: :func:`reward_info_of`)."""

    reward: float | None
    extra: dict[str, Any]  # every posted key but ``reward`` (``finished`` included, as posted)


def parse_reward_info(reward_info: dict[str, Any]) -> PostedReward:
    """Validate a posted ``reward_info``; raises :class:`MalformedRequest` (400) when it makes no sense."""
    reward = reward_info.get(REWARD_KEY)
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise MalformedRequest("reward_info.reward must be a number", param="reward_info.reward")
    if isinstance(reward, int) and not INT64_MIN <= reward <= INT64_MAX:
        raise MalformedRequest("reward_info.reward must be a float or an integer within 64 bits",
                               param="reward_info.reward")
    finished = reward_info.get(FINISHED_KEY)
    if finished is not None and not isinstance(finished, bool):
        raise MalformedRequest("reward_info.finished must be a bool or null", param="reward_info.finished")
    for key, value in reward_info.items():
        check_free_form(value, f"reward_info.{key}")
    extra = {k: v for k, v in reward_info.items() if k != REWARD_KEY}
    return PostedReward(reward=None if reward is None else float(reward), extra=extra)


def reward_info_of(posted: RewardReported | PostedReward | None) -> RewardInfo:
    """The typed reward info of a posted reward (none posted: nothing known). A ``finished`` that is not
    a bool (a log not written by the edge) is not known either; it is never reward extra info."""
    if posted is None:
        return RewardInfo()
    finished = posted.extra.get(FINISHED_KEY)
    reward = None if posted.reward is None else float(posted.reward)
    return RewardInfo(reward=reward, finished=finished if isinstance(finished, bool) else None,
                      extra={k: v for k, v in posted.extra.items() if k not in NOT_EXTRA})
