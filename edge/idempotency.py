"""Request idempotency: a retried request gets the completion already recorded for it.

What counts as *the same request* (always within one session):

* A request with an ``Idempotency-Key`` header (1-255 printable ASCII characters) repeats
  the latest earlier request of the session that carried the same key. Its body must be
  byte-identical (same sha256, :func:`schemas.events.body_digest`); a different body is a
  client bug, refused with 400 ``idempotency_key_reused`` (a 400, not a 409: the SDKs
  retry 409s, and retrying cannot fix this).
* A request without that header but with ``x-stainless-retry-count`` >= 1 (what the
  official ``openai`` and ``anthropic`` Python SDKs send on their automatic retries; they
  send no idempotency key) repeats the latest earlier request of the session with a
  byte-identical body.
* Anything else is a new request, even with an identical body (a sibling sample). Agents
  that send identical bodies on purpose and want them sampled apart should send a distinct
  ``Idempotency-Key`` each time (the retry count is then not consulted).

A repeated request whose original completed a turn is answered from the log: the same
completion id, content, tool calls, token ids, log probs and usage; the engine is not
called and nothing is appended. One whose original recorded no turn (the engine failed,
the request was refused for length, or the edge died before its events were
acknowledged) runs as a new request. A repeat that arrives while its original is still
running on this edge waits for it first (:class:`InFlight`). The index lives in the fold
state (``SessionState.idempotency_keys``, ``request_bodies``), so all of this holds
after an edge restart or a takeover too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Protocol

import msgspec

from edge.chat.conversation import TurnOutcome
from schemas import tokens
from schemas.errors import IdempotencyKeyReused, MalformedRequest
from schemas.events import body_digest
from session.fold import SessionState


class Adoptable(Protocol):
    """A running request a repeat can adopt (:class:`edge.turns.Disconnect`)."""

    def adopted(self) -> None: ...


IDEMPOTENCY_KEY_HEADER = "idempotency-key"
RETRY_COUNT_HEADER = "x-stainless-retry-count"
MAX_KEY_LENGTH = 255


class RequestIdentity(msgspec.Struct, frozen=True, kw_only=True):
    body_digest: str
    key: str | None = None
    retry: bool = False  # the client says this is a retry (x-stainless-retry-count >= 1)

    @property
    def may_repeat(self) -> bool:
        return self.key is not None or self.retry

    def tokens(self) -> list[str]:
        """What an in-flight request is known by."""
        return [f"body:{self.body_digest}"] + ([f"key:{self.key}"] if self.key is not None else [])

    def token(self) -> str:
        """What a repeat waits on."""
        return f"key:{self.key}" if self.key is not None else f"body:{self.body_digest}"


def retry_count(headers: Mapping[str, str]) -> int:
    """The SDK's retry counter (0 when absent or unreadable). Only ASCII digits are read (``"²"`` is a
    digit to ``str.isdigit`` but not to ``int``), and at most 18 of them (``int`` refuses a string of
    thousands): all that matters is whether the count is above 0."""
    value = headers.get(RETRY_COUNT_HEADER, "0").strip()
    if not (value.isascii() and value.isdigit()):
        return 0
    return int(value.lstrip("0")[:18] or "0")


def identify(body: bytes, key: str | None, retries: int = 0, digest: str = "") -> RequestIdentity:
    """``digest``: the body's, when already computed (the wire adapters finish it while decoding)."""
    if key is not None and not (0 < len(key) <= MAX_KEY_LENGTH and key.isascii() and key.isprintable()):
        raise MalformedRequest(f"Idempotency-Key must be 1-{MAX_KEY_LENGTH} printable ASCII characters",
                               param="Idempotency-Key")
    return RequestIdentity(body_digest=digest or body_digest(body), key=key, retry=retries > 0)


def repeated_request(state: SessionState, identity: RequestIdentity) -> int | None:
    """The number of the earlier request this one repeats, if any."""
    if identity.key is not None:
        earlier = state.idempotency_keys.get(identity.key)
        if earlier is None:
            return None
        if earlier.body_digest != identity.body_digest:
            raise IdempotencyKeyReused(f"Idempotency-Key {identity.key!r} was used for request "
                                       f"{earlier.request_no} with a different body", param="Idempotency-Key")
        return earlier.request_no
    if identity.retry:
        return state.request_bodies.get(identity.body_digest)
    return None


def recorded_outcome(state: SessionState, request_no: int) -> TurnOutcome | None:
    """The answer request ``request_no`` got, rebuilt from the fold state; ``None`` if it completed no turn."""
    found = state.turn_of(request_no)
    if found is None:
        return None
    chain, turn = found
    segments = chain.segments[turn.first_segment: turn.end_segment]
    sampled = [s for s in segments if s.generated]
    context = sum(s.length for s in segments if not s.generated)
    ids = tokens.unpack_ids(b"".join(s.token_ids for s in sampled)).tolist()
    logprobs = None
    if sampled and all(s.logprobs is not None for s in sampled):
        logprobs = tuple(tokens.unpack_logprobs(b"".join(s.logprobs or b"" for s in sampled)).tolist())
    if turn.tool_calls:
        finish = "tool_calls"
    elif chain.closed_by == request_no or turn.finish_reason == "length":
        finish = "length"
    else:
        finish = "stop"
    return TurnOutcome(
        session_id=state.session_id, request_no=request_no, content=turn.text, reasoning=turn.reasoning,
        tool_calls=turn.tool_calls, finish_reason=finish,
        prompt_tokens=chain.prompt_len + turn.response_len_before + context, completion_tokens=len(ids),
        token_ids=tuple(ids), logprobs=logprobs, created=int(turn.time),
    )


class InFlight:
    """Requests running on one live session, by identity token, so a repeat can wait for its original.

    A repeat that waits *adopts* the original: an original whose client has gone is then
    not aborted (see :class:`edge.turns.Disconnect`) and the repeat gets its completion."""

    def __init__(self) -> None:
        self._running: dict[str, list[tuple[asyncio.Future[None], Adoptable | None]]] = {}

    async def settled(self, identity: RequestIdentity) -> None:
        """Return once no request this one may repeat is running (at once for a new request)."""
        if not identity.may_repeat:
            return
        while running := self._running.get(identity.token()):
            for _, original in running:
                if original is not None:
                    original.adopted()
            await asyncio.wait([done for done, _ in running])

    def running(self, identity: RequestIdentity, original: Adoptable | None = None) -> Running:
        """Registers a request as running for the block (``with inflight.running(...):``)."""
        return Running(self._running, identity.tokens(), original)


class Running:
    """A request registered as running while its ``with`` block lasts (:meth:`InFlight.running`); a class, not
    ``@contextmanager``, which cost a turn 5 us."""

    __slots__ = ("_entry", "_names", "_table")

    def __init__(self, table: dict[str, list[tuple[asyncio.Future[None], Adoptable | None]]],
                 names: list[str], original: Adoptable | None) -> None:
        self._table, self._names = table, names
        self._entry = (asyncio.get_running_loop().create_future(), original)

    def __enter__(self) -> None:
        for name in self._names:
            self._table.setdefault(name, []).append(self._entry)

    def __exit__(self, *exc: object) -> None:
        entry = self._entry
        entry[0].set_result(None)
        for name in self._names:
            waiting = self._table.get(name, [])
            if entry in waiting:
                waiting.remove(entry)
            if not waiting:
                self._table.pop(name, None)

