"""ops/grafana/rollbus.json: a Grafana dashboard over metrics that exist, on a Prometheus data source variable."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from edge.metrics import EdgeMetrics
from materializer.metrics import MaterializerMetrics
from observability.registry import Metrics
from session_projector.metrics import ProjectorMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "ops" / "grafana" / "rollbus.json"
METRIC = re.compile(r"\brollbus_[a-z0-9_]+\b")


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_the_dashboard_is_a_grafana_model_on_a_prometheus_datasource_variable() -> None:
    dashboard = _dashboard()
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in _panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            assert target["datasource"]["uid"] == "${datasource}"


def test_every_metric_the_dashboard_queries_exists_in_the_registry() -> None:
    metrics = Metrics()
    for group in (EdgeMetrics, ProjectorMetrics, MaterializerMetrics):  # every component's
        metrics.group(group)
    exposed = metrics.names()
    queried = {name for panel in _panels(_dashboard()) for target in panel["targets"]
               for name in METRIC.findall(target["expr"])}
    assert queried - exposed == set()
    # the metrics are all on it: sessions, turns, tokens, latencies, lag, records, failures, replays, rollbacks,
    # forks
    for name in ("rollbus_sessions_open", "rollbus_turns_total", "rollbus_input_tokens_total",
                 "rollbus_output_tokens_total", "rollbus_engine_seconds_bucket", "rollbus_log_append_seconds_bucket",
                 "rollbus_consumer_pending_messages", "rollbus_consumer_lag_seconds",
                 "rollbus_records_materialized_total", "rollbus_failures_total", "rollbus_idempotent_replays_total",
                 "rollbus_rollbacks_total", "rollbus_chain_forks_total"):
        assert name in queried, name


def test_latency_panels_take_quantiles_of_histogram_buckets() -> None:
    exprs = [t["expr"] for p in _panels(_dashboard()) for t in p["targets"] if "histogram_quantile" in t["expr"]]
    assert len(exprs) >= 6
    assert all(re.search(r"sum by \(le[,)].*rate\(rollbus_\w+_seconds_bucket\[\$__rate_interval\]\)", e)
               for e in exprs)
