"""The session fold: ``apply(state, event) -> state``, pure and total.

One function, several callers: the edge applies it to the events it has just had
acknowledged (its live state), the projector and ``rollbus replay`` apply it to the
log, the materializer applies it before deriving records. They cannot disagree.

States are frozen. A chain keeps its tokens as a tuple of immutable packed segments, so
a new state shares every segment of the old one (appending a turn copies a tuple of
references, never the tokens) and chains that start from the same prompt share it.

A chain keeps its images (:class:`schemas.events.ImageRef`) in order, each at its *absolute* offset
in the chain's tokens (prompt first, then response): an image of a ``context_appended`` is at its
offset in the event's tokens plus the tokens the chain had before it. A chain that forks from a
parent and repeats its first ``token_offset`` tokens holds the parent's images inside that prefix
(the new chain's prompt holds their placeholders too), and its own event's images where both name
one offset. A rollback drops only sampled tokens, which hold no image: the images stay where they are.

The state also indexes the session's requests by ``Idempotency-Key`` and by body digest,
so a retried request can be answered with the turn already recorded for it.

:func:`release_buffers` drops what only the edge and the materializer need (token
buffers, reply texts, the request index) and keeps every counter and status: the fold
goes on from a released state, and :func:`session.summary.summarize` of it is
the summary of the full state. That is what the projector stores per session.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter
from typing import Literal

import msgspec

from schemas import tokens
from schemas.errors import FoldError, OutOfOrderEvent
from schemas.events import (
    ChainClosed,
    ChainStarted,
    ContextAppended,
    EngineFailed,
    Event,
    ForkPoint,
    ImageRef,
    RequestReceived,
    RewardReported,
    SamplingDefaults,
    SessionAborted,
    SessionFinalized,
    SessionOpened,
    SessionQuarantined,
    TokensGenerated,
    TurnAbandoned,
    TurnCompleted,
    TurnRolledBack,
)

SessionStatus = Literal["open", "finalized", "aborted"]


class Segment(msgspec.Struct, frozen=True, array_like=True):
    """A run of response-side tokens: sampled (mask 1, with log probs) or context (mask 0)."""

    token_ids: bytes
    generated: bool
    logprobs: bytes | None = None

    @property
    def length(self) -> int:
        return tokens.count(self.token_ids)


class RecordedRequest(msgspec.Struct, frozen=True, array_like=True):
    """A request as the idempotency index knows it."""

    request_no: int
    body_digest: str


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """What a completed assistant turn left on its chain (enough to answer, again, and to roll back)."""

    request_no: int
    finish_reason: str
    text: str
    reasoning: str | None
    tool_calls: tuple
    prefix_digest: str  # history digest before the reply
    n_prefix_messages: int
    response_len_before: int  # response length before this turn's context and tokens
    weight_version: str | None
    time: float = 0.0  # when the turn completed
    first_segment: int = 0  # the chain's segments[first_segment:end_segment] are this turn's
    end_segment: int = 0
    constrained: str | None = None  # sampled under this constraint (TurnCompleted.constrained)


_TOKEN_IDS = attrgetter("token_ids")


class ChainState(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    prompt_ids: bytes
    prompt_len: int = 0
    segments: tuple[Segment, ...] = ()
    response_len: int = 0
    generated_len: int = 0  # sampled tokens (mask 1) among the response's
    n_messages: int = 0
    chat_turns: int = 0
    tip_digest: str = ""  # history digest at the chain's tip: "" until its first reply
    turns: tuple[Turn, ...] = ()
    pending_request: int | None = None  # a request whose context was appended, reply not yet
    pending_prefix: str = ""
    pending_prefix_messages: int = 0
    pending_response_len: int = 0
    pending_segment: int = 0  # where the pending request's segments start
    closed: str | None = None  # materialization reason once closed
    closed_by: int | None = None  # the request whose turn closed it, if one did
    fork: ForkPoint | None = None  # its parent and why it started (None: a log written before forks were)
    images: tuple[ImageRef, ...] = ()  # its images in order, ``offset`` absolute in prompt + response tokens

    @property
    def length(self) -> int:
        return self.prompt_len + self.response_len

    def last_token(self) -> int:
        """The chain's last token id (its last sampled token, once it has a turn)."""
        last = self.segments[-1].token_ids if self.segments else self.prompt_ids
        return tokens.last_id(last) if last else -1

    def packed_ids(self) -> bytes:
        """Prompt and response tokens, packed (what the engine must see next)."""
        return b"".join([self.prompt_ids, *map(_TOKEN_IDS, self.segments)])

    def token_ids(self) -> list[int]:
        """Prompt and response tokens as a list."""
        return tokens.unpack_ids(self.packed_ids()).tolist()


