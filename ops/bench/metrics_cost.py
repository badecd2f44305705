"""What the metrics cost a plain model turn on the edge, against the hand-written counters they replaced.

A plain turn updates: the HTTP request counter (a kept child) and latency histogram, the turn
counter and the two token counters (kept children), the engine and log-append histograms, and goes
through the :class:`TimedEngine` and :class:`TimedLog` wrappers (one extra ``await`` each). Three
ways, each measured in the same run and process, alternated:

* baseline: what the edge did before prometheus-client: one dict add for the request counter and one
  bisect into a list of buckets for its latency, the engine and log called directly;
* prometheus-client's own ``Counter`` / ``Histogram`` children for every update (each takes a lock);
* what the edge does: :class:`observability.registry.Tally` / :class:`~observability.registry.Timings` (plain adds,
  collected by prometheus-client at scrape).

Every way awaits the same trivial engine and log, so the differences are the metrics' own cost.

    python ops/bench/metrics_cost.py [--turns 100000] [--rounds 5]

Prints microseconds per turn for each (the median of ``--rounds``), and each against the baseline;
compare the differences with the edge's CPU per turn (``ops/bench/edge_overhead.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from edge.engines.base import GenerateRequest, GenerateResult, SamplingParams
from edge.metrics import EdgeMetrics, TimedEngine, TimedLog
from eventlog.publisher import Appended
from observability.registry import BUCKETS, Metrics
from schemas.events import Event

_RESULT = GenerateResult(token_ids=(1, 2, 3), logprobs=None, finish_reason="stop")
_APPENDED = Appended(stream="S", stream_seq=1, duplicate=False, envelopes=1)
_REQUEST = GenerateRequest(request_id="s:1", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=16))


class _Engine:
    name = "instant"

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        return _RESULT

    async def aclose(self) -> None:
        return None


class _Log:
    async def append(self, session_id: str, events: Sequence[Event], expected_last: int) -> Appended:
        return _APPENDED


async def _baseline(turns: int) -> float:
    counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
    key = ("rollbus_http_requests_total", (("route", "/sessions/{session_id}/v1/chat/completions"), ("status", "200")))
    counts = [0] * (len(BUCKETS) + 1)
    total = [0.0]
    engine, log = _Engine(), _Log()
    start = time.perf_counter()
    for _ in range(turns):
        began = time.perf_counter()
        await engine.generate(_REQUEST)
        await log.append("s", (), 0)
        counters[key] += 1.0
        seconds = time.perf_counter() - began
        counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        total[0] += seconds
    return (time.perf_counter() - start) / turns * 1e6


async def _children(turns: int) -> float:
    registry = CollectorRegistry()
    request = Counter("r_total", "r", ("route", "status"), registry=registry).labels("/r", "200")
    turn = Counter("t_total", "t", ("wire", "finish_reason", "status"), registry=registry).labels("o", "stop", "ok")
    tokens_in = Counter("i_total", "i", ("wire",), registry=registry).labels("o")
    tokens_out = Counter("o_total", "o", ("wire",), registry=registry).labels("o")
    http, engine_s, append_s = (Histogram(n, n, buckets=BUCKETS, registry=registry) for n in ("h", "e", "a"))
    engine, log = _Engine(), _Log()
    start = time.perf_counter()
    for _ in range(turns):
        began = time.perf_counter()
        await engine.generate(_REQUEST)
        engine_s.observe(time.perf_counter() - began)
        appending = time.perf_counter()
        await log.append("s", (), 0)
        append_s.observe(time.perf_counter() - appending)
        turn.inc()
        tokens_in.inc(600)
        tokens_out.inc(3)
        request.inc()
        http.observe(time.perf_counter() - began)
    return (time.perf_counter() - start) / turns * 1e6


async def _edge(turns: int) -> float:
    metrics = Metrics()
    edge = metrics.group(EdgeMetrics)
    request = edge.http_requests.labels("/sessions/{session_id}/v1/chat/completions", "200")
    engine, log = TimedEngine(_Engine(), metrics), TimedLog(_Log(), metrics)
    start = time.perf_counter()
    for _ in range(turns):
        began = time.perf_counter()
        await engine.generate(_REQUEST)
        await log.append("s", (), 0)
        edge.turn("openai", "stop", "ok", 600, 3)
        request.inc()
        edge.http_seconds.observe(time.perf_counter() - began)
    return (time.perf_counter() - start) / turns * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ways = {"hand-written counters (baseline)": _baseline, "prometheus-client children": _children,
            "observability (Tally, Timings)": _edge}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):  # alternated, so a drift of the machine's speed hits every way
        for name, way in ways.items():
            times[name].append(asyncio.run(way(args.turns)))
    baseline = statistics.median(times["hand-written counters (baseline)"])
    print(f"{'per plain turn':<36}{'us':>8}{'vs baseline':>14}")
    for name, measured in times.items():
        us = statistics.median(measured)
        print(f"{name:<36}{us:>8.2f}{us / baseline:>13.2f}x  ({us - baseline:+.2f} us)")


if __name__ == "__main__":
    main()
