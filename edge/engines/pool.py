"""Placement of sessions on engine servers: pure state, no I/O, no clock.

Rules (shared by the SGLang and vLLM clients):

* A session is placed at its first request and remembered: its later requests go to
  the same server, so the server's prefix cache (SGLang's radix cache, vLLM's automatic
  prefix caching) keeps the conversation warm.
* A new session goes to the least-loaded healthy server: fewest requests in flight,
  then fewest sessions placed on it, then the order the servers were given.
* A server marked unhealthy (a failed ``/health`` probe, or a refused connection)
  receives no new sessions. A session placed on it is **re-placed at its next
  request** on a healthy server: the chain's tokens live in the log and every request
  carries the whole context, so the new server only loses the cached prefix.
* With no healthy server at all, :meth:`ServerPool.acquire` raises
  :class:`~schemas.errors.EngineUnavailable` (503: the agent may retry).
* The remembered placements are bounded (least recently used are forgotten first); a
  forgotten session is simply placed again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from schemas.errors import EngineUnavailable

DEFAULT_MAX_SESSIONS = 100_000


def session_of(request_id: str) -> str:
    """The session part of an engine request id ``"<session_id>:<request_no>"``."""
    return request_id.rsplit(":", 1)[0]


class ServerPool:
    """Which server each session uses, which servers are healthy, how loaded each one is."""

    def __init__(self, urls: Sequence[str], *, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        if not urls:
            raise ValueError("a server pool needs at least one server URL")
        self.urls: tuple[str, ...] = tuple(dict.fromkeys(url.rstrip("/") for url in urls))
        self._max_sessions = max(1, max_sessions)
        self._healthy = dict.fromkeys(self.urls, True)
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._placed = dict.fromkeys(self.urls, 0)
        self._sessions: OrderedDict[str, str] = OrderedDict()

    # --- queries --------------------------------------------------------------------

    def healthy(self) -> tuple[str, ...]:
        return tuple(url for url in self.urls if self._healthy[url])

    def is_healthy(self, url: str) -> bool:
        return self._healthy[url]

    def in_flight(self, url: str) -> int:
        return self._in_flight[url]

    def sessions_on(self, url: str) -> int:
        return self._placed[url]

    def server_of(self, session: str) -> str | None:
        """Where ``session`` is placed now (``None``: not placed, or forgotten)."""
        return self._sessions.get(session)

    # --- placement ------------------------------------------------------------------

    def acquire(self, session: str) -> str:
        """The server for the session's next request, counted in flight until :meth:`release`."""
        url = self._sessions.get(session)
        if url is None or not self._healthy[url]:
            url = self._place(session)
        else:
            self._sessions.move_to_end(session)
        self._in_flight[url] += 1
        return url

    def release(self, url: str) -> None:
        self._in_flight[url] = max(0, self._in_flight[url] - 1)

    def set_health(self, url: str, healthy: bool) -> None:
        self._healthy[url] = healthy

    def _place(self, session: str) -> str:
        candidates = self.healthy()
        if not candidates:
            raise EngineUnavailable(f"no healthy engine server among {', '.join(self.urls)}")
        url = min(candidates, key=lambda u: (self._in_flight[u], self._placed[u], self.urls.index(u)))
        self._forget(session)
        self._sessions[session] = url
        self._placed[url] += 1
        while len(self._sessions) > self._max_sessions:
            self._forget(next(iter(self._sessions)))
        return url

    def _forget(self, session: str) -> None:
        previous = self._sessions.pop(session, None)
        if previous is not None:
            self._placed[previous] -= 1


__all__ = ["DEFAULT_MAX_SESSIONS", "ServerPool", "session_of"]
