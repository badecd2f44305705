"""Chains -> training records. Pure: a folded session in, records out, no I/O.

Each chain with at least one sampled turn becomes one trajectory:
``prompts`` is the chain's rendered prompt, ``responses`` every token after it
(sampled tokens with mask 1, continuation tokens with mask 0), ``rm_scores`` zeros
with the reward on the last response token, ``rollout_log_probs`` the engine's log
probs on sampled tokens and 0 on continuation tokens (present only when every sampled
segment had them).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import numpy as np

from schemas import tokens
from schemas.records import TrajectoryRecord
from session_projector.fold import ChainState, Segment, SessionState

log = logging.getLogger(__name__)

# reward_info keys that are not reward extra info: the reward itself, and the completion fact.
_NOT_EXTRA = frozenset({"reward", "finished"})


class RecordOptions(msgspec.Struct, frozen=True, kw_only=True):
    mask_unfinished_episode: bool = False  # zero the loss mask when reward_info says finished=false


class RewardDecision(msgspec.Struct, frozen=True, kw_only=True):
    reward: float
    extra: dict[str, Any]
    source: str  # "task" | "scorer" | "default"


def session_reward(state: SessionState) -> RewardDecision:
    """The task-posted reward when there is one, else 0 with a warning."""
    posted = state.reward
    extra = dict(posted.extra) if posted is not None else {}
    if posted is not None and posted.reward is not None:
        return RewardDecision(reward=float(posted.reward), extra=extra, source="task")
    log.warning("session %s: no reward reported; using 0.0", state.session_id)
    return RewardDecision(reward=0.0, extra=extra, source="default")


def derive_records(
    state: SessionState,
    options: RecordOptions = RecordOptions(),
    reward: RewardDecision | None = None,
) -> list[TrajectoryRecord]:
    reward = reward if reward is not None else session_reward(state)
    return [
        _record(state, chain, index, reward, options)
        for index, chain in enumerate(state.trajectory_chains())
    ]


def _response_segments(chain: ChainState) -> tuple[Segment, ...]:
    """Segments up to the last sampled one: a trailing context never followed by a turn is dropped."""
    segments = chain.segments
    end = len(segments)
    while end and not segments[end - 1].generated:
        end -= 1
    return segments[:end]


def _arrays(segments: tuple[Segment, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Response ids, response mask and (when every sampled segment has them) log probs."""
    if not segments:
        return np.zeros(0, np.int32), np.zeros(0, np.int8), None
    responses = np.concatenate([tokens.unpack_ids(s.token_ids) for s in segments]).astype(np.int32)
    mask = np.concatenate([np.full(s.length, int(s.generated), dtype=np.int8) for s in segments])
    if any(s.generated and s.logprobs is None for s in segments):
        return responses, mask, None
    logprobs = np.concatenate(
        [tokens.unpack_logprobs(s.logprobs) if s.logprobs else np.zeros(s.length, np.float32) for s in segments]
    )
    return responses, mask, logprobs


def _record(
    state: SessionState,
    chain: ChainState,
    index: int,
    reward: RewardDecision,
    options: RecordOptions,
) -> TrajectoryRecord:
    responses, response_mask, logprobs = _arrays(_response_segments(chain))
    rm_scores = np.zeros(len(responses), dtype=np.float32)
    if len(rm_scores):
        rm_scores[-1] = reward.reward
    unfinished = options.mask_unfinished_episode and reward.extra.get("finished") is False
    loss_mask = np.zeros_like(response_mask) if unfinished else response_mask
    return TrajectoryRecord(
        key=f"{state.uid}_{state.session_index}_{index}",
        uid=state.uid,
        session_index=state.session_index,
        trajectory_index=index,
        session_id=state.session_id,
        agent_name=state.agent_name,
        status="success",
        global_steps=int(state.metadata.get("global_steps", 0) or 0),
        materialization_reason=chain.closed,
        prompts=tokens.unpack_ids(chain.prompt_ids).astype(np.int32),
        responses=responses,
        response_mask=loss_mask,
        loss_mask=loss_mask,
        rm_scores=rm_scores,
        rollout_log_probs=logprobs,
        num_turns=chain.chat_turns + 1,
        reward=reward.reward,
        reward_extra_info={k: v for k, v in reward.extra.items() if k not in _NOT_EXTRA},
    )
