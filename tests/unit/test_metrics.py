"""The process's metrics (prometheus-client, a registry per Metrics) and their exposition."""

from __future__ import annotations

import asyncio
import datetime

import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge.metrics import EdgeMetrics, TimedLog
from eventlog.lag import Lag, lag_of
from materializer.metrics import MaterializerMetrics
from observability.registry import Metrics
from schemas.errors import LogUnavailable
from session_projector.metrics import ProjectorMetrics


def _samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_counters_and_histograms_render_in_the_text_format() -> None:
    metrics = Metrics()
    edge = metrics.group(EdgeMetrics)
    edge.http_requests.labels("/r", "200").inc()
    edge.http_requests.labels("/r", "200").inc(2)
    for seconds in (0.0005, 0.02, 40.0):
        edge.http_seconds.observe(seconds)
    edge.turn("openai", "stop", "ok", input_tokens=600, output_tokens=12)
    edge.turn("openai", "stop", "ok", input_tokens=650, output_tokens=8)
    samples = _samples(metrics)
    assert samples[("rollbus_http_requests_total", (("route", "/r"), ("status", "200")))] == 3
    assert samples[("rollbus_http_request_seconds_bucket", (("le", "0.001"),))] == 1
    assert samples[("rollbus_http_request_seconds_bucket", (("le", "0.025"),))] == 2
    assert samples[("rollbus_http_request_seconds_bucket", (("le", "30.0"),))] == 2
    assert samples[("rollbus_http_request_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("rollbus_http_request_seconds_count", ())] == 3
    assert samples[("rollbus_http_request_seconds_sum", ())] == pytest.approx(40.0205)
    turns = (("finish_reason", "stop"), ("status", "ok"), ("wire", "openai"))
    assert samples[("rollbus_turns_total", turns)] == 2
    assert samples[("rollbus_input_tokens_total", (("wire", "openai"),))] == 1250
    assert samples[("rollbus_output_tokens_total", (("wire", "openai"),))] == 20


def test_each_metrics_has_its_own_registry_and_exposes_only_the_groups_asked_for() -> None:
    one, two = Metrics(), Metrics()
    one.group(EdgeMetrics).rollbacks.inc()
    assert one.value("rollbus_rollbacks_total") == 1 and two.value("rollbus_rollbacks_total") == 0
    assert "rollbus_rollbacks_total" not in two.names()  # no edge here: its metrics are not exposed
    assert "rollbus_consumer_lag_seconds" in two.names()  # every consumer process has lag gauges
    projector = two.group(ProjectorMetrics)
    assert two.group(ProjectorMetrics) is projector  # made once, kept
    assert two.value("rollbus_projector_envelopes_total") == 0 and "rollbus_projector_envelopes_total" in two.names()


def test_a_component_counts_through_its_group_into_the_shared_registry() -> None:
    metrics = Metrics()
    materializer, projector = metrics.group(MaterializerMetrics), metrics.group(ProjectorMetrics)
    materializer.quarantine("invalid")
    materializer.quarantine("invalid")
    materializer.transient.inc()
    projector.retried.inc(3)
    assert metrics.value("rollbus_materializer_quarantined_total", stage="invalid") == 2
    assert metrics.value("rollbus_failures_total", component="materializer", reason="quarantined_invalid") == 2
    assert metrics.value("rollbus_failures_total", component="materializer", reason="transient") == 1
    assert metrics.value("rollbus_failures_total", component="projector", reason="retried") == 3
    text = metrics.render()[0].decode()
    assert "# HELP rollbus_materializer_quarantined_total Ended sessions the materializer set aside" in text


def test_openmetrics_when_the_scraper_asks_for_it() -> None:
    body, content_type = Metrics().render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")


class _FailingLog:
    async def append(self, session_id: str, events: object, expected_last: int) -> object:
        await asyncio.sleep(0.01)
        raise LogUnavailable("no ack")


def test_a_timed_log_times_every_append_and_counts_failed_ones_by_error() -> None:
    metrics = Metrics()
    timed = TimedLog(_FailingLog(), metrics)  # type: ignore[arg-type]
    with pytest.raises(LogUnavailable):
        asyncio.run(timed.append("s", [], 0))
    assert metrics.value("rollbus_log_append_seconds_count") == 1
    assert metrics.value("rollbus_log_append_seconds_sum") >= 0.01
    assert metrics.value("rollbus_failures_total", component="edge", reason="log_unavailable") == 1


def test_lag_is_the_age_of_the_oldest_unprocessed_message() -> None:
    oldest = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    assert lag_of(0, oldest, oldest.timestamp() + 60) == Lag(0, 0.0)  # caught up: no lag, however old
    assert lag_of(7, oldest, oldest.timestamp() + 60) == Lag(7, 60.0)
    assert lag_of(7, oldest, oldest.timestamp() - 1) == Lag(7, 0.0)  # clocks apart: never negative
