"""Housekeeping for the sessions an edge writes: busy leases, idle sessions, orphans.

Every tick (a third of the lease TTL, a quarter of the idle timeout, at most 30 s) the
keeper looks at the sessions this edge holds live:

* a session with a request in flight whose lease has less than half its TTL left gets it
  renewed, so a long generation keeps its session (a lease that changed hands marks the
  session lost: :meth:`edge.live.LiveSession.lose`);
* a session that nothing touched (no request, no commit) for ``idle_timeout`` seconds is
  aborted with ``SessionAborted(reason="idle_timeout")``, which drops its live state (its
  token buffers) and deletes its lease.

Every sweep (half the idle timeout) it also looks for *orphans*: sessions the projections
list as open and untouched for the idle timeout, held by no live edge (their edge died,
and no agent came back). It takes each over and aborts it the same way. A session whose
lease was written within the idle timeout is left alone (its edge may be busy with it),
and one that turns out to be active once loaded is let go again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable

from edge.live import Clock, LiveSession
from edge.ownership import KvLeases
from edge.service import EdgeService
from schemas.errors import LogUnavailable, OwnershipLost, RollbusError, SessionClosed, SessionNotFound, SessionOwned
from schemas.log import ProjectionHead

log = logging.getLogger(__name__)

Orphans = Callable[[], AsyncIterator[ProjectionHead]]
IDLE_TIMEOUT = "idle_timeout"
_SKIP = (SessionOwned, SessionClosed, SessionNotFound, OwnershipLost, LogUnavailable)


class SessionKeeper:
    def __init__(self, service: EdgeService, *, idle_timeout: float, leases: KvLeases | None = None,
                 orphans: Orphans | None = None, clock: Clock = time.time) -> None:
        self._service = service
        self._registry = service.registry
        self._idle_timeout = idle_timeout
        self._leases = leases
        self._orphans = orphans
        self._clock = clock
        ttl = leases.ttl if leases is not None else math.inf
        self.tick_s = max(0.05, min(ttl / 3, idle_timeout / 4 if idle_timeout > 0 else math.inf, 30.0))
        self.sweep_s = max(self.tick_s, idle_timeout / 2)
        self.aborted = 0  # sessions aborted for idleness by this keeper

    async def run(self, stop: asyncio.Event) -> None:
        next_sweep = self._clock() + self.sweep_s
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.tick_s)
            if stop.is_set():
                return
            try:
                await self.tick()
                if self._orphans is not None and self._idle_timeout > 0 and self._clock() >= next_sweep:
                    next_sweep = self._clock() + self.sweep_s
                    await self.sweep()
            except RollbusError as exc:  # NATS away for a while: try again next tick
                log.warning("session keeper: %s", exc)

    async def tick(self) -> None:
        for live in self._registry.live_sessions():
            if live.active:
                await self._keep(live)
            elif self._idle_timeout > 0 and live.idle_for() >= self._idle_timeout:
                await self._abort(live.session_id)

    async def _keep(self, live: LiveSession) -> None:
        lease = live.lease
        if lease is None or self._leases is None or lease.remaining() >= self._leases.ttl / 2:
            return
        try:
            await lease.renew()
        except OwnershipLost:
            log.warning("session %s: lease taken by another edge during a request", live.session_id)
            live.lose()
        except LogUnavailable as exc:
            log.warning("session %s: lease not renewed: %s", live.session_id, exc)

    async def _abort(self, session_id: str) -> None:
        try:
            if await self._service.abort_if_idle(session_id, self._idle_timeout, IDLE_TIMEOUT):
                self.aborted += 1
                log.info("session %s aborted: idle for %.0fs", session_id, self._idle_timeout)
        except _SKIP as exc:
            log.info("session %s not aborted for idleness: %s", session_id, exc)
        except RollbusError as exc:
            log.warning("session %s: idle abort failed: %s", session_id, exc)

    async def sweep(self) -> int:
        """Abort idle orphans; returns how many (none when the keeper was given no ``orphans``)."""
        if self._orphans is None:
            return 0
        before = self.aborted
        candidates = [head.session_id async for head in self._orphans() if self._orphaned(head)]
        for session_id in candidates:
            if self._registry.holds(session_id) or not await self._lease_quiet(session_id):
                continue
            await self._abort(session_id)
            taken = self._registry.peek(session_id)
            if taken is not None and not taken.active:  # not idle after all: let it go again
                await self._registry.drop(session_id)
        return self.aborted - before

    def _orphaned(self, head: ProjectionHead) -> bool:
        return (head.status == "open" and not self._registry.holds(head.session_id)
                and self._clock() - head.updated_at >= self._idle_timeout)

    async def _lease_quiet(self, session_id: str) -> bool:
        """No edge wrote the session's lease within the idle timeout."""
        if self._leases is None:
            return True
        try:
            lease, _ = await self._leases.read(session_id)
        except LogUnavailable:
            return False
        return lease is None or self._clock() - (lease.expires - self._leases.ttl) >= self._idle_timeout
