"""Rewards: intake from ``reward_info`` and the precedence task reward -> scorer -> 0."""

from reward.intake import PostedReward, parse_reward_info, reward_info_of
from reward.precedence import RewardDecision, decide_reward, resolve_reward
from reward.scorer import FunctionScorer, RewardLoopScorer, RewardScorer, ScoreRequest, ScoreResult, load_scorer

__all__ = [
    "FunctionScorer",
    "PostedReward",
    "RewardDecision",
    "RewardLoopScorer",
    "RewardScorer",
    "ScoreRequest",
    "ScoreResult",
    "decide_reward",
    "load_scorer",
    "parse_reward_info",
    "resolve_reward",
    "reward_info_of",
]
