"""Session summaries: what ``GET /sessions/{id}`` and ``rollbus sessions`` show.

A summary is derived from the fold state and holds no tokens, so it can be kept (and
stored in the projections bucket) long after a session's token buffers are released.
"""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.events import ForkPoint
from session.fold import SessionState


class ChainSummary(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    status: str  # "open" | "closed"
    turns: int
    prompt_len: int
    response_len: int
    generated_len: int
    materialization_reason: str | None = None
    fork: ForkPoint | None = None  # its parent and the cause of the fork (None: the log did not record it)


class SessionSummary(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    status: str
    uid: str
    session_index: int
    agent_name: str
    seq: int
    turns: int
    requests: int
    chains: list[ChainSummary]
    trajectories: int
    reward: float | None
    reward_info: dict[str, Any]
    close_reason: str | None
    opened_at: float
    updated_at: float
    quarantined: str | None = None  # why the materializer set it aside: none of its records are in the sinks
    forks: dict[str, int] = {}  # chains after the first, by the cause of their fork (as the log recorded it)


def summarize(state: SessionState) -> SessionSummary:
    chains = [
        ChainSummary(
            index=c.index,
            status="closed" if c.closed else "open",
            turns=len(c.turns),
            prompt_len=c.prompt_len,
            response_len=c.response_len,
            generated_len=c.generated_len,
            materialization_reason=c.closed,
            fork=c.fork,
        )
        for c in state.chains
    ]
    reward = state.reward
    return SessionSummary(
        session_id=state.session_id,
        status=state.status,
        uid=state.uid,
        session_index=state.session_index,
        agent_name=state.agent_name,
        seq=state.seq,
        turns=state.turns,
        requests=state.requests,
        chains=chains,
        trajectories=len(state.trajectory_chains()),
        reward=reward.reward if reward is not None else None,
        reward_info=dict(reward.extra) if reward is not None else {},
        close_reason=state.close_reason,
        opened_at=state.opened_at,
        updated_at=state.updated_at,
        quarantined=state.quarantined,
        forks=fork_counts(state),
    )


def fork_counts(state: SessionState) -> dict[str, int]:
    """The chains after the session's first, by the cause of their fork ("unrecorded" for a log without it)."""
    counts: dict[str, int] = {}
    for chain in state.chains[1:]:
        cause = chain.fork.cause if chain.fork is not None else "unrecorded"
        counts[cause] = counts.get(cause, 0) + 1
    return counts
