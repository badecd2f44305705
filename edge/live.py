"""Live sessions: the edge's in-memory view of the sessions it writes.

A :class:`LiveSession` holds the fold state of one session, the stream sequence of its
last envelope and the session's lease (:mod:`edge.ownership`). :meth:`LiveSession.commit`
is the only way state changes: under the session's lock it decides the events from the
current state (numbered after its last sequence: :mod:`session.numbering`, :mod:`session.turn`),
applies the fold (so an event that does not fit, or is not numbered next, is refused before it
reaches the log), makes sure the lease is still this edge's, appends, and only then swaps the
state in.

An append refused with :class:`OwnershipLost` (another writer appended: the log's
per-session sequence check) or a lease that changed hands marks the live session *lost*:
the registry forgets it at once, without publishing anything, and the next request
rebuilds the session from the log (or is refused while another edge holds it).

An append that JetStream did not acknowledge (:class:`LogUnavailable`, answered 503) may
still have been stored: the live state can no longer be trusted to be the log's, so it is
dropped the same way (the lease is kept: it is still this edge's) and the next request
rebuilds the session from the log. A retry of the request then finds its turn there if it
was stored (:mod:`edge.idempotency`), or runs again if it was not. A turn answered 503 but
stored (a stalled server resumed) is kept as completed, not marked: the edge cannot tell
whether an answer reached its agent (a 200 can be lost too), and the SDKs' retry of the 503
is answered with that very turn (docs/crashes.md, *Such a turn is kept in the records*).

The :class:`Registry` finds a session in memory or takes it over: it rebuilds it from the
log (the same fold) and acquires its lease, so a restarted edge, or another one, picks
up where the log says. Closed sessions are kept only as summaries; a finalized or aborted
session's live state (its token buffers) is dropped and its lease deleted.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence

from edge.engine_input import InputBuffer
from edge.forks import Histories
from edge.idempotency import InFlight
from edge.ownership import KvLeases, LeaseHandle
from edge.settings import Clock
from edge.stored import StoredConversations
from eventlog.publisher import EventLog
from schemas.bodies import MIN_RUN, isolating, literal, occurrences, parts_against, referencing
from schemas.errors import LogUnavailable, OwnershipLost, SessionClosed
from schemas.events import BodyPart, Event
from schemas.metadata import or_default, read_settings
from session.fold import SessionState, apply
from session.summary import SessionSummary, summarize

Decide = Callable[[SessionState], Sequence[Event]]
"""Given the session's state, the events to append after it, numbered from its ``seq`` on."""
Loader = Callable[[str], Awaitable[tuple[SessionState, int]]]
Position = Callable[[str], Awaitable[int]]  # stream seq of the session's last envelope
Summaries = Callable[[str], Awaitable[SessionSummary | None]]  # from projections, without replaying
Admit = Callable[[str], None]
"""Given a session's ``api_key_digest``, raises to refuse the request (:meth:`Registry.get`)."""


