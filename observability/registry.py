"""The process's Prometheus metrics, with ``prometheus-client``, in a registry of the process's own.

One :class:`Metrics` per stack (``rollbus up`` shares it between the edge, the projector and the
materializer, so the edge's ``GET /metrics`` shows all three; a component run alone serves its
own on ``--metrics-port``). Each component's metrics are a group defined beside it
(``edge/metrics.py``, ``session_projector/metrics.py``, ``materializer/metrics.py``), created when
the component first asks for it (:meth:`Metrics.group`), so a process exposes only what it runs.
Several stacks in one process (tests) never share a registry.

What every model request updates (HTTP requests and latency, turns, tokens, engine and append
latency) is kept as plain numbers (:class:`Tally`, :class:`Timings`, children kept per label set)
that prometheus-client collects at scrape (:class:`HotPath`, a custom collector): an update is a
float add, where a prometheus-client ``Counter.inc`` or ``Histogram.observe`` takes a lock and
costs ~10x more (``ops/bench/metrics_cost.py``). The rest are prometheus-client's own metric
types. Label values are bounded sets (wires, finish reasons, statuses, reasons named in code),
never a client's text.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

G = TypeVar("G")

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


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
    """Tallies and timings, collected by prometheus-client at each scrape."""

    def __init__(self, metrics: Sequence[Tally | Timings]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        for metric in self._metrics:
            yield metric.family()

    def describe(self) -> Iterator[Metric]:
        return self.collect()


class Metrics:
    """A registry of the process's own, the metrics every component shares (failures, consumer lag), and the
    components' groups, each created the first time it is asked for (:meth:`group`) and kept.

    A group is a class beside the component it measures (``edge.metrics.EdgeMetrics``,
    ``session_projector.metrics.ProjectorMetrics``, ``materializer.metrics.MaterializerMetrics``) whose
    constructor takes this object and registers its families in :attr:`registry`: its code counts through
    the group's typed attributes, never by a metric's name."""

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
        self._groups: dict[type, object] = {}

    def group(self, kind: Callable[[Metrics], G]) -> G:
        """The group ``kind`` of this registry: made (its families registered, exposed at 0) on the first call,
        the same object after."""
        found = self._groups.get(kind)  # type: ignore[call-overload]
        if found is None:
            found = self._groups[kind] = kind(self)  # type: ignore[index]
        return found  # type: ignore[return-value]

    def value(self, name: str, **labels: str) -> float:
        """A sample's value now (0 when absent), e.g. ``value("rollbus_turns_total", wire="openai", ...)``:
        what a scrape would read (tests, the CLI's summaries)."""
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
