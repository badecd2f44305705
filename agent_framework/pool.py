"""The edge pool: where sessions are opened, and the admin calls that open and end them.

New sessions go to the edge with the fewest sessions in flight, reserved before the open is
awaited (so a burst spreads out), and stay on it: the URLs an agent gets name that edge, and
its finalize and abort go there too. Opening is retried on the next edge when one does not
answer or answers 5xx/429; nothing else is retried.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    RetryError,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from agent_framework.session import SessionHandle
from schemas.errors import EdgeError

log = logging.getLogger(__name__)

_RETRIABLE = {429, 500, 502, 503, 504}


class Placement:
    """A session's edge, held until the session ends (``release``)."""

    def __init__(self, pool: EdgePool, index: int) -> None:
        self.pool = pool
        self.index = index
        self._released = False

    @property
    def url(self) -> str:
        return self.pool.urls[self.index]

    def move(self, index: int) -> None:
        self.pool.active[self.index] -= 1
        self.index = index
        self.pool.active[index] += 1

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.pool.active[self.index] -= 1


class EdgePool:
    def __init__(self, urls: Sequence[str], admin_token: str, *, timeout: float = 60.0,
                 open_attempts: int = 3) -> None:
        if not urls:
            raise ValueError("an edge pool needs at least one edge")
        self.urls = list(urls)
        self.active = [0] * len(self.urls)
        self._headers = {"Authorization": f"Bearer {admin_token}"}
        # Idle connections are dropped (after 2 s) long before the edge closes an idle keep-alive
        # connection (granian: after its header read timeout, 30 s by default), so a request never
        # goes out on a connection the server is closing.
        self._client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=256,
                                                                              keepalive_expiry=2.0))
        self._attempts = open_attempts

    def reserve(self) -> Placement:
        index = min(range(len(self.urls)), key=self.active.__getitem__)
        self.active[index] += 1
        return Placement(self, index)

    async def open(self, placement: Placement, spec: dict[str, Any]) -> SessionHandle:
        """``POST /sessions`` on the placement's edge, moving to the next edge on a retriable failure."""

        def next_edge(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome is not None else None
            log.warning("opening a session on %s failed (%s); attempt %d of %d", placement.url, exc,
                        state.attempt_number, self._attempts)
            placement.move((placement.index + 1) % len(self.urls))

        try:
            async for attempt in self._retrying(before_sleep=next_edge, reraise=False):
                with attempt:
                    body = await self._post(placement.url, "/sessions", spec, expect=201)
        except RetryError as exc:
            error = exc.last_attempt.exception()
            raise EdgeError(f"no edge opened the session after {self._attempts} attempts: {error}",
                            retriable=True) from error
        return SessionHandle(session_id=body["session_id"], base_url=body["base_url"],
                             anthropic_base_url=body["anthropic_base_url"], reward_url=body["reward_url"],
                             api_key=body["api_key"])

    async def finalize(self, placement: Placement, session_id: str) -> dict[str, Any]:
        return await self._end(placement, f"/sessions/{session_id}/finalize", None)

    async def abort(self, placement: Placement, session_id: str, reason: str) -> dict[str, Any]:
        return await self._end(placement, f"/sessions/{session_id}/abort", {"reason": reason[:1000]})

    async def _end(self, placement: Placement, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """Finalize or abort on the session's own edge (both are idempotent, so a retry is safe)."""
        result: dict[str, Any] = await self._retrying(reraise=True)(self._post, placement.url, path, body)
        return result

    def _retrying(self, **kwargs: Any) -> AsyncRetrying:
        """Up to ``open_attempts`` tries of a call that raises a retriable :class:`EdgeError`, 0.2 s, 0.4 s, ...
        apart; another error is raised at once."""
        return AsyncRetrying(stop=stop_after_attempt(self._attempts), wait=wait_exponential(multiplier=0.2),
                             retry=retry_if_exception(lambda exc: isinstance(exc, EdgeError) and exc.retriable),
                             **kwargs)

    async def _post(self, base: str, path: str, body: dict[str, Any] | None, *, expect: int = 200) -> dict[str, Any]:
        try:
            response = await self._client.post(base + path, json=body, headers=self._headers)
        except httpx.HTTPError as exc:
            raise EdgeError(f"{base}{path}: {exc!r}", retriable=True) from exc
        if response.status_code != expect:
            raise EdgeError(f"{base}{path}: {response.status_code} {response.text[:300]}",
                            retriable=response.status_code in _RETRIABLE)
        result: dict[str, Any] = response.json()
        return result

    async def aclose(self) -> None:
        await self._client.aclose()
