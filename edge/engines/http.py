"""What the HTTP engine clients (SGLang, vLLM) share: placement, health, retries, aborts, errors.

One pooled ``httpx2.AsyncClient`` talks to one or more servers. Each subclass names its
protocol's endpoints and decodes its replies (an :class:`Assembler` folds one reply, or a
stream of SSE events, into a :class:`GenerateResult`); everything else lives here.

httpx2 is pydantic's maintained fork of httpx, the one the official openai and anthropic SDKs
use. httpx's own pool (httpcore 1.0.9, its last release) probes every idle connection's socket and,
for each idle connection, counts them all again, on every request and every answer: with K turns in
flight its cost grows with K. ``ops/bench/engine_pool.py``, client CPU a request with the edge's pool
settings: httpx2 takes 0.93x / 0.57x / 0.31x of httpx's at K = 1 / 16 / 64 (3.8 ms a request at 64 on
httpx, more than the rest of an edge turn).

**Placement** (:mod:`edge.engines.pool`): a session is placed on the least-loaded healthy
server at its first request and sticks there; a session whose server is unhealthy is
re-placed at its next request.

**Health**: from the first call on, a background task probes every server's
``GET /health`` every ``health_interval`` seconds (each probe bounded by
``health_timeout``); a server that fails ``unhealthy_after`` probes in a row (default 2,
so one slow probe under load does not drain a busy server) gets no new sessions until a
probe sees it healthy again. A refused connection marks the server unhealthy at once.

**Retries**, bounded and only where no token can have reached the agent: a request whose
connection was refused (or whose connect timed out) never reached the server, so it is
retried **once**, on another healthy server (the session is re-placed there). A request
whose connection the server closed before its reply was whole (``Dropped``: above all a
pooled keep-alive connection the server closed just as the request went out, a race every
client of uvicorn-served engines meets) is retried **once**, on a fresh connection, when no
part of it was streamed yet; pooled connections are kept ``KEEPALIVE_S`` (2 s), below the 5 s
after which SGLang's and vLLM's servers (uvicorn) close them, so the race is rare. Nothing
else is retried: not a timeout once the request was sent, not a 5xx, not a malformed
reply, and never after a token was streamed; those reach the agent as 502/503/504 and
the agent may retry the turn (the chain is left as it was).

**Timeouts**: ``timeout`` bounds each wait for the engine (the connection aside: its
reply's headers, each next byte or streamed event); ``deadline`` bounds one whole call
(``generate``, or a whole ``stream``, its retry included) from its start: past either,
``EngineTimeout``. The per-read wait alone would let an engine that sends a byte, or a
streamed event, just inside it each time hold the turn for as long as it trickles; the
deadline alone would make a server that never answers wait as long as the longest
generation may take. The deadline cancels only a wait for the engine, never the stream's reader.

**Aborts**: a call that does not end with a complete reply after its request was sent
(the awaiting task was cancelled because the agent went away, a stream was closed
early, a read timed out or the deadline passed, the reply failed) is aborted on its
server in the background, best effort, bounded by ``abort_timeout``, so the server stops generating for nobody.

**Errors** are converted here, once: refused connections and 503 become
``EngineUnavailable``, timeouts and 504 ``EngineTimeout``, a 400 (the server refusing the
input, e.g. longer than the model's context) ``EngineRefused`` carrying the server's own
message (at most ``REFUSAL_CHARS`` characters; answered 400 to the agent, which the SDKs do
not retry), everything else (other
statuses, bodies that do not decode, missing fields, log probs that do not line up with
the tokens) ``EngineError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import httpx2

from edge.engines.base import GenerateChunk, GenerateRequest, GenerateResult
from edge.engines.pool import DEFAULT_MAX_SESSIONS, ServerPool, session_of
from schemas.errors import Dropped, EngineError, EngineRefused, EngineTimeout, EngineUnavailable, Refused

log = logging.getLogger(__name__)
_T = TypeVar("_T")

JSON_HEADERS = {"content-type": "application/json"}
MIN_HEALTH_INTERVAL, MAX_HEALTH_INTERVAL = 0.05, 60.0
REFUSAL_CHARS = 1000  # how much of an engine's refusal message reaches the agent


KEEPALIVE_S = 2.0  # how long an idle pooled connection is reused (the engines' servers close theirs after 5 s)


class Assembler(Protocol):
    """Folds one protocol's replies (one for ``generate``, SSE events for ``stream``) into a result."""

    def feed(self, data: bytes | str) -> GenerateChunk | None: ...

    def result(self) -> GenerateResult: ...


