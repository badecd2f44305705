"""The edge's metrics (:class:`EdgeMetrics`, a group of :class:`observability.registry.Metrics`), and the
engine and the log timed (:class:`TimedEngine`, :class:`TimedLog`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence

from prometheus_client import Counter, Gauge

from edge.engines.base import Engine, GenerateChunk, GenerateRequest, GenerateResult
from eventlog.publisher import Appended, EventLog
from observability.registry import HotPath, Metrics, Tallied, Tally, Timings
from schemas.errors import RollbusError
from schemas.events import Event

# rollbus_turns_total's status label
OK, REFUSED, ENGINE_ERROR, ABANDONED = "ok", "refused", "engine_error", "abandoned"


class EdgeMetrics:
    """The edge's metrics (HTTP, sessions, turns, tokens, engine and log latency, replays, rollbacks); those
    every request updates are :class:`Tally` and :class:`Timings`."""

    def __init__(self, metrics: Metrics) -> None:
        registry = metrics.registry
        self.http_requests = Tally("rollbus_http_requests_total", "HTTP requests by route and status",
                                   ("route", "status"))
        self.http_seconds = Timings("rollbus_http_request_seconds", "HTTP request latency in seconds")
        self.turns = Tally("rollbus_turns_total", "Model turns by wire, finish reason and status (ok, refused: "
                           "no room left in the chain, engine_error, abandoned: the client left)",
                           ("wire", "finish_reason", "status"))
        self.input_tokens = Tally("rollbus_input_tokens_total", "Prompt tokens of completed turns (the whole "
                                  "chain so far, each turn), by wire", ("wire",))
        self.output_tokens = Tally("rollbus_output_tokens_total", "Tokens the engine sampled in completed turns, "
                                   "by wire", ("wire",))
        self.engine_seconds = Timings("rollbus_engine_seconds", "Engine calls' latency in seconds, to the end of "
                                      "the generation (streamed or not)")
        self.log_append_seconds = Timings("rollbus_log_append_seconds", "Appends to the event log in seconds, "
                                          "until JetStream acknowledged them")
        registry.register(HotPath([self.http_requests, self.http_seconds, self.turns, self.input_tokens,
                                   self.output_tokens, self.engine_seconds, self.log_append_seconds]))
        self.sessions_open = Gauge("rollbus_sessions_open", "Sessions open on this edge", registry=registry)
        self.idempotent_replays = Counter("rollbus_idempotent_replays_total", "Repeated requests answered from "
                                          "the log (the engine not called), by wire", ("wire",), registry=registry)
        self.rollbacks = Counter("rollbus_rollbacks_total", "Rewritten last assistant turns rolled back (their "
                                 "sampled tokens dropped from the chain)", registry=registry)
        self.forks = Counter("rollbus_chain_forks_total", "Chains started after a session's first, by the cause of "
                             "the fork (sibling, sub_agent, history_compacted, ...: edge.forks)", ("cause",),
                             registry=registry)
        self._turn_children: dict[tuple[str, str, str], tuple[Tallied, Tallied, Tallied]] = {}

    def turn(self, wire: str, finish_reason: str, status: str, input_tokens: int = 0, output_tokens: int = 0) -> None:
        """Count a turn (and its tokens); the children of each label set are kept."""
        key = (wire, finish_reason, status)
        children = self._turn_children.get(key)
        if children is None:
            children = self._turn_children[key] = (self.turns.labels(*key), self.input_tokens.labels(wire),
                                                    self.output_tokens.labels(wire))
        children[0].value += 1.0
        children[1].value += input_tokens
        children[2].value += output_tokens

    def replayed(self, wire: str) -> None:
        self.idempotent_replays.labels(wire).inc()


class TimedLog:
    """An :class:`EventLog` whose appends are timed (``rollbus_log_append_seconds``); a failed append is
    counted in ``rollbus_failures_total{component="edge"}`` by its error's type."""

    def __init__(self, inner: EventLog, metrics: Metrics) -> None:
        self.inner = inner
        self._seconds = metrics.group(EdgeMetrics).log_append_seconds
        self._failures = metrics.failures

    def __getattr__(self, name: str) -> object:  # ``close`` and the rest of the wrapped log
        return getattr(self.inner, name)

    async def append(self, session_id: str, events: Sequence[Event], expected_last: int) -> Appended:
        started = time.perf_counter()
        try:
            return await self.inner.append(session_id, events, expected_last)
        except RollbusError as exc:
            self._failures.labels("edge", _snake(type(exc).__name__)).inc()
            raise
        finally:
            self._seconds.observe(time.perf_counter() - started)


    async def put_pieces(self, session_id: str, pieces: Mapping[bytes, bytes]) -> None:
        await self.inner.put_pieces(session_id, pieces)


class TimedEngine:
    """An :class:`Engine` whose calls are timed to their result (``rollbus_engine_seconds``; a call that
    fails is counted in ``rollbus_turns_total{status="engine_error"}`` instead)."""

    def __init__(self, inner: Engine, metrics: Metrics) -> None:
        self.inner = inner
        self.name = inner.name
        self._seconds = metrics.group(EdgeMetrics).engine_seconds

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        started = time.perf_counter()
        result = await self.inner.generate(request)
        self._seconds.observe(time.perf_counter() - started)
        return result

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk | GenerateResult]:
        started = time.perf_counter()
        iterator = self.inner.stream(request)
        try:
            async for item in iterator:
                if isinstance(item, GenerateResult):
                    self._seconds.observe(time.perf_counter() - started)
                yield item
        finally:
            closing = getattr(iterator, "aclose", None)
            if closing is not None:
                await closing()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _snake(name: str) -> str:
    """``LogUnavailable`` -> ``log_unavailable`` (an error class's name, a bounded label value)."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")
