"""The projector's metrics."""

from __future__ import annotations

from prometheus_client import Counter

from observability.registry import Metrics


class ProjectorMetrics:
    """The projector's metrics (a group of :class:`observability.registry.Metrics`)."""

    def __init__(self, metrics: Metrics) -> None:
        registry = metrics.registry
        self.envelopes = Counter("rollbus_projector_envelopes_total", "Log envelopes the projector folded into "
                                 "projections (redeliveries included)", registry=registry)
        self.rebuilds = Counter("rollbus_projector_rebuilds_total", "Sessions rebuilt from the log to close a gap "
                                "in their projection", registry=registry)
        self.ready = Counter("rollbus_projector_ready_signals_total", "Ready signals published for ended sessions",
                             registry=registry)
        self.retried = metrics.failures.labels("projector", "retried")
