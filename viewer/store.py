"""What the viewer reads, and how it keeps it between requests.

* The list comes from the projections bucket (as ``rollbus sessions`` reads it, no replay): a
  watcher on the bucket (nats-py's ``KeyValue.watchall``) reads every session's projection once,
  then each update as the projector writes it, into one list row per session held in memory; a
  page is filtered from those rows, so asking for pages never scans the bucket again.
* A session comes from the log: its events are read and folded (the same fold as the edge's), and
  kept, with the stream position they were read up to. Asked again, the viewer looks up where the
  session's last envelope sits (one direct get) and folds only what came after it, so polling a
  running session costs its new events, and polling a finished one costs one lookup.
* Images come from the log's object store, by digest, when the page asks for one.
* Token texts are decoded with the tokenizer the session names, loaded once per name; a session
  whose tokenizer cannot be loaded here is shown with token ids only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import msgspec
from nats.errors import Error as NatsError
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from edge.tokens.tokenizer import load_tokenizer
from eventlog.kv import KvStore
from eventlog.pieces import PieceStore, open_pieces
from eventlog.reader import iter_envelopes, last_stream_seq
from schemas.bodies import Bodies
from schemas.errors import LogUnavailable, RollbusError, SessionNotFound
from schemas.events import RequestReceived
from schemas.log import LogConfig, check_session_id
from session.fold import SessionState, fold
from session.summary import summarize
from session_projector.projections import decode
from stack.user_error import one_line
from viewer.detail import MAX_AUDIT, MAX_REQUESTS, AuditEntry, RequestEntry, audit_entry, request_entry
from viewer.listing import SessionRow, newest_first, order_key, put, remove, row
from viewer.pieces import Decode

log = logging.getLogger(__name__)


@dataclass
class SessionEntry:
    """A session as read so far: its fold state and what the page lists beside it."""

    state: SessionState | None = None
    last_stream_seq: int = 0
    audit: deque[AuditEntry] = field(default_factory=lambda: deque(maxlen=MAX_AUDIT))
    requests: deque[RequestEntry] = field(default_factory=lambda: deque(maxlen=MAX_REQUESTS))
    bodies: Bodies = field(default_factory=Bodies)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionIndex:
    """Every session's list row, kept current by a watcher on the projections bucket."""

    def __init__(self, js: JetStreamContext, cfg: LogConfig, *, timeout_s: float = 30.0) -> None:
        self._js = js
        self._cfg = cfg
        self._timeout_s = timeout_s
        self._rows: dict[str, SessionRow] = {}
        self._sorted: list[SessionRow] = []  # the rows, newest first, kept in order as they change
        self._task: asyncio.Task[None] | None = None
        self._watcher: KeyValue.KeyWatcher | None = None
        self._ready = asyncio.Event()  # the first snapshot is in (or the watcher failed)
        self._error: BaseException | None = None

    async def rows(self) -> list[SessionRow]:
        """The rows, newest first; :class:`LogUnavailable` when the bucket cannot be watched."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._follow())
        try:
            await asyncio.wait_for(self._ready.wait(), self._timeout_s)
        except TimeoutError as exc:
            raise LogUnavailable("the projections bucket did not answer in time") from exc
        if self._error is not None:
            error = self._error
            await self.stop()  # the next request watches again
            raise LogUnavailable(f"cannot watch the projections bucket: {one_line(str(error))}") from error
        return self._sorted

    async def _follow(self) -> None:
        try:
            self._watcher = await KvStore(self._js, self._cfg.projections_bucket).watch()
            async for entry in self._watcher:
                if entry is None:  # the snapshot is in (sorted once); updates follow, each put in its place
                    self._sorted = newest_first(self._rows.values())
                    self._ready.set()
                    continue
                self._apply(entry.key, entry.value, entry.operation, in_order=self._ready.is_set())
        except (RollbusError, NatsError, TimeoutError) as exc:
            self._error = exc
            self._ready.set()

    def _apply(self, key: str, value: bytes | None, operation: str | None, *, in_order: bool) -> None:
        """Take one update; ``in_order``: also into the sorted rows (after the snapshot)."""
        old = self._rows.pop(key, None)
        new = None
        if operation not in ("DEL", "PURGE"):
            try:
                new = row(summarize(decode(value or b"").state))
            except msgspec.DecodeError as exc:
                log.warning("viewer: the projection of %s does not decode (%s); not listed", key, exc)
        if new is not None:
            self._rows[key] = new
        if not in_order:
            return
        if old is not None and (new is None or order_key(old) != order_key(new)):
            remove(self._sorted, old)
        if new is not None:
            put(self._sorted, new)

    async def stop(self) -> None:
        task, watcher, self._task, self._watcher = self._task, self._watcher, None, None
        if watcher is not None:
            with contextlib.suppress(NatsError, TimeoutError):
                await watcher.stop()
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._rows, self._sorted, self._error = {}, [], None
        self._ready.clear()


class LogView:
    def __init__(self, js: JetStreamContext, cfg: LogConfig, *, sessions_kept: int = 16) -> None:
        self._js = js
        self._cfg = cfg
        self._index = SessionIndex(js, cfg)
        self._sessions: OrderedDict[str, SessionEntry] = OrderedDict()
        self._sessions_kept = sessions_kept
        self._decoders: dict[str, Decode | None] = {}
        self._pieces: PieceStore | None = None

    async def image(self, session_id: str, digest: str) -> bytes | None:
        """One of the session's images from the log's object store (unchecked); None when it is not there."""
        if self._pieces is None:
            self._pieces = await open_pieces(self._js, self._cfg)
            if self._pieces is None:
                return None
        return await self._pieces.get(session_id, bytes.fromhex(digest))

    async def rows(self) -> list[SessionRow]:
        """Every session's list row, newest first."""
        return await self._index.rows()

    async def close(self) -> None:
        await self._index.stop()

    async def session(self, session_id: str) -> SessionEntry:
        """The session folded up to the log's end; :class:`SessionNotFound` when the log has none."""
        check_session_id(session_id)
        entry = self._sessions.get(session_id)
        if entry is None:
            entry = self._sessions[session_id] = SessionEntry()
            while len(self._sessions) > self._sessions_kept:
                self._sessions.popitem(last=False)
        self._sessions.move_to_end(session_id)
        async with entry.lock:
            last = await last_stream_seq(self._js, self._cfg, self._cfg.session_filter(session_id))
            if last == 0:
                self._sessions.pop(session_id, None)
                raise SessionNotFound(f"no session {session_id} in the log", param="session_id")
            if last > entry.last_stream_seq:
                await self._read_on(entry, session_id, last)
        return entry

    async def _read_on(self, entry: SessionEntry, session_id: str, until: int) -> None:
        start = entry.last_stream_seq + 1
        async for seq, events in iter_envelopes(self._js, self._cfg, self._cfg.session_filter(session_id), until,
                                                start=start):
            fresh = [e for e in events if entry.state is None or e.seq > entry.state.seq]
            entry.state = fold(fresh, entry.state)
            for event in fresh:
                if type(event) is RequestReceived:
                    entry.bodies.add(event)
                    entry.requests.append(request_entry(event))
                audited = audit_entry(event)
                if audited is not None:
                    entry.audit.append(audited)
            entry.last_stream_seq = seq

    async def decoder(self, spec: str) -> Decode | None:
        """The decode function of the tokenizer ``spec`` names; None when it cannot be loaded here."""
        if spec not in self._decoders:
            try:
                tokenizer = await asyncio.to_thread(load_tokenizer, spec)
                self._decoders[spec] = tokenizer.decode
            except (ValueError, OSError) as exc:
                log.warning("viewer: tokenizer %r does not load here (%s); token ids only", spec, exc)
                self._decoders[spec] = None
        return self._decoders[spec]
