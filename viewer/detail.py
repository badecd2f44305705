"""One session as the session page draws it: chains (each with the fork it started with: its parent
and why, which the page draws as a tree) with their first token windows, turns, tool calls,
reasoning, reward, the audit trail (rollbacks, abandoned turns, engine failures, closes) and the
requests whose raw bodies can be asked for. Pure: built from a folded state and its events.

Everything is bounded: texts are cut at :data:`MAX_TEXT` characters (with a notice), a chain lists
at most :data:`MAX_TURNS` turns, the first :data:`TOKEN_CHAINS` chains carry a token window, and
the audit trail and the request list keep their last entries.
"""

from __future__ import annotations

from typing import Any

import msgspec

from schemas import tokens
from schemas.events import (
    ChainClosed,
    ContextAppended,
    EngineFailed,
    Event,
    ForkPoint,
    RequestReceived,
    RewardReported,
    SessionAborted,
    SessionFinalized,
    SessionQuarantined,
    TurnAbandoned,
    TurnRolledBack,
)
from session.fold import ChainState, SessionState
from session.summary import summarize
from session.views import chain_views
from viewer.pieces import Decode, TokenWindow, window

MAX_TEXT = 20000
MAX_TURNS = 500
TOKEN_CHAINS = 20
MAX_AUDIT = 1000
MAX_REQUESTS = 2000
AUDITED = (TurnRolledBack, TurnAbandoned, EngineFailed, ChainClosed, RewardReported, SessionFinalized,
           SessionAborted, SessionQuarantined)


