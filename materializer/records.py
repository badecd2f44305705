"""Chains -> training records. Pure: a folded session in, records out, no I/O.

Each chain with at least one completed turn becomes one trajectory: ``prompts`` is the
chain's rendered prompt, ``responses`` every token after it (sampled tokens with mask 1,
continuation tokens with mask 0), ``rm_scores`` zeros with the reward on the last
response token, ``rollout_log_probs`` the engine's log probs on sampled tokens and 0 on
continuation tokens (present only when every sampled segment had them), ``num_turns``
the user and assistant messages of the chain plus one (as verl counts them).

Options:

- ``mask_unfinished_episode``: a session whose task posted ``finished: false`` keeps its
  records but trains nothing (``response_mask`` and ``loss_mask`` all zero);
- ``trajectory_selection``: ``all`` chains, or only the ``longest`` (most sampled tokens,
  then most response tokens, then most turns, then the later chain). A selected record
  keeps its ``trajectory_index`` (its place among the session's trajectories), so keys
  mean the same thing under every configuration.

A session's metadata may override both (:func:`materializer.metadata.record_options`);
the marker records the options a session's records were derived with (:func:`rederive`).

``constrained_turns``: the chain's turns (0-based) that were sampled under a constraint (a
forced tool call or a JSON format): their log probs are the constrained distribution's.

Each record says where its chain forked from (the log's ``chain_started.fork``, see
:mod:`edge.forks`): ``parent_key`` (the parent chain's trajectory key, "" for a chain with no
parent), ``fork_message_index`` and ``fork_token_offset`` (the messages and the prompt tokens it
shares with the parent) and ``fork_cause``; a log written before forks were recorded leaves
``fork_cause`` "" (null in Parquet).

A session opened with an image processor gives each record its ``processor`` and its images (the
chain's, at their offsets in ``input_ids``); what the processor derives from them is added by
:mod:`materializer.vision`, which fetches the image bytes (this module stays pure).

``min_global_steps`` / ``max_global_steps`` span the weight versions of the chain's turns
(``"3"``, or ``"3..4"`` for a turn sampled across a weight update: :func:`version_span`);
without an integer version, both are the session's ``global_steps``.

The reward comes from :mod:`reward.precedence`: the task's, else a scorer's (the async
:func:`derive_scored`), else 0 with a warning.
"""

from __future__ import annotations

import logging
import re

import msgspec
import numpy as np

from reward.intake import reward_info_of
from reward.precedence import RewardDecision, decide_reward, resolve_reward
from reward.scorer import RewardScorer, ScoreRequest, ScoreResult
from schemas import tokens
from schemas.events import ImageRef
from schemas.metadata import RecordOptions, or_default, read_settings
from schemas.records import MaterializedMarker, TrajectoryRecord
from session.fold import ChainState, Segment, SessionState

log = logging.getLogger(__name__)

def session_reward(state: SessionState) -> RewardDecision:
    """The task-posted reward when there is one, else 0 with a warning (no scorer)."""
    return decide_reward(state.reward, state.session_id)


def derive_records(state: SessionState, options: RecordOptions = RecordOptions(),
                   reward: RewardDecision | None = None) -> list[TrajectoryRecord]:
    reward = reward if reward is not None else session_reward(state)
    keys = _trajectory_keys(state)
    return [_forked(_record(state, chain, index, reward, options), chain, keys)
            for index, chain in _selected(state, options)]


def _trajectory_keys(state: SessionState) -> dict[int, str]:
    """Chain index -> its trajectory key, for the chains that become trajectories."""
    return {chain.index: f"{state.uid}_{state.session_index}_{i}" for i, chain in enumerate(state.trajectory_chains())}


def _forked(record: TrajectoryRecord, chain: ChainState, keys: dict[int, str]) -> TrajectoryRecord:
    fork = chain.fork
    if fork is None:
        return record
    parent = keys.get(fork.parent, "") if fork.parent is not None else ""
    return msgspec.structs.replace(record, parent_key=parent, fork_message_index=fork.message_index,
                                   fork_token_offset=fork.token_offset, fork_cause=fork.cause)


async def derive_scored(state: SessionState, options: RecordOptions,
                        scorer: RewardScorer | None) -> tuple[list[TrajectoryRecord], RewardDecision]:
    """Records with the full reward precedence; the scorer sees the final trajectory (reward 0)."""

    async def score(with_scorer: RewardScorer) -> ScoreResult:
        draft = derive_records(state, options, _UNSCORED)
        return await with_scorer.score(score_request(state, draft[-1]))

    has_trajectories = bool(state.trajectory_chains())
    decision = await resolve_reward(state.reward, state.session_id, scorer, score if has_trajectories else None)
    return derive_records(state, options, decision), decision


