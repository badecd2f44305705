"""Metrics: the registry every component shares and its hot-path counters (:mod:`observability.registry`),
consumer lag sampled into gauges (:mod:`observability.lag`). Each component's own metrics live beside it."""