class AuditEntry(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    time: float
    kind: str  # the event's type tag, e.g. "turn_rolled_back"
    chain: int | None
    request_no: int | None
    detail: str


class RequestEntry(msgspec.Struct, frozen=True, kw_only=True):
    request_no: int
    wire: str
    body_size: int
    time: float
    idempotency_key: str | None


class ToolCallView(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    name: str
    arguments: str


class TurnDetail(msgspec.Struct, frozen=True, kw_only=True):
    number: int
    request_no: int
    finish_reason: str
    time: float
    context_tokens: int
    sampled_tokens: int
    context_text: str | None  # the new messages rendered (tool results, user turns), as tokens decode
    text: str
    reasoning: str | None
    tool_calls: list[ToolCallView]
    weight_version: str | None


class ChainDetail(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    status: str
    materialization_reason: str | None
    prompt_len: int
    response_len: int
    sampled_len: int
    has_logprobs: bool
    mask_runs: list[tuple[int, int]]
    turns: list[TurnDetail]
    turns_omitted: int
    prompt: TokenWindow | None  # None past the first TOKEN_CHAINS chains: asked for on demand
    response: TokenWindow | None
    fork: ForkPoint | None = None  # its parent chain and the cause of the fork (None: the log did not record it)


class SessionDetail(msgspec.Struct, frozen=True, kw_only=True):
    summary: Any  # session.summary.SessionSummary
    status: str
    metadata: Any
    reward: Any  # the reward_reported the records use (reward, extra info, source), or None
    tokenizer: str
    decoded: bool  # whether token texts could be decoded (the session's tokenizer loaded)
    chains: list[ChainDetail]
    audit: list[AuditEntry]
    audit_omitted: int
    requests: list[RequestEntry]
    requests_omitted: int
    last_stream_seq: int


def bounded(text: str | None, limit: int = MAX_TEXT) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit} more characters not shown]"


def event_kind(event: Event) -> str:
    return str(type(event).__struct_config__.tag)


def audit_entry(event: Event) -> AuditEntry | None:
    """What the audit trail shows of an event; None for the events it leaves out (tokens, requests...)."""
    if isinstance(event, ContextAppended) and event.reserialized:
        return AuditEntry(seq=event.seq, time=event.time, kind="context_appended", chain=event.chain,
                          request_no=event.request_no,
                          detail=f"request {event.request_no} re-sent the chain's replies other than sampled "
                                 f"({event.reserialized}): the chain continued with its logged tokens "
                                 f"(continue_reserialized_turns)")
    if not isinstance(event, AUDITED):
        return None
    chain = getattr(event, "chain", None)
    request_no = getattr(event, "request_no", None)
    if isinstance(event, TurnRolledBack):
        detail = (f"request {event.request_no} rewrote the reply of request {event.turn_request_no}: "
                  f"{event.tokens_dropped} sampled tokens rolled back, the rewritten reply kept as context")
    elif isinstance(event, TurnAbandoned):
        detail = f"{event.reason}; {event.tokens_sampled} tokens had been sampled"
    elif isinstance(event, EngineFailed):
        detail = f"{event.error}: {event.message}"
    elif isinstance(event, RewardReported):
        extra = msgspec.json.encode(event.extra).decode() if event.extra else ""
        detail = f"reward {event.reward} from {event.source} {extra}".rstrip()
    elif isinstance(event, SessionQuarantined):
        detail = f"{event.stage}: {event.reason}"
    else:
        detail = str(getattr(event, "reason", ""))
    return AuditEntry(seq=event.seq, time=event.time, kind=event_kind(event), chain=chain, request_no=request_no,
                      detail=bounded(detail, 2000) or "")


def request_entry(event: RequestReceived) -> RequestEntry:
    return RequestEntry(request_no=event.request_no, wire=event.wire, body_size=event.body_size, time=event.time,
                        idempotency_key=event.idempotency_key)


def _turns(chain: ChainState, decode: Decode | None) -> list[TurnDetail]:
    details = []
    for number, turn in enumerate(chain.turns[:MAX_TURNS], 1):
        segments = chain.segments[turn.first_segment: turn.end_segment]
        context = b"".join(s.token_ids for s in segments if not s.generated)
        context_text = decode(tokens.unpack_ids(context).tolist()) if decode is not None and context else None
        details.append(TurnDetail(
            number=number, request_no=turn.request_no, finish_reason=turn.finish_reason, time=turn.time,
            context_tokens=tokens.count(context), sampled_tokens=sum(s.length for s in segments if s.generated),
            context_text=bounded(context_text), text=bounded(turn.text) or "", reasoning=bounded(turn.reasoning),
            tool_calls=[ToolCallView(id=c.id, name=c.name, arguments=bounded(c.arguments, 4000) or "")
                        for c in turn.tool_calls],
            weight_version=turn.weight_version))
    return details


def chain_detail(chain: ChainState, view: Any, decode: Decode | None, *, with_tokens: bool) -> ChainDetail:
    return ChainDetail(
        index=chain.index, status=view.status, materialization_reason=view.materialization_reason,
        prompt_len=chain.prompt_len, response_len=chain.response_len, sampled_len=chain.generated_len,
        has_logprobs=view.has_logprobs, mask_runs=view.mask_runs, turns=_turns(chain, decode),
        turns_omitted=max(0, len(chain.turns) - MAX_TURNS),
        prompt=window(chain, decode, part="prompt") if with_tokens else None,
        response=window(chain, decode, part="response") if with_tokens else None, fork=chain.fork)


def session_detail(state: SessionState, audit: list[AuditEntry], requests: list[RequestEntry],
                   decode: Decode | None, *, last_stream_seq: int) -> SessionDetail:
    views = chain_views(state)
    chains = [chain_detail(chain, view, decode, with_tokens=chain.index < TOKEN_CHAINS)
              for chain, view in zip(state.chains, views, strict=True)]
    return SessionDetail(
        summary=summarize(state), status=state.status, metadata=state.metadata, reward=state.reward,
        tokenizer=state.tokenizer, decoded=decode is not None, chains=chains,
        audit=audit[-MAX_AUDIT:], audit_omitted=max(0, len(audit) - MAX_AUDIT),
        requests=requests[-MAX_REQUESTS:], requests_omitted=max(0, len(requests) - MAX_REQUESTS),
        last_stream_seq=last_stream_seq)
