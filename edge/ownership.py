"""Session ownership: one edge writes an open session, under a lease in the leases KV bucket.

A lease is the KV entry ``<session_id>`` of ``cfg.leases_bucket``: which edge writes the
session (its ``edge_id``, the process ``instance``, its URL) and until when (``expires``,
unix seconds). Every change is a compare-and-set on the entry's revision:

* **create**: an edge opening a session creates its lease (refused if the key exists).
* **acquire** (takeover): an edge asked for a session it does not hold reads the lease and
  takes it (CAS) when there is none, when it has lapsed (``expires + grace`` is past), or
  when it names this edge's own ``edge_id`` (a restarted edge: edge ids are unique among
  running edges; the default is ``<hostname>:<port>``). Otherwise it refuses with
  :class:`SessionOwned`, whose ``retry_after`` is the time left on the lease.
* **ensure / renew**: the holder renews (CAS on the revision it holds) before a commit when
  less than half the TTL is left, and while a request is in flight (see
  :mod:`edge.keeper`). An idle session's lease may lapse: if nobody took it meanwhile the
  revision is unchanged and the next renewal succeeds; if somebody did, it fails with
  :class:`OwnershipLost` and the holder drops its live state.
* **release**: on finalize or abort the holder deletes the entry (CAS).
* **unknown outcomes**: a write that timed out (NATS or the event loop stalled) may have
  been applied, leaving the holder with a stale revision. So a write that timed out, or
  that names a revision that is no longer current, reads the lease back: if it is this
  edge's (same ``edge_id`` and ``instance``) its revision is adopted (and a refused write
  is made again over it); only a lease that is someone else's (or gone) is
  :class:`OwnershipLost`. A timed-out write whose read-back also fails stays
  :class:`LogUnavailable`, and the next write resolves it the same way.

Time: the holder renews while at least half the TTL is left and a taker waits ``grace``
past expiry, so clocks may disagree by up to ``grace``. Whatever the clocks, the log's
per-session expected-last-subject-sequence check refuses a write that races a takeover.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

import msgspec
from nats.js.client import JetStreamContext

from edge.settings import Clock
from eventlog.kv import Kv, KvStore
from schemas.errors import LogUnavailable, OwnershipLost, RevisionConflict, SessionOwned
from schemas.log import LogConfig

log = logging.getLogger(__name__)


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    """The value of a lease entry."""

    edge_id: str
    instance: str  # one per edge process: tells a restarted edge from its previous life
    url: str = ""
    expires: float


_decoder = msgspec.json.Decoder(Lease)


class LeaseHandle:
    """A lease this edge holds: the revision it wrote and the expiry it set.

    Its writes are serialized: the keeper's renewal and a commit's ``ensure`` may run at once,
    and each must write over the revision the other just wrote (two writes over one revision
    would make this edge refuse itself as a stale writer).
    """

    def __init__(self, leases: KvLeases, session_id: str, revision: int, expires: float) -> None:
        self._leases = leases
        self.session_id = session_id
        self.revision = revision
        self.expires = expires
        self._writing = asyncio.Lock()

    def remaining(self) -> float:
        return self.expires - self._leases.clock()

    def _due(self) -> bool:
        return self.remaining() < self._leases.ttl / 2

    async def ensure(self) -> None:
        """Renew when less than half the TTL is left; :class:`OwnershipLost` if it was taken."""
        if self._due():
            async with self._writing:
                if self._due():  # not renewed meanwhile by the write this one waited for
                    await self._write()

    async def renew(self) -> None:
        async with self._writing:
            await self._write()

    async def _write(self) -> None:
        self.revision, self.expires = await self._leases.write(self.session_id, self.revision)

    async def release(self) -> None:
        """Delete the lease (best effort: a lease that cannot be deleted lapses anyway)."""
        try:
            async with self._writing:
                await self._leases.delete(self.session_id, self.revision)
        except (OwnershipLost, LogUnavailable) as exc:
            log.info("lease of %s not released: %s", self.session_id, exc)


class KvLeases:
    """The sessions' leases in ``store`` (``LogConfig.leases_bucket`` on JetStream: :meth:`on`; any :class:`Kv`,
    the in-memory one included)."""

    def __init__(self, store: Kv, *, edge_id: str, url: str = "", ttl: float = 15.0,
                 grace: float = 2.0, clock: Clock = time.time) -> None:
        self._store = store
        self.edge_id = edge_id
        self.instance = secrets.token_hex(6)
        self.url = url
        self.ttl = ttl
        self.grace = grace
        self.clock = clock

    @classmethod
    def on(cls, js: JetStreamContext, cfg: LogConfig, *, timeout: float = 5.0, **kwargs: Any) -> KvLeases:
        """The leases in ``cfg.leases_bucket``, each call bounded by ``timeout``."""
        return cls(KvStore(js, cfg.leases_bucket, timeout=timeout), **kwargs)

    async def create(self, session_id: str) -> LeaseHandle:
        """The lease of a new session; :class:`OwnershipLost` if the id already has one."""
        revision, expires = await self.write(session_id, 0)
        return LeaseHandle(self, session_id, revision, expires)

    async def acquire(self, session_id: str) -> LeaseHandle:
        """Take the session's lease, or raise :class:`SessionOwned` while another edge holds it."""
        current, revision = await self.read(session_id)
        if current is not None and not self._may_take(current):
            raise SessionOwned(
                f"session {session_id} is served by edge {current.edge_id} ({current.url or 'no url'}); "
                f"retry after its lease lapses", retry_after=current.expires + self.grace - self.clock())
        try:
            new_revision, expires = await self.write(session_id, revision)
        except OwnershipLost as exc:  # another edge took it between our read and our write
            raise SessionOwned(f"session {session_id} was just taken by another edge",
                               retry_after=self.ttl) from exc
        if current is not None and current.instance != self.instance:
            log.info("took over session %s from edge %s", session_id, current.edge_id)
        return LeaseHandle(self, session_id, new_revision, expires)

    def _may_take(self, lease: Lease) -> bool:
        return lease.edge_id == self.edge_id or lease.expires + self.grace < self.clock()

    async def read(self, session_id: str) -> tuple[Lease | None, int]:
        """The current lease and its revision (``None, 0``: there is none)."""
        value, revision = await self._store.entry(session_id)  # (a deleted lease: its marker's revision)
        if value is None:
            return None, revision
        try:
            return _decoder.decode(value), revision
        except msgspec.DecodeError as exc:  # not written by an edge: who holds the session is unknown
            raise LogUnavailable(f"the lease entry of session {session_id} is not a lease: {exc}") from exc

    async def write(self, session_id: str, revision: int) -> tuple[int, float]:
        """Write this edge's lease over ``revision`` (0: the key must not exist); returns the new
        revision and expiry. An outcome that is unknown is resolved by reading the lease back."""
        try:
            return await self._update(session_id, revision)
        except LogUnavailable:  # timed out: it may have been applied all the same
            held = await self._held(session_id, revision)
            if held is None:
                raise
            log.info("lease of %s: a write that timed out was applied; adopting revision %d", session_id, held[0])
            return held
        except RevisionConflict as exc:
            held = await self._held(session_id, revision)
            if held is None or held[0] == revision:
                raise OwnershipLost(f"the lease of session {session_id} changed hands") from exc
            # our own earlier write, whose answer was lost: write again over it
            log.info("lease of %s: revision %d is this edge's own earlier write; adopting it", session_id, held[0])
            try:
                return await self._update(session_id, held[0])
            except RevisionConflict as again:
                raise OwnershipLost(f"the lease of session {session_id} changed hands") from again

    async def _update(self, session_id: str, revision: int) -> tuple[int, float]:
        expires = self.clock() + self.ttl
        value = msgspec.json.encode(Lease(edge_id=self.edge_id, instance=self.instance, url=self.url,
                                          expires=expires))
        return await self._store.update(session_id, value, revision), expires

    async def _held(self, session_id: str, revision: int) -> tuple[int, float] | None:
        """After a write over ``revision`` whose outcome is unknown: the stored lease's revision and
        expiry when it is this edge's; :class:`OwnershipLost` when it is someone else's (or was
        deleted since); ``None`` when nothing changed (the write was not applied)."""
        current, current_revision = await self.read(session_id)
        if current is not None and current.edge_id == self.edge_id and current.instance == self.instance:
            return current_revision, current.expires
        if current_revision == revision:
            return None
        raise OwnershipLost(f"the lease of session {session_id} changed hands")

    async def delete(self, session_id: str, revision: int) -> None:
        try:
            await self._store.delete(session_id, revision)
        except RevisionConflict as exc:
            held = await self._held(session_id, revision)  # a stale revision of our own: delete over the stored one
            if held is None or held[0] == revision:
                raise OwnershipLost(f"the lease of session {session_id} changed hands") from exc
            try:
                await self._store.delete(session_id, held[0])
            except RevisionConflict as again:
                raise OwnershipLost(f"the lease of session {session_id} changed hands") from again