class SessionState(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    seq: int
    opened_at: float
    updated_at: float
    uid: str
    session_index: int
    agent_name: str
    metadata: dict
    sampling: SamplingDefaults
    api_key_digest: str
    max_trajectory_length: int
    tokenizer: str
    tool_format: str
    processor: str | None = None  # the image processor the session was opened with (None: text only)
    status: SessionStatus = "open"
    chains: tuple[ChainState, ...] = ()
    requests: int = 0  # highest request number recorded
    reward: RewardReported | None = None
    close_reason: str | None = None
    quarantined: str | None = None  # why the materializer set the ended session aside (session_quarantined)
    idempotency_keys: dict[str, RecordedRequest] = {}  # Idempotency-Key -> latest request carrying it
    request_bodies: dict[str, int] = {}  # body digest -> latest request number with that body

    @property
    def turns(self) -> int:
        return sum(len(c.turns) for c in self.chains)

    def trajectory_chains(self) -> list[ChainState]:
        """Chains that become trajectories: those with at least one completed turn, in order."""
        return [chain for chain in self.chains if chain.turns]

    def chain(self, index: int) -> ChainState:
        if not 0 <= index < len(self.chains):
            raise FoldError(f"session {self.session_id}: no chain {index}")
        return self.chains[index]

    def turn_of(self, request_no: int) -> tuple[ChainState, Turn] | None:
        """The chain and turn a request completed, if it completed one."""
        for chain in self.chains:
            for turn in chain.turns:
                if turn.request_no == request_no:
                    return chain, turn
        return None


def apply(state: SessionState | None, event: Event) -> SessionState:
    """The next state. Raises :class:`OutOfOrderEvent` unless ``event.seq`` is the next one."""
    if state is None:
        if not isinstance(event, SessionOpened) or event.seq != 1:
            raise OutOfOrderEvent(f"session {event.session_id}: the log must start with session_opened #1")
        return _opened(event)
    if event.seq != state.seq + 1:
        raise OutOfOrderEvent(f"session {state.session_id}: expected event #{state.seq + 1}, got #{event.seq}")
    if event.session_id != state.session_id:
        raise FoldError(f"event of session {event.session_id} applied to {state.session_id}")
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise FoldError(f"no fold rule for {type(event).__name__}")
    return handler(state, event)


def fold(events: Iterable[Event], state: SessionState | None = None) -> SessionState | None:
    """Apply events in order, skipping those already applied (idempotent on redelivery)."""
    for event in events:
        if state is not None and event.seq <= state.seq:
            continue
        state = apply(state, event)
    return state


def release_buffers(state: SessionState) -> SessionState:
    """The state without token buffers, images, reply texts or request index; counters and statuses kept. With
    no segments, no index into them either (a turn's, the pending request's): they would count from the release,
    so a fold resumed on a released state would store other numbers than a fold of the whole log."""
    chains = tuple(
        msgspec.structs.replace(c, prompt_ids=b"", segments=(), images=(), pending_segment=0,
                                turns=tuple(_bare(t) for t in c.turns))
        for c in state.chains
    )
    return msgspec.structs.replace(state, chains=chains, idempotency_keys={}, request_bodies={})


def _bare(turn: Turn) -> Turn:
    return msgspec.structs.replace(turn, text="", reasoning=None, tool_calls=(), first_segment=0, end_segment=0)


def _opened(e: SessionOpened) -> SessionState:
    return SessionState(
        session_id=e.session_id,
        seq=e.seq,
        opened_at=e.time,
        updated_at=e.time,
        uid=e.uid,
        session_index=e.session_index,
        agent_name=e.agent_name,
        metadata=e.metadata,
        sampling=e.sampling,
        api_key_digest=e.api_key_digest,
        max_trajectory_length=e.max_trajectory_length,
        tokenizer=e.tokenizer,
        tool_format=e.tool_format,
        processor=None if e.processor is msgspec.UNSET else e.processor,
    )


def _touch(state: SessionState, e: Event, **changes: object) -> SessionState:
    return msgspec.structs.replace(state, seq=e.seq, updated_at=e.time, **changes)


def _replace_chain(state: SessionState, e: Event, chain: ChainState) -> SessionState:
    chains = state.chains
    index = chain.index
    return msgspec.structs.replace(state, seq=e.seq, updated_at=e.time,
                                   chains=(*chains[:index], chain, *chains[index + 1:]))


def _open_chain(state: SessionState, e: Event, index: int) -> ChainState:
    """Chain ``index`` of an open session, itself open (the rule of the events that extend a chain)."""
    if state.status != "open":
        _require_open(state, e)
    chain = state.chain(index)
    if chain.closed is not None:
        raise FoldError(f"session {state.session_id}: chain {index} is closed ({chain.closed})")
    return chain


def _require_open(state: SessionState, e: Event) -> None:
    if state.status != "open":
        raise FoldError(f"session {state.session_id} is {state.status}; {type(e).__name__} does not apply")


def _request(state: SessionState, e: RequestReceived) -> SessionState:
    _require_open(state, e)
    digest = e.body_digest
    keys = state.idempotency_keys
    if e.idempotency_key is not None:
        keys = {**keys, e.idempotency_key: RecordedRequest(request_no=e.request_no, body_digest=digest)}
    return msgspec.structs.replace(state, seq=e.seq, updated_at=e.time, requests=max(state.requests, e.request_no),
                                   idempotency_keys=keys, request_bodies={**state.request_bodies, digest: e.request_no})


def _chain_started(state: SessionState, e: ChainStarted) -> SessionState:
    _require_open(state, e)
    if e.chain != len(state.chains):
        raise FoldError(f"session {state.session_id}: chain {e.chain} started, expected {len(state.chains)}")
    if e.fork and e.fork.parent is not None and not 0 <= e.fork.parent < e.chain:
        raise FoldError(f"session {state.session_id}: chain {e.chain} forks from chain {e.fork.parent}")
    # Sibling chains (parallel samples, retried sub-agents) often start from the same prompt:
    # they share one buffer.
    prompt = next((c.prompt_ids for c in state.chains if c.prompt_ids == e.prompt_ids), e.prompt_ids)
    prompt_len = tokens.count(e.prompt_ids)
    own = _placed(state, e, e.images, 0, prompt_len)
    chain = ChainState(
        index=e.chain,
        prompt_ids=prompt,
        prompt_len=prompt_len,
        n_messages=e.n_messages,
        chat_turns=e.chat_turns,
        pending_request=e.request_no,
        pending_prefix=e.prefix_digest,
        pending_prefix_messages=e.n_messages,
        fork=e.fork or None,
        images=_inherited(state, e.fork or None, own, prompt_len),
    )
    return msgspec.structs.replace(state, seq=e.seq, updated_at=e.time, chains=(*state.chains, chain))


def _context(state: SessionState, e: ContextAppended) -> SessionState:
    chain = _open_chain(state, e, e.chain)
    count = tokens.count(e.token_ids)
    images = _placed(state, e, e.images, chain.length, count)
    chain = msgspec.structs.replace(
        chain,
        segments=(*chain.segments, Segment(token_ids=e.token_ids, generated=False)) if count else chain.segments,
        images=chain.images + images if images else chain.images,
        response_len=chain.response_len + count,
        n_messages=e.n_messages,
        chat_turns=chain.chat_turns + e.chat_turns,
        pending_request=e.request_no,
        pending_prefix=e.prefix_digest,
        pending_prefix_messages=e.n_messages,
        pending_response_len=chain.response_len,
        pending_segment=len(chain.segments),
    )
    return _replace_chain(state, e, chain)


def _placed(state: SessionState, e: Event, images: tuple[ImageRef, ...] | msgspec.UnsetType, before: int,
            count: int) -> tuple[ImageRef, ...]:
    """An event's images at their absolute offsets (``before``: the chain's tokens before the event's ``count``);
    :class:`FoldError` for an image outside the event's tokens or overlapping the one before it."""
    if not images:
        return ()
    placed = []
    end = 0
    for image in images:
        if image.tokens < 1 or image.offset < end or image.offset + image.tokens > count:
            raise FoldError(f"session {state.session_id}: event #{e.seq} places image {image.digest[:16]} at "
                            f"{image.offset}+{image.tokens} in its {count} tokens")
        end = image.offset + image.tokens
        placed.append(msgspec.structs.replace(image, offset=before + image.offset))
    return tuple(placed)


def _inherited(state: SessionState, fork: ForkPoint | None, own: tuple[ImageRef, ...],
               prompt_len: int) -> tuple[ImageRef, ...]:
    """A new chain's images: its own, and its parent's inside the token prefix they share (where its own name
    no image at the same offset)."""
    if fork is None or fork.parent is None or not fork.token_offset:
        return own
    shared = min(fork.token_offset, prompt_len)
    taken = {image.offset for image in own}
    inherited = [image for image in state.chains[fork.parent].images
                 if image.offset + image.tokens <= shared and image.offset not in taken]
    if not inherited:
        return own
    return tuple(sorted((*own, *inherited), key=attrgetter("offset")))


def _tokens(state: SessionState, e: TokensGenerated) -> SessionState:
    chain = _open_chain(state, e, e.chain)
    if chain.pending_request != e.request_no:
        raise FoldError(f"session {state.session_id}: tokens for request {e.request_no} on chain {e.chain}")
    if e.logprobs is not None and len(e.logprobs) != len(e.token_ids):
        raise FoldError(f"session {state.session_id}: {tokens.count(e.token_ids)} tokens but "
                        f"{tokens.count(e.logprobs)} log probs")
    count = tokens.count(e.token_ids)
    if not count:
        return _touch(state, e)
    segment = Segment(token_ids=e.token_ids, generated=True, logprobs=e.logprobs)
    chain = msgspec.structs.replace(
        chain, segments=(*chain.segments, segment), response_len=chain.response_len + count,
        generated_len=chain.generated_len + count,
    )
    return _replace_chain(state, e, chain)


def _turn(state: SessionState, e: TurnCompleted) -> SessionState:
    chain = _open_chain(state, e, e.chain)
    if chain.pending_request != e.request_no:
        raise FoldError(f"session {state.session_id}: turn for request {e.request_no} on chain {e.chain}")
    turn = Turn(
        request_no=e.request_no,
        finish_reason=e.finish_reason,
        text=e.text,
        reasoning=e.reasoning,
        tool_calls=e.tool_calls,
        prefix_digest=chain.pending_prefix,
        n_prefix_messages=chain.pending_prefix_messages,
        response_len_before=chain.pending_response_len,
        weight_version=e.weight_version,
        time=e.time,
        first_segment=chain.pending_segment,
        end_segment=len(chain.segments),
        constrained=e.constrained or None,
    )
    chain = msgspec.structs.replace(
        chain,
        turns=(*chain.turns, turn),
        tip_digest=e.tip_digest,
        n_messages=e.n_messages,
        chat_turns=chain.chat_turns + 1,
        pending_request=None,
    )
    return _replace_chain(state, e, chain)


def _rolled_back(state: SessionState, e: TurnRolledBack) -> SessionState:
    """Drop the last turn's sampled tokens; the chain ends at that turn's generation prompt again."""
    chain = _open_chain(state, e, e.chain)
    if not chain.turns or chain.turns[-1].request_no != e.turn_request_no or chain.pending_request is not None:
        raise FoldError(f"session {state.session_id}: chain {e.chain} cannot roll back request {e.turn_request_no}")
    turn = chain.turns[-1]
    segments = chain.segments
    if len(chain.prompt_ids) == 4 * chain.prompt_len:  # buffers held (not a released summary state)
        own = segments[turn.first_segment: turn.end_segment]
        dropped = sum(s.length for s in own if s.generated)
        if dropped != e.tokens_dropped or turn.end_segment != len(segments):
            raise FoldError(f"session {state.session_id}: chain {e.chain} rollback of {e.tokens_dropped} tokens "
                            f"does not match its last turn ({dropped})")
        segments = segments[: turn.first_segment] + tuple(s for s in own if not s.generated)
        images = _after_drop(chain.images, chain.prompt_len + turn.response_len_before, own)
    else:
        images = chain.images
    # The chain now ends at a generation prompt, mid-turn: its tip matches no request until the
    # context and turn that follow in the same envelope.
    chain = msgspec.structs.replace(
        chain, segments=segments, images=images, response_len=chain.response_len - e.tokens_dropped,
        generated_len=chain.generated_len - e.tokens_dropped, turns=chain.turns[:-1], tip_digest="",
        n_messages=turn.n_prefix_messages, chat_turns=chain.chat_turns - 1)
    return _replace_chain(state, e, chain)


def _after_drop(images: tuple[ImageRef, ...], start: int, own: tuple[Segment, ...]) -> tuple[ImageRef, ...]:
    """The images once a turn's sampled segments (``own``, from absolute offset ``start``) are dropped: sampled
    tokens hold no image, so each keeps its place less the sampled tokens before it (none, as the edge writes a
    turn: its context, then its sampled tokens)."""
    cuts = []
    at = start
    for segment in own:
        if segment.generated:
            cuts.append((at, segment.length))
        at += segment.length
    if not images or not cuts or images[-1].offset < cuts[0][0]:
        return images
    return tuple(msgspec.structs.replace(image, offset=image.offset - sum(n for cut, n in cuts if cut < image.offset))
                 for image in images)


def _chain_closed(state: SessionState, e: ChainClosed) -> SessionState:
    chain = state.chain(e.chain)
    if chain.closed is not None:
        return _touch(state, e)
    closed = msgspec.structs.replace(chain, closed=e.reason, closed_by=e.request_no, pending_request=None)
    return _replace_chain(state, e, closed)


def _reward(state: SessionState, e: RewardReported) -> SessionState:
    if state.status != "open":  # posted after the session ended: kept in the log, no part of its records
        return _touch(state, e)
    return _touch(state, e, reward=e)


def _finalized(state: SessionState, e: SessionFinalized) -> SessionState:
    _require_open(state, e)
    return _touch(state, e, status="finalized", close_reason=e.reason)


def _aborted(state: SessionState, e: SessionAborted) -> SessionState:
    _require_open(state, e)
    return _touch(state, e, status="aborted", close_reason=e.reason)


def _quarantined(state: SessionState, e: SessionQuarantined) -> SessionState:
    if state.status == "open":
        raise FoldError(f"session {state.session_id} is open; it cannot be quarantined")
    return _touch(state, e, quarantined=state.quarantined or e.reason)  # the first reason stands


_HANDLERS = {
    RequestReceived: _request,
    EngineFailed: _touch,
    ChainStarted: _chain_started,
    ContextAppended: _context,
    TokensGenerated: _tokens,
    TurnCompleted: _turn,
    ChainClosed: _chain_closed,
    RewardReported: _reward,
    SessionFinalized: _finalized,
    SessionAborted: _aborted,
    TurnAbandoned: _touch,
    TurnRolledBack: _rolled_back,
    SessionQuarantined: _quarantined,
}
