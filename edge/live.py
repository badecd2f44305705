"""Live sessions: the edge's in-memory view of the sessions it writes.

A :class:`LiveSession` holds the fold state of one session and the stream sequence of
its last envelope. :meth:`LiveSession.commit` is the only way state changes: under the
session's lock it drafts events from the current state, applies the fold (so an event
that does not fit is refused before it reaches the log), appends them, and only then
swaps the state in. The :class:`Registry` finds a session in memory or rebuilds it from
the log (the same fold), so a restarted edge picks up where the log says.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from edge.publisher import EventLog
from schemas.errors import SessionClosed
from schemas.events import Event
from session_projector.fold import SessionState, apply
from session_projector.summary import SessionSummary, summarize

Draft = Callable[[SessionState], Sequence[Event]]
Loader = Callable[[str], Awaitable[tuple[SessionState, int]]]


class LiveSession:
    def __init__(self, state: SessionState, stream_seq: int) -> None:
        self.state = state
        self.stream_seq = stream_seq
        self.busy: set[int] = set()  # chains with a request in flight
        self._next_request = state.requests + 1
        self._lock = asyncio.Lock()

    def take_request_no(self) -> int:
        number = self._next_request
        self._next_request += 1
        return number

    async def commit(self, log: EventLog, draft: Draft, *, allow_closed: bool = False) -> list[Event]:
        """Append the drafted events (their ``seq`` assigned here) and apply them."""
        async with self._lock:
            state = self.state
            if state.status != "open" and not allow_closed:
                raise SessionClosed(f"session {state.session_id} is {state.status}")
            events = [msgspec.structs.replace(e, seq=state.seq + i + 1) for i, e in enumerate(draft(state))]
            for event in events:
                state = apply(state, event)
            appended = await log.append(state.session_id, events, self.stream_seq)
            self.stream_seq = appended.stream_seq
            self.state = state
            return events


class Registry:
    """Open sessions held live; closed ones kept only as summaries; anything else loaded from the log."""

    def __init__(self, loader: Loader, *, closed_cache: int = 4096) -> None:
        self._loader = loader
        self._live: dict[str, LiveSession] = {}
        self._loading: dict[str, asyncio.Future[LiveSession]] = {}
        self._closed: OrderedDict[str, SessionSummary] = OrderedDict()
        self._closed_cache = closed_cache

    def __len__(self) -> int:
        return len(self._live)

    def add(self, session: LiveSession) -> None:
        self._live[session.state.session_id] = session

    async def get(self, session_id: str) -> LiveSession:
        """The live session; rebuilt from the log when this edge does not hold it."""
        live = self._live.get(session_id)
        if live is not None:
            return live
        closed = self._closed.get(session_id)
        if closed is not None:
            raise SessionClosed(f"session {session_id} is {closed.status}")
        pending = self._loading.get(session_id)
        if pending is None:
            pending = asyncio.ensure_future(self._load(session_id))
            self._loading[session_id] = pending
            pending.add_done_callback(lambda _: self._loading.pop(session_id, None))
        live = await asyncio.shield(pending)
        if live.state.status != "open":
            raise SessionClosed(f"session {session_id} is {live.state.status}")
        return live

    async def load(self, session_id: str) -> LiveSession:
        """The session rebuilt from the log now, whatever its status (not kept: for a one-off append)."""
        state, stream_seq = await self._loader(session_id)
        return LiveSession(state, stream_seq)

    async def summary(self, session_id: str) -> SessionSummary:
        live = self._live.get(session_id)
        if live is not None:
            return summarize(live.state)
        closed = self._closed.get(session_id)
        if closed is not None:
            return closed
        state, _ = await self._loader(session_id)
        if state.status != "open":
            self._remember(summarize(state))
        return summarize(state)

    async def _load(self, session_id: str) -> LiveSession:
        state, stream_seq = await self._loader(session_id)
        live = LiveSession(state, stream_seq)
        if state.status == "open":
            self._live[session_id] = live
        else:
            self._remember(summarize(state))
        return live

    def release(self, session_id: str) -> None:
        """Drop a closed session's live state (its tokens), keeping its summary for reads."""
        live = self._live.pop(session_id, None)
        if live is not None:
            self._remember(summarize(live.state))

    def _remember(self, summary: SessionSummary) -> None:
        self._closed[summary.session_id] = summary
        self._closed.move_to_end(summary.session_id)
        while len(self._closed) > self._closed_cache:
            self._closed.popitem(last=False)
