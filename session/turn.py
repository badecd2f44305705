"""A turn decided, pure: its plan from the session state, and its events, numbered.

The edge's turn runner (:mod:`edge.turns`) is *load, decide, generate, append*:

1. **load** the live session's fold state (a :class:`SessionState`: a value, never changed while
   the turn is planned);
2. **decide**: :func:`session.chains.select_chain` picks the chain the request continues (or
   rewrites the last reply of, or none: a new chain); the edge encodes what is new (the chat
   template is the edge's) into :class:`TurnFacts`, and :func:`plan_turn` makes the
   :class:`TurnPlan`: the chain it extends or starts, the tokens it appends, how long the
   engine's input is, the reply it rolls back, where a new chain forks. :func:`refuses` says
   when there is no room left to sample;
3. **generate**: the engine samples (the edge's I/O);
4. **append**: from the session state as it is *then* (other chains' turns may have been
   appended meanwhile), :func:`turn_events` gives the turn's events (and
   :func:`refusal_events`, :func:`failure_events`, :func:`abandoned_events` those of a turn
   that did not sample), numbered consecutively from the state's last sequence
   (:mod:`session.numbering`); a new chain takes the next chain index. The edge calls
   them inside :meth:`edge.live.LiveSession.commit`, which applies them (the fold refuses a
   sequence that is not the next one) and appends.
"""

from __future__ import annotations

import msgspec

from schemas import tokens
from schemas.events import (
    BodyPart,
    ChainClosed,
    ChainStarted,
    ContextAppended,
    EngineFailed,
    Event,
    ForkPoint,
    ImageRef,
    RequestReceived,
    TokensGenerated,
    ToolCall,
    TurnAbandoned,
    TurnCompleted,
    TurnRolledBack,
)
from session.chains import Continue, NewChain, Rollback
from session.fold import ChainState, SessionState
from session.numbering import UNNUMBERED, next_seqs, numbered

CAPACITY = "max_trajectory_length"
"""Why a chain that has no room left is closed (its ``materialization_reason``)."""


class Received(msgspec.Struct, frozen=True, kw_only=True):
    """The request as it arrived: its ``request_received`` event, once numbered."""

    request_no: int
    wire: str
    parts: tuple[BodyPart, ...]  # its body, against an earlier request's (schemas/bodies.py)
    body_size: int
    body_digest: str
    idempotency_key: str | None = None
    time: float

    def event(self, session_id: str, seq: int = UNNUMBERED) -> RequestReceived:
        return RequestReceived(session_id=session_id, seq=seq, time=self.time, request_no=self.request_no,
                               wire=self.wire, parts=self.parts, body_size=self.body_size,
                               idempotency_key=self.idempotency_key, body_digest=self.body_digest)


class TurnFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What the edge decoded and encoded of a request, for the chain it selected."""

    request_no: int
    context: bytes  # the tokens it appends (packed): a new chain's whole prompt, else the increment
    n_messages: int  # the request's messages
    chat_turns: int  # user and assistant messages among those it appends
    prefix_digest: str  # the digest of its whole message history (tools included)
    fork: ForkPoint | None = None  # a new chain's parent and cause (edge.forks), its token offset not yet known
    reserialized: str | None = None  # a chain continued despite re-sent replies, for this cause (edge.forks)
    images: tuple[ImageRef, ...] = ()  # the images in ``context`` (offsets into it)


class TurnPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What a turn appends before its reply, and where: decided before the engine samples."""

    request_no: int
    chain: int | None  # the chain it extends; None: it starts one
    context: bytes  # new tokens, packed: the whole prompt of a new chain, else the increment
    input_length: int  # the tokens the engine sees: the chain's (less a rolled-back reply's), then ``context``
    n_messages: int
    chat_turns: int
    prefix_digest: str
    rollback: tuple[int, int] | None = None  # (request whose turn is rolled back, sampled tokens dropped)
    fork: ForkPoint | None = None  # a new chain's parent and cause, with the tokens it shares with the parent
    reserialized: str | None = None
    images: tuple[ImageRef, ...] = ()  # the images in ``context`` (offsets into it)


