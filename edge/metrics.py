"""The process's Prometheus metrics, with ``prometheus-client``, in a registry of the process's own.

One :class:`Metrics` per stack (``rollbus up`` shares it between the edge, the projector and the
materializer, so the edge's ``GET /metrics`` shows all three; a component run alone serves its
own on ``--metrics-port``). Each component's metrics are created when it asks for its group
(:attr:`Metrics.edge`, :attr:`Metrics.projector`, :attr:`Metrics.materializer`), so a process
exposes only what it runs. Several stacks in one process (tests) never share a registry.

What every model request updates (HTTP requests and latency, turns, tokens, engine and append
latency) is kept as plain numbers (:class:`Tally`, :class:`Timings`, children kept per label set)
that prometheus-client collects at scrape (:class:`HotPath`, a custom collector): an update is a
float add, where a prometheus-client ``Counter.inc`` or ``Histogram.observe`` takes a lock and
costs ~10x more (``ops/bench/metrics_cost.py``). The rest are prometheus-client's own metric
types. Label values are bounded sets (wires, finish reasons, statuses, reasons named in code),
never a client's text.

:func:`watch_lag` samples the JetStream consumers' lag every few seconds into
``rollbus_consumer_pending_messages`` and ``rollbus_consumer_lag_seconds``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

from nats.js.client import JetStreamContext
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from edge.engines.base import Engine, GenerateChunk, GenerateRequest, GenerateResult
from edge.settings import LAG_INTERVAL_S
from eventlog.lag import Watched, consumer_lag
from eventlog.publisher import Appended, EventLog
from schemas.errors import RollbusError
from schemas.events import Event
from schemas.log import COMPONENTS

log = logging.getLogger(__name__)

G = TypeVar("G")

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# rollbus_turns_total's status label
OK, REFUSED, ENGINE_ERROR, ABANDONED = "ok", "refused", "engine_error", "abandoned"


class Tally:
    """A counter family the hot path keeps as plain numbers, one per label set (:meth:`labels` gives a
    kept :class:`Tallied`, whose ``inc`` is one float add); prometheus-client exposes it at scrape
    (:class:`HotPath`). A prometheus-client ``Counter`` costs ~10x more an update (a lock, checks)."""

    __slots__ = ("children", "help", "labelnames", "name")

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name.removesuffix("_total")
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self.children: dict[tuple[str, ...], Tallied] = {}

    def labels(self, *values: str) -> Tallied:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} has labels {self.labelnames}, got {values}")
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = Tallied()
        return child

    def inc(self, amount: float = 1.0) -> None:
        """An unlabelled tally's add."""
        self.labels().inc(amount)

    def family(self) -> CounterMetricFamily:
        family = CounterMetricFamily(self.name, self.help, labels=self.labelnames)
        for values, child in self.children.items():
            family.add_metric(values, child.value)
        return family


class Tallied:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Timings:
    """A latency histogram the hot path keeps as bucket counts (``observe``: one bisect, two adds), exposed
    by prometheus-client at scrape (:class:`HotPath`)."""

    __slots__ = ("counts", "help", "name", "sum")

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help = help_text
        self.counts = [0] * (len(BUCKETS) + 1)  # the last: over the largest bound
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds

    def family(self) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, count in zip((*map(floatToGoString, BUCKETS), "+Inf"), self.counts, strict=True):
            running += count
            cumulative.append((bound, float(running)))
        family = HistogramMetricFamily(self.name, self.help)
        family.add_metric([], cumulative, sum_value=self.sum)
        return family


