"""Replay: sessions rebuilt from the log alone, one or all of them, and what their chains hold.

:func:`replay_all` reads the whole stream once, in order, folding every session as its
envelopes come (memory: the sessions open at that point of the log), and yields each
session when it closes, then the ones still open at the end. A session whose events do
not fold (a corrupt log) is reported once with its error and skipped from then on.

:func:`chain_views` says, per chain and per turn, how many tokens are context (mask 0)
and sampled (mask 1): what ``rollbus replay`` shows. Pure.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from nats.js.client import JetStreamContext

from schemas import tokens
from schemas.bodies import Bodies
from schemas.errors import FoldError
from schemas.events import AnyEvent, RequestReceived
from schemas.log import LogConfig
from session_projector.fold import ChainState, SessionState, fold
from session_projector.reader import iter_envelopes, last_stream_seq


class Replayed(msgspec.Struct, frozen=True):
    session_id: str
    state: SessionState | None  # None: the session's events do not fold (see error)
    error: str | None = None
    bad_bodies: tuple[int, ...] = ()  # requests whose body, rebuilt from the log, does not have its digest


class ReplayStats(msgspec.Struct, kw_only=True):
    envelopes: int = 0
    events: int = 0
    last_stream_seq: int = 0


async def replay_all(js: JetStreamContext, cfg: LogConfig, stats: ReplayStats | None = None, *,
                     check_bodies: bool = False) -> AsyncIterator[Replayed]:
    """Every session of the log, folded from the log alone; closed ones as soon as they close.

    ``check_bodies``: also rebuild every raw request body (:mod:`schemas.bodies`) and check it
    against its recorded digest (this hashes every body: the cost of the bodies themselves)."""
    stats = stats if stats is not None else ReplayStats()
    stats.last_stream_seq = await last_stream_seq(js, cfg, cfg.subjects)
    states: dict[str, SessionState | None] = {}
    rebuilt: dict[str, Bodies] = {}
    bad: dict[str, list[int]] = {}
    broken: set[str] = set()
    async for _, events in iter_envelopes(js, cfg, cfg.subjects, stats.last_stream_seq):
        stats.envelopes += 1
        stats.events += len(events)
        session_id = events[0].session_id
        if session_id in broken:
            continue
        try:
            state = fold(events, states.get(session_id))
            if check_bodies:
                _check_bodies(events, rebuilt.setdefault(session_id, Bodies()), bad.setdefault(session_id, []))
        except FoldError as exc:
            broken.add(session_id)
            states.pop(session_id, None)
            rebuilt.pop(session_id, None)
            bad.pop(session_id, None)
            yield Replayed(session_id, None, str(exc))
            continue
        if state is not None and state.status != "open":
            states.pop(session_id, None)
            rebuilt.pop(session_id, None)
            yield Replayed(session_id, state, bad_bodies=tuple(bad.pop(session_id, ())))
        else:
            states[session_id] = state
    for session_id, state in states.items():
        yield Replayed(session_id, state, bad_bodies=tuple(bad.pop(session_id, ())))


def _check_bodies(events: list[AnyEvent], bodies: Bodies, bad: list[int]) -> None:
    for event in events:
        if type(event) is RequestReceived:
            bodies.add(event)
            if not bodies.verify(event.request_no):
                bad.append(event.request_no)


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
