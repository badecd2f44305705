"""The in-process metrics and their text exposition."""

from __future__ import annotations

from edge.metrics import Metrics


def test_counters_and_histograms_render_in_the_exposition_format() -> None:
    metrics = Metrics()
    key = metrics.key("rollbus_http_requests_total", help_text="requests", route="/r", status="200")
    metrics.add(key)
    metrics.add(key, 2)
    latency = metrics.histogram("rollbus_http_request_seconds", "latency")
    latency.observe(0.0005)
    latency.observe(0.02)
    metrics.observe("rollbus_http_request_seconds", 40.0)  # the same histogram, by name
    text = metrics.render()
    assert '# HELP rollbus_http_requests_total requests' in text
    assert 'rollbus_http_requests_total{route="/r",status="200"} 3' in text
    assert '# TYPE rollbus_http_request_seconds histogram' in text
    assert 'rollbus_http_request_seconds_bucket{le="0.001"} 1' in text
    assert 'rollbus_http_request_seconds_bucket{le="0.025"} 2' in text
    assert 'rollbus_http_request_seconds_bucket{le="30"} 2' in text
    assert 'rollbus_http_request_seconds_bucket{le="+Inf"} 3' in text
    assert "rollbus_http_request_seconds_sum 40.0205" in text and "rollbus_http_request_seconds_count 3" in text
    assert metrics.histogram("rollbus_http_request_seconds") is latency