class HotPath(Collector):
    """The edge's per-request tallies and timings, collected by prometheus-client at each scrape."""

    def __init__(self, metrics: Sequence[Tally | Timings]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield metric.family()

    def describe(self) -> Iterator[Metric]:
        return self.collect()


class EdgeMetrics:
    """The edge's metrics (HTTP, sessions, turns, tokens, engine and log latency, replays, rollbacks); those
    every request updates are :class:`Tally` and :class:`Timings`."""

    def __init__(self, registry: CollectorRegistry) -> None:
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


class ProjectorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.envelopes = Counter("rollbus_projector_envelopes_total", "Log envelopes the projector folded into "
                                 "projections (redeliveries included)", registry=registry)
        self.rebuilds = Counter("rollbus_projector_rebuilds_total", "Sessions rebuilt from the log to close a gap "
                                "in their projection", registry=registry)
        self.ready = Counter("rollbus_projector_ready_signals_total", "Ready signals published for ended sessions",
                             registry=registry)


class MaterializerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.records = Counter("rollbus_records_materialized_total", "Training records the materializer wrote "
                               "(committed to the dataset)", registry=registry)
        self.sessions = Counter("rollbus_materializer_sessions_total", "Ended sessions the materializer marked "
                                "done (with or without records)", registry=registry)
        self.quarantined = Counter("rollbus_materializer_quarantined_total", "Ended sessions the materializer set "
                                   "aside (not materialized), by stage", ("stage",), registry=registry)


class Metrics:
    """A registry of the process's own and the metric families in it.

    :meth:`inc` is the generic counter (``materializer.quarantine.Counters``): the family of that
    name if a group declared it, else a counter made on first use with the labels given."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.failures = Counter("rollbus_failures_total", "Failures by component and reason",
                                ("component", "reason"), registry=self.registry)
        self.consumer_pending = Gauge("rollbus_consumer_pending_messages", "Messages a JetStream consumer has not "
                                      "processed yet (pending + delivered unacknowledged), by consumer",
                                      ("consumer",), registry=self.registry)
        self.consumer_lag = Gauge("rollbus_consumer_lag_seconds", "Age in seconds of the oldest message a "
                                  "JetStream consumer has not acknowledged (0 when caught up), by consumer",
                                  ("consumer",), registry=self.registry)
        self._families: dict[str, Counter | Histogram | Tally | Timings] = {}  # by name (counters': _total too)
        self._children: dict[tuple[str, tuple[tuple[str, str], ...]], Counter | Tallied] = {}
        self._by_name(self.failures)

    @functools.cached_property
    def edge(self) -> EdgeMetrics:
        return self._declared(EdgeMetrics(self.registry))

    @functools.cached_property
    def projector(self) -> ProjectorMetrics:
        return self._declared(ProjectorMetrics(self.registry))

    @functools.cached_property
    def materializer(self) -> MaterializerMetrics:
        return self._declared(MaterializerMetrics(self.registry))

    def declare(self, component: str) -> None:
        """Create the metrics of ``component`` (``edge``, ``projector``, ``materializer``) now, so they are
        exposed (at 0) before anything happens."""
        if component not in COMPONENTS:
            raise ValueError(f"no metrics group {component!r}")
        getattr(self, component)

    def _declared(self, group: G) -> G:
        for family in vars(group).values():
            if isinstance(family, Tally | Timings):
                self._families[family.name] = family
                if isinstance(family, Tally):
                    self._families[family.name + "_total"] = family
            elif isinstance(family, Counter | Histogram):
                self._by_name(family)
        return group

    def _by_name(self, family: Counter | Histogram) -> None:
        for described in family.describe():
            self._families[described.name] = family
            if described.type == "counter":
                self._families[described.name + "_total"] = family

    def inc(self, name: str, amount: float = 1.0, help_text: str = "", **labels: str) -> None:
        """Add ``amount`` to the counter ``name`` (``..._total``) at ``labels``."""
        key = (name, tuple(sorted(labels.items())))
        child = self._children.get(key)
        if child is None:
            family = self._families.get(name)
            if family is None:
                family = self._families[name] = Counter(name, help_text or name, sorted(labels),
                                                        registry=self.registry)
            if isinstance(family, Tally):
                child = family.labels(*(labels[n] for n in family.labelnames))
            elif isinstance(family, Counter):
                child = family.labels(**labels) if labels else family
            else:
                raise KeyError(f"{name} is not a counter")
            self._children[key] = child
        child.inc(amount)

    def observe(self, name: str, seconds: float, help_text: str = "") -> None:
        """Observe ``seconds`` in the histogram ``name`` (one a group declared)."""
        family = self._families.get(name)
        if not isinstance(family, Histogram | Timings):
            raise KeyError(f"no histogram {name} (declared by a metrics group)")
        family.observe(seconds)

    def value(self, name: str, **labels: str) -> float:
        """A sample's value now (0 when absent), e.g. ``value("rollbus_turns_total", wire="openai", ...)``."""
        return self.registry.get_sample_value(name, labels) or 0.0

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition for a scrape with this ``Accept`` header (text format, or OpenMetrics when
        asked), and its content type."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    def names(self) -> set[str]:
        """Every sample name the registry's families expose (``_total``, ``_bucket``, ``_sum``, ...), those
        with no sample yet (no label set used) too."""
        suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                    "gauge": ("",)}
        return {family.name + suffix for family in self.registry.collect()
                for suffix in suffixes.get(family.type, ("",))}

    def serve(self, host: str, port: int) -> MetricsServer:
        """prometheus-client's own HTTP server for this registry on ``host:port`` (0: a free port), on a
        thread (``OSError`` when the address cannot be had)."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        return MetricsServer(server, thread)


class MetricsServer:
    def __init__(self, server: WSGIServer, thread: object) -> None:
        self._server = server
        self._thread = thread
        host, port = server.server_address[:2]
        self.url = f"http://{'[' + str(host) + ']' if ':' in str(host) else host}:{port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class TimedLog:
    """An :class:`EventLog` whose appends are timed (``rollbus_log_append_seconds``); a failed append is
    counted in ``rollbus_failures_total{component="edge"}`` by its error's type."""

    def __init__(self, inner: EventLog, metrics: Metrics) -> None:
        self.inner = inner
        self._seconds = metrics.edge.log_append_seconds
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


class TimedEngine:
    """An :class:`Engine` whose calls are timed to their result (``rollbus_engine_seconds``; a call that
    fails is counted in ``rollbus_turns_total{status="engine_error"}`` instead)."""

    def __init__(self, inner: Engine, metrics: Metrics) -> None:
        self.inner = inner
        self.name = inner.name
        self._seconds = metrics.edge.engine_seconds

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


async def watch_lag(metrics: Metrics, js: JetStreamContext, watched: Sequence[Watched], stop: asyncio.Event, *,
                    interval: float = LAG_INTERVAL_S, clock: Callable[[], float] = time.time) -> None:
    """Every ``interval`` seconds until ``stop``, each watched consumer's lag into the lag gauges (a consumer
    not created yet, or JetStream not answering, leaves its gauges as they were)."""
    while not stop.is_set():
        for consumer in watched:
            try:
                lag = await consumer_lag(js, consumer, clock=clock)
            except RollbusError as exc:
                log.debug("lag of %s not sampled: %s", consumer.name, exc)
                continue
            if lag is not None:
                metrics.consumer_pending.labels(consumer.name).set(lag.messages)
                metrics.consumer_lag.labels(consumer.name).set(lag.seconds)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
