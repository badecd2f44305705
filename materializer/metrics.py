"""The materializer's metrics."""

from __future__ import annotations

from prometheus_client import Counter

from observability.registry import Metrics


class MaterializerMetrics:
    """The materializer's metrics (a group of :class:`observability.registry.Metrics`)."""

    def __init__(self, metrics: Metrics) -> None:
        registry = metrics.registry
        self.records = Counter("rollbus_records_materialized_total", "Training records the materializer wrote "
                               "(committed to the dataset)", registry=registry)
        self.sessions = Counter("rollbus_materializer_sessions_total", "Ended sessions the materializer marked "
                                "done (with or without records)", registry=registry)
        self.quarantined = Counter("rollbus_materializer_quarantined_total", "Ended sessions the materializer set "
                                   "aside (not materialized), by stage", ("stage",), registry=registry)
        self.transient = metrics.failures.labels("materializer", "transient")
        self._failures = metrics.failures

    def quarantine(self, stage: str) -> None:
        """Count a session set aside at ``stage`` (one of ``materializer.quarantine.STAGES``)."""
        self.quarantined.labels(stage).inc()
        self._failures.labels("materializer", f"quarantined_{stage}").inc()
