"""``rollbus projector`` and ``rollbus materializer`` run alone serve ``/metrics`` on ``--metrics-port``
(prometheus-client's own server): their consumer lag, in messages and seconds, and their work."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from eventlog.lag import Lag, Watched, consumer_lag
from rollbus.testing.scripted import ScriptedEngineServer
from schemas.log import LogConfig
from stack.nats_server import EmbeddedNats
from stack.runtime import StackOptions
from tests.integration.test_metrics import eventually, scrape, value
from tests.processes import CliProcess
from tests.stack import StackThread

ADMIN = "consumers-admin-token"


class Alone(CliProcess):
    """``rollbus <component> --nats URL --metrics-port 0``, a real process; its /metrics URL from its banner."""

    def __init__(self, component: str, nats_url: str, data_dir: Path, *args: str) -> None:
        super().__init__([component, "--nats", nats_url, "--data-dir", str(data_dir), *args])
        (self.metrics,) = self.started(r"metrics:\s+(http://\S+/metrics)")


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A server of this test's own: the processes alone use the default log names."""
    with EmbeddedNats(tmp_path / "nats", name="rollbus-metrics-test") as server:
        yield server


def _sessions(nats_url: str, engine: ScriptedEngineServer, data_dir: Path, n: int) -> list[str]:
    """``n`` finalized one-turn sessions, written by an edge alone (nothing projects or materializes them)."""
    options = StackOptions(port=0, data_dir=data_dir, nats_url=nats_url, engine="sglang", engine_urls=(engine.url,),
                           admin_token=ADMIN, components=("edge",), max_trajectory_length=4096)
    edge = StackThread(options).start()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    ids = []
    try:
        for i in range(n):
            session = httpx.post(f"{edge.url}/sessions", json={"uid": f"alone{i}"}, headers=admin).json()
            reply = httpx.post(f"{session['base_url']}/chat/completions",
                               json={"model": "m", "messages": [{"role": "user", "content": f"hi {i}"}]},
                               headers={"Authorization": f"Bearer {session['api_key']}"})
            assert reply.status_code == 200, reply.text
            done = httpx.post(f"{edge.url}/sessions/{session['session_id']}/finalize", headers=admin)
            assert done.status_code == 200
            ids.append(session["session_id"])
        edge_samples = scrape(f"{edge.url}/metrics")
        assert value(edge_samples, "rollbus_turns_total", wire="openai", finish_reason="stop", status="ok") == n
        assert ("rollbus_projector_envelopes_total", frozenset()) not in edge_samples  # an edge alone: no projector
    finally:
        edge.stop()
    return ids


def test_the_projector_and_materializer_alone_serve_their_lag(private_nats: EmbeddedNats,
                                                              engine: ScriptedEngineServer, tmp_path: Path) -> None:
    ids = _sessions(private_nats.url, engine, tmp_path / "edge", 2)
    projector = Alone("projector", private_nats.url, tmp_path / "projector", "--metrics-port", "0")
    materializer = Alone("materializer", private_nats.url, tmp_path / "materializer", "--metrics-port", "0")
    try:
        assert projector.metrics != materializer.metrics

        def projected() -> bool:
            samples = scrape(projector.metrics)
            return value(samples, "rollbus_projector_ready_signals_total") == len(ids)

        eventually(projected)
        rows = tmp_path / "materializer" / "trajectories"
        eventually(lambda: value(scrape(materializer.metrics), "rollbus_records_materialized_total") == len(ids))
        assert len(list(rows.glob("*.parquet"))) >= 1

        def caught_up(url: str, consumer: str) -> bool:  # sampled every 5 s: a first sample, then at 0
            samples = scrape(url)
            key = frozenset({("consumer", consumer)})
            return (("rollbus_consumer_pending_messages", key) in samples
                    and value(samples, "rollbus_consumer_pending_messages", consumer=consumer) == 0
                    and value(samples, "rollbus_consumer_lag_seconds", consumer=consumer) == 0)

        eventually(lambda: caught_up(projector.metrics, "projector"), timeout=30)
        eventually(lambda: caught_up(materializer.metrics, "materializer"), timeout=30)
        projected_samples = scrape(projector.metrics)
        assert value(projected_samples, "rollbus_projector_envelopes_total") >= 3 * len(ids)  # open, turn, finalize
        assert ("rollbus_turns_total", frozenset()) not in projected_samples
        assert not any(name.startswith("rollbus_records_") for name, _ in projected_samples)  # its own only
        materialized = scrape(materializer.metrics)
        assert value(materialized, "rollbus_materializer_sessions_total") == len(ids)
        assert not any(name.startswith("rollbus_projector_") for name, _ in materialized)
    finally:
        assert projector.stop() == 0, "".join(projector.lines)
        assert materializer.stop() == 0, "".join(materializer.lines)


def test_a_busy_metrics_port_is_one_line(private_nats: EmbeddedNats, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "rollbus.cli", "projector", "--nats", private_nats.url,
                                 "--data-dir", str(tmp_path), "--metrics-port", str(port)],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and f"--metrics-port {port}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


async def test_lag_counts_what_the_consumer_has_not_acknowledged_and_its_age(js: JetStreamContext,
                                                                             log_config: LogConfig) -> None:
    watched = Watched(name="test", stream=log_config.ready_stream, durable="lag-test",
                      subject=log_config.ready_subjects)
    assert await consumer_lag(js, watched) is None  # no such consumer yet
    config = ConsumerConfig(durable_name="lag-test", ack_policy=AckPolicy.EXPLICIT,
                            filter_subject=log_config.ready_subjects)
    sub = await js.pull_subscribe(log_config.ready_subjects, durable="lag-test", stream=log_config.ready_stream,
                                  config=config)
    assert await consumer_lag(js, watched) == Lag(0, 0.0)
    for i in range(3):
        await js.publish(log_config.ready_subject(f"{i:032x}"), msgspec.json.encode({"n": i}))
    await asyncio.sleep(0.5)
    lag = await consumer_lag(js, watched)
    assert lag is not None and lag.messages == 3 and 0.4 < lag.seconds < 10
    first = await sub.fetch(1, timeout=5)
    lag = await consumer_lag(js, watched)
    assert lag is not None and lag.messages == 3 and lag.seconds > 0.4  # delivered, not acknowledged
    await first[0].ack_sync()
    await asyncio.sleep(0.3)
    lag = await consumer_lag(js, watched)
    assert lag is not None and lag.messages == 2 and 0.3 < lag.seconds < 10
    for msg in await sub.fetch(2, timeout=5):
        await msg.ack_sync()
    assert await consumer_lag(js, watched) == Lag(0, 0.0)
    await sub.unsubscribe()
