"""What a session's chains hold, for people: per chain and per turn, how many tokens are context
(mask 0) and sampled (mask 1), and the chain's tokens as plain lists. What ``rollbus replay`` shows
and what the viewer draws. Pure.
"""

from __future__ import annotations

import msgspec

from schemas import tokens
from session.fold import ChainState, SessionState


class TurnView(msgspec.Struct, frozen=True, kw_only=True):
    request_no: int
    finish_reason: str
    context_tokens: int  # mask 0: the new messages, rendered
    sampled_tokens: int  # mask 1: what the engine produced
    text: str
    tool_calls: list[str]  # tool names


class ChainView(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    status: str  # "open" | "closed"
    materialization_reason: str | None
    prompt_len: int
    response_len: int
    sampled_len: int
    turns: list[TurnView]
    mask_runs: list[tuple[int, int]]  # (mask value, run length) over the response
    has_logprobs: bool


def _turn_view(chain: ChainState, index: int) -> TurnView:
    turn = chain.turns[index]
    segments = chain.segments[turn.first_segment: turn.end_segment]
    return TurnView(request_no=turn.request_no, finish_reason=turn.finish_reason,
                    context_tokens=sum(s.length for s in segments if not s.generated),
                    sampled_tokens=sum(s.length for s in segments if s.generated),
                    text=turn.text, tool_calls=[c.name for c in turn.tool_calls])


def mask_runs(chain: ChainState) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for segment in chain.segments:
        value, length = int(segment.generated), segment.length
        if runs and runs[-1][0] == value:
            runs[-1] = (value, runs[-1][1] + length)
        elif length:
            runs.append((value, length))
    return runs


def chain_views(state: SessionState) -> list[ChainView]:
    return [
        ChainView(index=c.index, status="closed" if c.closed else "open", materialization_reason=c.closed,
                  prompt_len=c.prompt_len, response_len=c.response_len, sampled_len=c.generated_len,
                  turns=[_turn_view(c, i) for i in range(len(c.turns))], mask_runs=mask_runs(c),
                  has_logprobs=any(s.generated for s in c.segments)
                  and all(s.logprobs is not None for s in c.segments if s.generated))
        for c in state.chains
    ]


def chain_tokens(chain: ChainState) -> dict[str, list[int] | list[float] | None]:
    """The chain's prompt, response, mask and log probs (0 on context tokens), as plain lists."""
    response = b"".join(s.token_ids for s in chain.segments)
    mask = [int(s.generated) for s in chain.segments for _ in range(s.length)]
    logprobs: list[float] | None = None
    if all(s.logprobs is not None for s in chain.segments if s.generated):
        logprobs = []
        for s in chain.segments:
            logprobs += tokens.unpack_logprobs(s.logprobs).tolist() if s.logprobs else [0.0] * s.length
    return {"prompt_ids": tokens.unpack_ids(chain.prompt_ids).tolist(),
            "response_ids": tokens.unpack_ids(response).tolist(), "response_mask": mask,
            "rollout_log_probs": logprobs}