class Sampled(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine sampled and the reply read from it."""

    token_ids: bytes  # packed
    logprobs: bytes | None = None  # packed
    finish_reason: str  # the engine's
    text: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tip_digest: str  # the history digest with this reply
    weight_version: str | None = None
    constrained: str | None = None  # the constraint's label, if it was sampled under one


def rolled_back(chain: ChainState) -> tuple[int, int]:
    """The chain's last turn, were its reply rolled back: its request, and the sampled tokens dropped."""
    turn = chain.turns[-1]
    return turn.request_no, sum(s.length for s in chain.segments[turn.first_segment: turn.end_segment] if s.generated)


def kept_ids(chain: ChainState) -> bytes:
    """The chain without its last reply's sampled tokens (packed): it ends at that reply's generation prompt."""
    return b"".join(_kept(chain))


def _kept(chain: ChainState) -> list[bytes]:
    turn = chain.turns[-1]
    own = chain.segments[turn.first_segment: turn.end_segment]
    return [chain.prompt_ids, *(s.token_ids for s in chain.segments[: turn.first_segment]),
            *(s.token_ids for s in own if not s.generated)]


def plan_turn(state: SessionState, selection: Continue | Rollback | NewChain, facts: TurnFacts) -> TurnPlan:
    """The turn ``facts`` describe, on the chain ``selection`` names (``state``: the session now)."""
    common = {"request_no": facts.request_no, "context": facts.context, "n_messages": facts.n_messages,
              "chat_turns": facts.chat_turns, "prefix_digest": facts.prefix_digest, "images": facts.images}
    new = tokens.count(facts.context)
    if isinstance(selection, NewChain):
        return TurnPlan(chain=None, input_length=new, fork=_forked(state, facts.fork, facts.context), **common)
    chain = selection.chain
    if isinstance(selection, Rollback):
        undone = rolled_back(chain)
        return TurnPlan(chain=chain.index, input_length=chain.length - undone[1] + new, rollback=undone, **common)
    return TurnPlan(chain=chain.index, input_length=chain.length + new, reserialized=facts.reserialized, **common)


def _forked(state: SessionState, fork: ForkPoint | None, prompt: bytes) -> ForkPoint | None:
    """``fork`` with the tokens the new chain's prompt shares with its parent's."""
    if fork is None or fork.parent is None:
        return fork
    shared = tokens.common_prefix(prompt, state.chain(fork.parent).packed_ids())
    return msgspec.structs.replace(fork, token_offset=shared)


def engine_ids(state: SessionState, plan: TurnPlan) -> bytes:
    """Everything the engine sees for ``plan`` (packed): the chain's tokens (less a rolled-back reply's), then its
    context. (The edge grows a long chain's in place instead: :mod:`edge.engine_input`.)"""
    if plan.chain is None:
        return plan.context
    chain = state.chain(plan.chain)
    held = _kept(chain) if plan.rollback is not None else [chain.prompt_ids, *(s.token_ids for s in chain.segments)]
    return b"".join([*held, plan.context])  # one copy


def refuses(plan: TurnPlan, limit: int) -> bool:
    """No room left to sample: the engine's input alone reaches the trajectory length."""
    return plan.input_length >= limit


def fills(plan: TurnPlan, sampled: int, limit: int) -> bool:
    """The turn, with ``sampled`` tokens, leaves its chain no room: it closes it."""
    return plan.input_length + sampled >= limit


def refusal_events(state: SessionState, received: Received, closing: int | None) -> tuple[Event, ...]:
    """A request refused for want of room: recorded, and the chain it would extend (``closing``) closed."""
    events: list[Event] = [received.event(state.session_id)]
    if closing is not None:
        events.append(ChainClosed(session_id=state.session_id, seq=UNNUMBERED, time=received.time, chain=closing,
                                  reason=CAPACITY, request_no=received.request_no))
    return numbered(events, state.seq)


def turn_events(state: SessionState, plan: TurnPlan, received: Received, sampled: Sampled, *, limit: int,
                time: float) -> tuple[Event, ...]:
    """The turn's events after ``state``: the request, the rollback, the context, the sampled tokens, the reply,
    and the chain's closing when the turn leaves it no room (:func:`fills`)."""
    sid, request_no = state.session_id, plan.request_no
    chain = plan.chain if plan.chain is not None else len(state.chains)
    seq = next_seqs(state.seq)  # built numbered: a copy of each event to number it cost a turn 5 us
    events: list[Event] = [received.event(sid, next(seq))]
    if plan.rollback is not None:
        events.append(TurnRolledBack(turn_request_no=plan.rollback[0], tokens_dropped=plan.rollback[1],
                                     session_id=sid, seq=next(seq), time=time, chain=chain, request_no=request_no))
    images = plan.images or msgspec.UNSET
    if plan.chain is None:
        events.append(ChainStarted(prompt_ids=plan.context, fork=plan.fork or msgspec.UNSET,
                                   prefix_digest=plan.prefix_digest, n_messages=plan.n_messages,
                                   chat_turns=plan.chat_turns, images=images,
                                   session_id=sid, seq=next(seq), time=time, chain=chain, request_no=request_no))
    else:
        events.append(ContextAppended(token_ids=plan.context, reserialized=plan.reserialized or msgspec.UNSET,
                                      prefix_digest=plan.prefix_digest, n_messages=plan.n_messages,
                                      chat_turns=plan.chat_turns, images=images,
                                      session_id=sid, seq=next(seq), time=time, chain=chain, request_no=request_no))
    events.append(TokensGenerated(token_ids=sampled.token_ids, logprobs=sampled.logprobs,
                                  session_id=sid, seq=next(seq), time=time, chain=chain, request_no=request_no))
    events.append(TurnCompleted(finish_reason=sampled.finish_reason, text=sampled.text, reasoning=sampled.reasoning,
                                tool_calls=sampled.tool_calls, tip_digest=sampled.tip_digest,
                                n_messages=plan.n_messages + 1, weight_version=sampled.weight_version,
                                constrained=msgspec.UNSET if sampled.constrained is None else sampled.constrained,
                                session_id=sid, seq=next(seq), time=time, chain=chain, request_no=request_no))
    if fills(plan, tokens.count(sampled.token_ids), limit):
        events.append(ChainClosed(reason=CAPACITY, session_id=sid, seq=next(seq), time=time, chain=chain,
                                  request_no=request_no))
    return tuple(events)


def failure_events(state: SessionState, received: Received, chain: int | None, *, error: str, message: str,
                   time: float) -> tuple[Event, ...]:
    """A turn whose engine call failed: the request and the failure (its chain is left as it was)."""
    failed = EngineFailed(session_id=state.session_id, seq=UNNUMBERED, time=time, request_no=received.request_no,
                          chain=chain, error=error, message=message)
    return numbered((received.event(state.session_id), failed), state.seq)


def abandoned_events(state: SessionState, received: Received, chain: int | None, *, reason: str,
                     tokens_sampled: int, time: float) -> tuple[Event, ...]:
    """A turn given up before its end (its client left): the request and why (its chain is left as it was)."""
    abandoned = TurnAbandoned(session_id=state.session_id, seq=UNNUMBERED, time=time, request_no=received.request_no,
                              chain=chain, reason=reason, tokens_sampled=tokens_sampled)
    return numbered((received.event(state.session_id), abandoned), state.seq)