_UNSCORED = RewardDecision(reward=0.0, extra={}, source="default")


def rederive(state: SessionState, marker: MaterializedMarker) -> list[TrajectoryRecord]:
    """The records a marker describes, derived again from the session (``rollbus replay --verify``):
    with the marker's options, and with its reward when a scorer decided it (a scorer is not rerun)."""
    options = marker.options
    reward = None
    if marker.reward_source == "scorer" and marker.reward is not None:
        reward = RewardDecision(reward=marker.reward, extra=dict(marker.reward_extra_info), source="scorer",
                                unfinished=reward_info_of(state.reward).unfinished)
    return derive_records(state, options, reward)


def score_request(state: SessionState, final: TrajectoryRecord) -> ScoreRequest:
    return ScoreRequest(session_id=state.session_id, uid=state.uid, session_index=state.session_index,
                        agent_name=state.agent_name, metadata=dict(state.metadata),
                        reward_info=reward_info_of(state.reward), trajectory=final)


def _selected(state: SessionState, options: RecordOptions) -> list[tuple[int, ChainState]]:
    chains = list(enumerate(state.trajectory_chains()))
    if options.trajectory_selection == "all" or len(chains) <= 1:
        return chains
    best = max(chains, key=lambda item: (item[1].generated_len, item[1].response_len, item[1].chat_turns, item[0]))
    return [best]


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


_VERSION_SPAN = re.compile(r"([0-9]+)(?:\.\.([0-9]+))?")


def version_span(weight_version: str | None) -> tuple[int, int] | None:
    """A turn's weight version as the steps it spans: ``"3"`` is (3, 3), ``"3..4"`` (a partial rollout
    resumed across a weight update, see :mod:`edge.engines.verl`) is (3, 4); anything else is None."""
    match = _VERSION_SPAN.fullmatch(weight_version) if weight_version else None
    if match is None:
        return None
    low, high = int(match[1]), int(match[2] or match[1])
    return min(low, high), max(low, high)


def _weight_steps(chain: ChainState, global_steps: int) -> tuple[int, int]:
    """The span of weight versions the chain was sampled with (integer versions only), else global_steps."""
    spans = [span for t in chain.turns if (span := version_span(t.weight_version)) is not None]
    if not spans:
        return global_steps, global_steps
    return min(low for low, _ in spans), max(high for _, high in spans)


def _global_steps(state: SessionState) -> int:
    """The session's ``global_steps`` setting (0 when absent or invalid: :mod:`materializer.metadata` warns)."""
    return or_default(read_settings(state.metadata)[0].global_steps, 0)


def _images(chain: ChainState, seq_len: int) -> tuple[ImageRef, ...]:
    """The chain's images inside the trajectory's tokens (a trailing context never followed by a turn is not)."""
    images = chain.images
    if images and images[-1].offset + images[-1].tokens > seq_len:
        return tuple(i for i in images if i.offset + i.tokens <= seq_len)
    return images


def _record(state: SessionState, chain: ChainState, index: int, reward: RewardDecision,
            options: RecordOptions) -> TrajectoryRecord:
    responses, response_mask, logprobs = _arrays(_response_segments(chain))
    rm_scores = np.zeros(len(responses), dtype=np.float32)
    if len(rm_scores):
        rm_scores[-1] = reward.reward
    loss_mask = np.zeros_like(response_mask) if options.mask_unfinished_episode and reward.unfinished else response_mask
    global_steps = _global_steps(state)
    low, high = _weight_steps(chain, global_steps)
    return TrajectoryRecord(
        key=f"{state.uid}_{state.session_index}_{index}",
        uid=state.uid,
        session_index=state.session_index,
        trajectory_index=index,
        session_id=state.session_id,
        agent_name=state.agent_name,
        status="success",
        global_steps=global_steps,
        materialization_reason=chain.closed,
        prompts=tokens.unpack_ids(chain.prompt_ids).astype(np.int32),
        responses=responses,
        response_mask=loss_mask,
        loss_mask=loss_mask,
        rm_scores=rm_scores,
        rollout_log_probs=logprobs,
        num_turns=chain.chat_turns + 1,
        reward=reward.reward,
        reward_extra_info=dict(reward.extra),
        reward_source=reward.source,
        min_global_steps=low,
        max_global_steps=high,
        metadata=dict(state.metadata),
        constrained_turns=tuple(i for i, turn in enumerate(chain.turns) if turn.constrained is not None),
        processor=state.processor,
        images=_images(chain, chain.prompt_len + len(responses)),
    )
