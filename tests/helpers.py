"""Builders for event sequences used by the pure tests (no I/O)."""

from __future__ import annotations

from collections.abc import Sequence

from schemas import tokens
from schemas.bodies import literal
from schemas.events import (
    AnyEvent,
    ChainClosed,
    ChainStarted,
    ContextAppended,
    Event,
    ForkPoint,
    ImageRef,
    RequestReceived,
    RewardReported,
    SessionAborted,
    SessionFinalized,
    SessionOpened,
    TokensGenerated,
    TurnCompleted,
    TurnRolledBack,
    body_digest,
)

SID = "0123456789abcdef0123456789abcdef"


class SessionScript:
    """Appends well-formed events for one session, numbering them."""

    def __init__(self, session_id: str = SID, uid: str = "uid1", session_index: int = 0, max_len: int = 1000,
                 metadata: dict | None = None, processor: str | None = None) -> None:
        self.session_id = session_id
        self.events: list[Event] = []
        self.requests = 0
        self._add(SessionOpened, uid=uid, session_index=session_index, agent_name="agent",
                  metadata={"global_steps": 3} if metadata is None else metadata, api_key_digest="x",
                  max_trajectory_length=max_len,
                  tokenizer="builtin:qwen2.5", tool_format="hermes", **({} if processor is None else
                                                                          {"processor": processor}))

    def _add(self, cls: type[Event], **fields: object) -> Event:
        event = cls(session_id=self.session_id, seq=len(self.events) + 1, time=float(len(self.events)), **fields)
        self.events.append(event)
        return event

    def turn(self, chain: int, context: Sequence[int], generated: Sequence[int], *, new_chain: bool = False,
             logprobs: Sequence[float] | None = None, n_messages: int = 2, tip: str = "tip", chat_turns: int = 1,
             finish: str = "stop", body: bytes = b"{}", key: str | None = None, prefix: str | None = None,
             fork: ForkPoint | None = None, images: Sequence[ImageRef] = ()) -> None:
        """``fork``: a new chain's parent and cause (None: none recorded, as in a log written before forks);
        ``images``: those in ``context`` (offsets into it)."""
        self.requests += 1
        no = self.requests
        prefix = prefix if prefix is not None else f"p{no}"
        self._add(RequestReceived, request_no=no, wire="openai", parts=literal(body), body_size=len(body),
                  body_digest=body_digest(body), idempotency_key=key)
        if new_chain:
            self._add(ChainStarted, chain=chain, request_no=no, prompt_ids=tokens.pack_ids(context),
                      prefix_digest=prefix, n_messages=n_messages, chat_turns=chat_turns,
                      **({} if fork is None else {"fork": fork}), **({"images": tuple(images)} if images else {}))
        else:
            self._add(ContextAppended, chain=chain, request_no=no, token_ids=tokens.pack_ids(context),
                      prefix_digest=prefix, n_messages=n_messages, chat_turns=chat_turns,
                      **({"images": tuple(images)} if images else {}))
        lp = tokens.pack_logprobs(logprobs if logprobs is not None else [-0.5] * len(generated))
        self._add(TokensGenerated, chain=chain, request_no=no, token_ids=tokens.pack_ids(generated), logprobs=lp)
        self._add(TurnCompleted, chain=chain, request_no=no, finish_reason=finish, text="t", tip_digest=tip,
                  n_messages=n_messages + 1)

    def roll_back(self, chain: int, turn_request_no: int, dropped: int) -> None:
        """A rollback of the chain's last turn by the next request (whose turn follows with :meth:`turn`)."""
        self._add(TurnRolledBack, chain=chain, request_no=self.requests + 1, turn_request_no=turn_request_no,
                  tokens_dropped=dropped)

    def close(self, chain: int, reason: str = "max_trajectory_length", request_no: int | None = None) -> None:
        self._add(ChainClosed, chain=chain, reason=reason, request_no=request_no)

    def reward(self, reward: float | None, **extra: object) -> None:
        self._add(RewardReported, reward=reward, extra=dict(extra))

    def finalize(self) -> None:
        self._add(SessionFinalized)

    def abort(self, reason: str = "aborted") -> None:
        self._add(SessionAborted, reason=reason)


# Events that start an envelope, as the edge groups them (a turn's events travel together).
_STARTS = (SessionOpened, RequestReceived, RewardReported, SessionFinalized, SessionAborted)


def envelopes(events: Sequence[Event]) -> list[list[Event]]:
    """Events grouped into envelopes the way the edge appends them."""
    groups: list[list[Event]] = []
    for event in events:
        if not groups or isinstance(event, _STARTS):
            groups.append([])
        groups[-1].append(event)
    return groups


async def append_all(log, session_id: str, groups: Sequence[Sequence[Event | AnyEvent]], after: int = 0) -> int:
    """Append envelopes to a ``JetStreamLog`` in order; returns the last stream sequence."""
    for group in groups:
        after = (await log.append(session_id, list(group), after)).stream_seq
    return after