@dataclass(frozen=True)
class Call:
    """One HTTP request: its URL and JSON body."""

    url: str
    body: bytes


class HttpEngine:
    """Base of the HTTP engine clients; subclasses implement the ``_``-hooks below."""

    name = "http"
    label = "engine"  # how errors name the server's software
    # failures that started nothing: no abort
    _quiet_errors: tuple[type[BaseException], ...] = (Refused, EngineRefused)

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout: float = 300.0,
        deadline: float = 1800.0,
        connect_timeout: float = 5.0,
        health_interval: float = 5.0,
        health_timeout: float = 5.0,
        unhealthy_after: int = 2,
        abort_timeout: float = 5.0,
        max_connections: int = 256,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
    ) -> None:
        if not urls:
            raise ValueError(f"{type(self).__name__} needs at least one server URL")
        self.pool = ServerPool(urls, max_sessions=max_sessions)
        self.urls = self.pool.urls
        self._health_interval = min(MAX_HEALTH_INTERVAL, max(MIN_HEALTH_INTERVAL, health_interval))
        self._health_timeout = health_timeout
        self._unhealthy_after = max(1, unhealthy_after)
        self._failed_probes = dict.fromkeys(self.urls, 0)
        self._abort_timeout = abort_timeout
        self._deadline = deadline
        self._client = httpx2.AsyncClient(
            timeout=httpx2.Timeout(timeout, connect=connect_timeout),
            limits=httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=KEEPALIVE_S),
        )
        self._prober: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()

    # --- protocol hooks -------------------------------------------------------------

    def _generate_call(self, url: str, request: GenerateRequest, *, stream: bool) -> Call:
        raise NotImplementedError

    def _assembler(self, url: str, request: GenerateRequest) -> Assembler:
        raise NotImplementedError

    def _abort_call(self, url: str, request_id: str) -> Call | None:
        """The request that aborts ``request_id`` on ``url`` (``None``: the protocol has none)."""
        return None

    def _check(self, response: httpx2.Response, url: str) -> None:
        """Raise for a status that is not success (the body has been read)."""
        raise_for_status(response, self.label, url)

    # --- the Engine protocol --------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._ensure_prober()
        session = session_of(request.request_id)
        async with self._within(asyncio.get_running_loop().time() + self._deadline):
            for retry in (True, False):
                url = self.pool.acquire(session)
                try:
                    return await self._generate_on(url, request)
                except Refused as exc:
                    self._refused(url, retry, exc)
                except Dropped as exc:
                    self._dropped(url, retry, exc)
                finally:
                    self.pool.release(url)
        raise AssertionError("unreachable")

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk | GenerateResult]:
        self._ensure_prober()
        session = session_of(request.request_id)
        watch = _Watch(self._deadline)  # the whole stream's deadline, its retry included
        try:
            for retry in (True, False):
                url = self.pool.acquire(session)
                streamed = False
                try:
                    async with contextlib.aclosing(self._stream_on(url, request)) as items:
                        while True:  # ``async for``, each read under the deadline (inline: per event, it counts)
                            if watch.expired:
                                raise self._late()
                            watch.waiting = True
                            try:
                                item = await items.__anext__()
                            except StopAsyncIteration:
                                break
                            except asyncio.CancelledError:
                                watch.raise_if_expired(self._late)
                                raise
                            finally:
                                watch.waiting = False
                            streamed = True
                            yield item
                    return
                except Refused as exc:  # raised while connecting: nothing was streamed yet
                    self._refused(url, retry, exc)
                except Dropped as exc:
                    self._dropped(url, retry and not streamed, exc)
                finally:
                    self.pool.release(url)
        finally:
            watch.close()

    async def abort(self, request_id: str) -> None:
        """Ask the server of ``request_id``'s session (else every server) to stop it."""
        placed = self.pool.server_of(session_of(request_id))
        for url in [placed] if placed else self.urls:
            call = self._abort_call(url, request_id)
            if call is not None:
                with self._converted(url):
                    response = await self._client.post(call.url, content=call.body, headers=JSON_HEADERS)
                self._check(response, url)

    async def probe(self) -> dict[str, bool]:
        """Probe every server's ``/health`` now and update the pool; returns what each answered."""
        results = await asyncio.gather(*(self._probe_one(url) for url in self.urls))
        for url, answered in zip(self.urls, results, strict=True):
            self._failed_probes[url] = 0 if answered else self._failed_probes[url] + 1
            healthy = answered or (self.pool.is_healthy(url) and self._failed_probes[url] < self._unhealthy_after)
            if healthy != self.pool.is_healthy(url):
                log.warning("%s server %s is now %s", self.label, url, "healthy" if healthy else "unhealthy")
            self.pool.set_health(url, healthy)
        return dict(zip(self.urls, results, strict=True))

    async def health(self) -> bool:
        """True when every server answers ``GET /health`` with 200."""
        return all((await self.probe()).values())

    async def aclose(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.gather(self._prober, return_exceptions=True)
        if self._background:
            await asyncio.wait(self._background, timeout=self._abort_timeout)
        await self._client.aclose()

    # --- one call on one server -----------------------------------------------------

    async def _generate_on(self, url: str, request: GenerateRequest) -> GenerateResult:
        call = self._generate_call(url, request, stream=False)
        try:
            with self._converted(url):
                response = await self._client.post(call.url, content=call.body, headers=JSON_HEADERS)
            self._check(response, url)
            assembler = self._assembler(url, request)
            assembler.feed(response.content)
            return assembler.result()
        except self._quiet_errors:
            raise
        except BaseException:
            self._abort_soon(url, request.request_id)
            raise

    async def _stream_on(self, url: str, request: GenerateRequest) -> AsyncIterator[GenerateChunk | GenerateResult]:
        call = self._generate_call(url, request, stream=True)
        assembler = self._assembler(url, request)
        try:
            with self._converted(url):
                async with self._client.stream("POST", call.url, content=call.body, headers=JSON_HEADERS) as response:
                    if response.status_code != 200:
                        await response.aread()
                        self._check(response, url)
                    async for data in sse_data(response.aiter_lines()):
                        chunk = assembler.feed(data)
                        if chunk is not None:
                            yield chunk
            result = assembler.result()
        except self._quiet_errors:
            raise
        except BaseException:  # also GeneratorExit (closed early) and CancelledError
            self._abort_soon(url, request.request_id)
            raise
        yield result

    # --- helpers --------------------------------------------------------------------

    def _refused(self, url: str, retry: bool, exc: Refused) -> None:
        """Mark ``url`` unhealthy; raise unless the request may be retried on another server."""
        self.pool.set_health(url, False)
        log.warning("%s server %s refused a connection; marked unhealthy", self.label, url)
        if not retry or not self.pool.healthy():
            raise EngineUnavailable(f"{exc.message}; no other healthy server to retry on") from exc

    def _dropped(self, url: str, retry: bool, exc: Dropped) -> None:
        """Log the retry of a dropped request; raise ``exc`` when it may not be retried."""
        if not retry:
            raise exc
        log.info("%s server %s closed the connection before its reply; retrying on a fresh one", self.label, url)

    @contextlib.asynccontextmanager
    async def _within(self, deadline: float) -> AsyncIterator[None]:
        """``EngineTimeout`` when the block is still waiting at ``deadline`` (the loop's clock): the bound on
        a whole call, which httpx's timeout (one read at a time) is not."""
        scope = asyncio.timeout_at(deadline)
        try:
            async with scope:
                yield
        except TimeoutError as exc:
            if not scope.expired():
                raise
            raise self._late() from exc

    def _late(self) -> EngineTimeout:
        return EngineTimeout(f"{self.label} did not complete its reply within {self._deadline:g} s")

    @contextlib.contextmanager
    def _converted(self, url: str) -> Iterator[None]:
        """The one place httpx errors become engine errors."""
        try:
            yield
        except (httpx2.ConnectError, httpx2.ConnectTimeout) as exc:
            raise Refused(f"{self.label} at {url} is unreachable: {exc!r}") from exc
        except httpx2.TimeoutException as exc:
            raise EngineTimeout(f"{self.label} at {url} timed out: {exc!r}") from exc
        except httpx2.RemoteProtocolError as exc:
            raise Dropped(f"{self.label} at {url} closed the connection before its reply: {exc!r}") from exc
        except httpx2.HTTPError as exc:
            raise EngineError(f"{self.label} at {url} failed: {exc!r}") from exc

    def _abort_soon(self, url: str, request_id: str) -> None:
        call = self._abort_call(url, request_id)
        if call is None:
            return
        task = asyncio.get_running_loop().create_task(self._send_abort(call))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_abort(self, call: Call) -> None:
        try:
            await self._client.post(call.url, content=call.body, headers=JSON_HEADERS, timeout=self._abort_timeout)
        except (httpx2.HTTPError, RuntimeError) as exc:  # best effort: the request may be gone, the client closed
            log.info("%s abort %s failed: %r", self.label, call.url, exc)

    def _ensure_prober(self) -> None:
        if self._prober is None or self._prober.done():
            self._prober = asyncio.get_running_loop().create_task(self._probe_forever())

    async def _probe_forever(self) -> None:
        while True:
            await self.probe()
            await asyncio.sleep(self._health_interval)

    async def _probe_one(self, url: str) -> bool:
        try:
            response = await self._client.get(f"{url}/health", timeout=self._health_timeout)
        except httpx2.HTTPError:
            return False
        return response.status_code == 200


class _Watch:
    """A stream's deadline, for the task that reads it: one timer for the whole stream, where
    ``asyncio.timeout`` around each read costs a timer per event (13-21 us an event on this loaded VM,
    against 0.3-0.5 us without; this, inline, 0.2-0.6 us more). Past the deadline a read that is
    ``waiting`` is cancelled (:meth:`raise_if_expired` makes that an ``EngineTimeout``), and the reader,
    seeing ``expired``, begins no other; the reader is never cancelled between reads."""

    __slots__ = ("_cancelling", "_handle", "_task", "expired", "waiting")

    def __init__(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._cancelling = task.cancelling()
        self.waiting = False
        self.expired = False
        self._handle = loop.call_at(loop.time() + timeout, self._expire)

    def _expire(self) -> None:
        self.expired = True
        if self.waiting:
            self._task.cancel()

    def raise_if_expired(self, late: Callable[[], EngineTimeout]) -> None:
        """On a read's ``CancelledError``: raise ``late()`` in its place when the deadline cancelled it (and
        nothing else did), as ``asyncio.timeout`` tells its own cancellation from another's."""
        if self.expired and self._task.uncancel() <= self._cancelling:
            raise late() from None

    def close(self) -> None:
        self._handle.cancel()


def raise_for_status(response: httpx2.Response, label: str, url: str) -> None:
    """Raise for a status other than 200 (``label``: the server's software, ``url``: the server)."""
    if response.status_code == 200:
        return
    if response.status_code == 400:  # the agent is told the engine's words, not where the engine is
        raise EngineRefused(refusal(label, error_message(response)))
    message = f"{label} at {url} answered {response.status_code}: {response.text[:500]}"
    if response.status_code == 503:
        raise EngineUnavailable(message)
    if response.status_code == 504:
        raise EngineTimeout(message)
    raise EngineError(message)


def error_message(response: httpx2.Response) -> str:
    """The message of an error body: ``{"error": {"message"}}`` (SGLang, vLLM), ``{"message"}`` (older
    vLLM), ``{"detail"}`` (FastAPI); else the body's text."""
    try:
        body = response.json()
    except ValueError:
        return response.text
    if isinstance(body, dict):
        error = body.get("error")
        for found in (error.get("message") if isinstance(error, dict) else error, body.get("message"),
                      body.get("detail")):
            if isinstance(found, str) and found:
                return found
    return response.text


def refusal(label: str, message: str) -> str:
    """What the agent is told when ``label`` (the engine) refused its input, bounded."""
    message = " ".join(message.split()) or "no message"
    if len(message) > REFUSAL_CHARS:
        message = message[: REFUSAL_CHARS - 3] + "..."
    return f"{label} refused the request: {message}"


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The payloads of ``data:`` lines, up to ``[DONE]``."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield data


def new_items(items: list[_T], seen: int, total: int, what: str, label: str) -> list[_T]:
    """The items not seen yet, whether ``items`` is cumulative or a delta (``total``: the count so far)."""
    if len(items) == total and total >= seen:
        return items[seen:]
    if seen + len(items) == total:
        return items
    raise EngineError(f"{label} sent {len(items)} {what} after {seen}, but the count so far is {total}")


__all__ = [
    "JSON_HEADERS",
    "Assembler",
    "Call",
    "HttpEngine",
    "error_message",
    "new_items",
    "raise_for_status",
    "refusal",
    "sse_data",
]