class StoredBodies:
    """The bodies of this session's latest requests that the log has acknowledged, by chain (a few),
    so that a new request is stored against the one it most likely repeats (schemas/bodies.py).

    Only acknowledged requests are remembered: a request's parts may refer only to what is in the
    log before it. After a takeover nothing is remembered, and the next request is stored whole.

    The base64 text of the images acknowledged requests carried is remembered too (``keep_images`` of
    them), where it sits in its body: an image sent again in a new message is a reference to it
    (:func:`schemas.bodies.referencing`), not its text again."""

    def __init__(self, keep: int = 4, keep_images: int = 32) -> None:
        self._keep = keep
        self._latest: OrderedDict[int, tuple[int, bytes]] = OrderedDict()  # chain -> (request_no, body)
        self._keep_images = keep_images
        self._digests: set[str] = set()  # the images whose text is in _runs (or was not found in its body)
        self._runs: dict[bytes, tuple[int, int]] = {}  # an image's base64 text -> (request_no, start) in a body

    def parts(self, body: bytes, chain: int | None, images: Sequence[tuple[str, bytes]] = ()) -> tuple[BodyPart, ...]:
        """``body`` as parts against the latest request on ``chain`` (for a new chain, or a chain not
        remembered, the latest request of any chain), its images' text sent before as references; the text of
        ``images`` ((digest, bytes) of the request's) not sent before in parts of their own, which the log's writer
        keeps in the object store (:func:`schemas.bodies.isolating`)."""
        base = self._latest.get(chain) if chain is not None else None
        if base is None and self._latest:
            base = next(reversed(self._latest.values()))
        parts = referencing(literal(body) if base is None else parts_against(body, *base), self._runs)
        return isolating(parts, [base64.b64encode(data) for _, data in self._unseen(images)])

    def stored(self, chain: int, request_no: int, body: bytes, images: Sequence[tuple[str, bytes]] = ()) -> None:
        """Request ``request_no`` (on ``chain``) is in the log; ``images``: (digest, bytes) of the images it
        carried, whose base64 text later requests may refer to."""
        self._latest[chain] = (request_no, body)
        self._latest.move_to_end(chain)
        while len(self._latest) > self._keep:
            self._latest.popitem(last=False)
        for digest, data in self._unseen(images):
            self._digests.add(digest)
            text = base64.b64encode(data)
            start = next(iter(occurrences(body, text)), -1)
            if start >= 0:
                if len(self._runs) >= self._keep_images:
                    self._runs.pop(next(iter(self._runs)))
                self._runs[text] = (request_no, start)

    def _unseen(self, images: Sequence[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """Those of ``images`` whose text is not remembered (nor looked for before), long enough to be worth a
        reference; each once (none looked for in a request without images: the usual one)."""
        if not images:
            return []
        return list({digest: data for digest, data in images
                     if digest not in self._digests and len(data) * 4 // 3 >= MIN_RUN}.items())


class InUse:
    """``with live.in_use():``, one object a session for every request (two uses a turn: a context manager made by
    ``@contextmanager`` cost a turn 5 us each)."""

    __slots__ = ("_live",)

    def __init__(self, live: LiveSession) -> None:
        self._live = live

    def __enter__(self) -> None:
        self._live._enter()

    def __exit__(self, *exc: object) -> None:
        self._live._leave()


class LiveSession:
    def __init__(self, state: SessionState, stream_seq: int, lease: LeaseHandle | None = None, *,
                 clock: Clock = time.time) -> None:
        self.state = state
        self.stream_seq = stream_seq
        self.lease = lease
        self.busy: set[int] = set()  # chains with a request in flight
        self.verified_key: str | None = None  # the api key once checked against its digest
        self.inflight = InFlight()  # requests in flight, by identity (edge.idempotency)
        self.bodies = StoredBodies()  # latest acknowledged request bodies (what new ones are stored against)
        self.known: dict[str, object] = {}  # by wire: the last request's decoded history (edge.wires.prefix)
        self.stored = StoredConversations()  # conversations requests may continue (edge.stored)
        # the chains' latest histories, to tell where a new chain forks (edge.forks); a session loaded with chains
        # (taken over) has them recovered from the log when a request would fork
        self.histories = Histories(recoverable=bool(state.chains))
        # the session's continue_reserialized_turns (schemas.metadata): continue a chain its request re-serialised
        self.continues_reserialized = or_default(read_settings(state.metadata)[0].continue_reserialized_turns, False)
        self.inputs: dict[int, InputBuffer] = {}  # long chains' engine input, grown in place (edge.engine_input)
        self.images_stored: set[str] = set()  # digests of the images this edge stored for it (edge.turns)
        self.fetched_images: dict[str, bytes] = {}  # http(s) image URLs fetched for it, and their bytes (edge.images)
        self.active = 0  # requests in flight
        self.touched = state.updated_at  # last activity: a request started or an event committed
        self.lost = False
        self.on_lost: Callable[[LiveSession], None] | None = None
        self._clock = clock
        self._next_request = state.requests + 1
        self._lock = asyncio.Lock()
        self._in_use = InUse(self)

    @property
    def session_id(self) -> str:
        return self.state.session_id

    def take_request_no(self) -> int:
        number = self._next_request
        self._next_request += 1
        return number

    def in_use(self) -> InUse:
        """Marks a request in flight (``with live.in_use():``): the session is not idle, and its
        lease is kept renewed."""
        return self._in_use

    def _enter(self) -> None:
        self.active += 1
        self.touched = self._clock()

    def _leave(self) -> None:
        self.active -= 1
        self.touched = self._clock()

    def idle_for(self) -> float:
        return 0.0 if self.active else self._clock() - self.touched

    async def commit(self, log: EventLog, decide: Decide, *, allow_closed: bool = False) -> list[Event]:
        """Append the events ``decide`` gives from the current state, and apply them."""
        async with self._lock:
            state = self.state
            if self.lost:
                raise OwnershipLost(f"session {state.session_id} is no longer written by this edge; retry")
            if state.status != "open" and not allow_closed:
                raise SessionClosed(f"session {state.session_id} is {state.status}")
            events = list(decide(state))
            for event in events:
                state = apply(state, event)
            try:
                if self.lease is not None:
                    await self.lease.ensure()
            except OwnershipLost:
                self.lose()
                raise
            try:
                appended = await log.append(state.session_id, events, self.stream_seq)
            except (OwnershipLost, LogUnavailable):  # another writer, or an outcome unknown: reload
                self.lose()
                raise
            self.stream_seq = appended.stream_seq
            self.state = state
            self.touched = self._clock()
            return events

    def lose(self) -> None:
        """Another writer has the session: stop writing, and let the registry forget this state."""
        self.lost = True
        if self.on_lost is not None:
            self.on_lost(self)


class Registry:
    """Open sessions held live; closed ones kept only as summaries; anything else taken over from the log."""

    def __init__(self, loader: Loader, *, leases: KvLeases | None = None, position: Position | None = None,
                 summaries: Summaries | None = None, closed_cache: int = 4096, clock: Clock = time.time) -> None:
        self._loader = loader
        self._leases = leases
        self._position = position
        self._summaries = summaries
        self._clock = clock
        self._live: dict[str, LiveSession] = {}
        self._loading: dict[str, asyncio.Future[LiveSession]] = {}
        self._closed: OrderedDict[str, tuple[SessionSummary, str | None]] = OrderedDict()  # summary, key digest
        self._closed_cache = closed_cache

    def __len__(self) -> int:
        return len(self._live)

    def holds(self, session_id: str) -> bool:
        return session_id in self._live

    def peek(self, session_id: str) -> LiveSession | None:
        """The live session if this edge holds it (no loading)."""
        return self._live.get(session_id)

    def live_sessions(self) -> list[LiveSession]:
        return list(self._live.values())

    def add(self, session: LiveSession) -> None:
        session.on_lost = self._forget
        self._live[session.session_id] = session

    async def get(self, session_id: str, admit: Admit | None = None) -> LiveSession:
        """The live session; taken over from the log when this edge does not hold it. ``admit``, given the
        session's key digest, may refuse the caller first: before a closed session is reported closed
        (:class:`SessionClosed`) and before a session is taken over (its lease acquired)."""
        live = self._live.get(session_id)
        if live is None:
            live = await self._taken_over(session_id, admit)
        elif admit is not None:
            admit(live.state.api_key_digest)
        if live.state.status != "open":
            raise SessionClosed(f"session {session_id} is {live.state.status}")
        return live

    async def _taken_over(self, session_id: str, admit: Admit | None) -> LiveSession:
        closed = self._closed.get(session_id)
        if closed is not None:
            summary, digest = closed
            if admit is not None:
                if digest is None:
                    digest = (await self._loader(session_id))[0].api_key_digest
                    self._remember(summary, digest)
                admit(digest)
            raise SessionClosed(f"session {session_id} is {summary.status}")
        read = None
        if admit is not None and session_id not in self._loading:  # the key is checked before the lease is taken
            read = await self._loader(session_id)
            admit(read[0].api_key_digest)
            held = self._live.get(session_id)  # taken over meanwhile, for another request
            if held is not None:
                return held
        pending = self._loading.get(session_id)
        if pending is None:
            pending = asyncio.ensure_future(self._load(session_id, read))
            self._loading[session_id] = pending
            pending.add_done_callback(lambda _: self._loading.pop(session_id, None))
        elif admit is not None and read is None:  # being taken over for another request: this one's key first
            admit((await self._loader(session_id))[0].api_key_digest)
        return await asyncio.shield(pending)

    async def load(self, session_id: str) -> LiveSession:
        """The session rebuilt from the log now, whatever its status (not kept: for a one-off append)."""
        state, stream_seq = await self._loader(session_id)
        return LiveSession(state, stream_seq)

    async def summary(self, session_id: str) -> SessionSummary:
        """From the live state, the closed cache, the projection (plus the log's tail), or a replay.

        A live state whose lease has lapsed may have been taken over elsewhere: not trusted for reads.
        """
        live = self._live.get(session_id)
        if live is not None and (live.lease is None or live.lease.remaining() > 0):
            return summarize(live.state)
        closed = self._closed.get(session_id)
        if closed is not None:
            return closed[0]
        summary = await self._summaries(session_id) if self._summaries is not None else None
        digest = None
        if summary is None:  # not projected (yet): replay
            state, _ = await self._loader(session_id)
            summary, digest = summarize(state), state.api_key_digest
        if summary.status != "open":
            self._remember(summary, digest)
        return summary

    async def _load(self, session_id: str, read: tuple[SessionState, int] | None = None) -> LiveSession:
        """Take the session over (``read``: its state and position, if just read from the log)."""
        state, stream_seq = read if read is not None else await self._loader(session_id)
        if state.status != "open":
            self._remember(summarize(state), state.api_key_digest)
            return LiveSession(state, stream_seq, clock=self._clock)
        lease = await self._leases.acquire(session_id) if self._leases is not None else None
        if self._position is not None and await self._position(session_id) != stream_seq:
            state, stream_seq = await self._loader(session_id)  # it moved before the lease was ours
        live = LiveSession(state, stream_seq, lease, clock=self._clock)
        if state.status != "open":
            await self._drop_lease(live)
            self._remember(summarize(state), state.api_key_digest)
            return live
        self.add(live)
        return live

    async def release(self, session_id: str) -> None:
        """Drop a closed session's live state (its tokens) and lease, keeping its summary for reads."""
        live = self._live.pop(session_id, None)
        if live is not None:
            self._remember(summarize(live.state), live.state.api_key_digest)
            await self._drop_lease(live)

    async def drop(self, session_id: str) -> None:
        """Let an open session go (to be taken over elsewhere): forget its live state, delete its lease."""
        live = self._live.pop(session_id, None)
        if live is not None:
            live.lost = True
            await self._drop_lease(live)

    async def close(self) -> None:
        """On shutdown: let every open session go, so that any edge can take it over at once."""
        for session_id in list(self._live):
            await self.drop(session_id)

    async def _drop_lease(self, live: LiveSession) -> None:
        if live.lease is not None:
            await live.lease.release()
            live.lease = None

    def _forget(self, live: LiveSession) -> None:
        if self._live.get(live.session_id) is live:
            del self._live[live.session_id]

    def _remember(self, summary: SessionSummary, digest: str | None) -> None:
        """Keep a closed session's summary, and its key's digest (``None``: not known here)."""
        self._closed[summary.session_id] = (summary, digest)
        self._closed.move_to_end(summary.session_id)
        while len(self._closed) > self._closed_cache:
            self._closed.popitem(last=False)
