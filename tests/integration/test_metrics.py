"""``GET /metrics`` of a real stack (edge + projector + materializer in one process) after turns driven
with the official openai SDK: the counts match what happened, sample by sample."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from materializer.dataset import session_rows
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply
from schemas import tokens
from schemas.events import TokensGenerated, TurnRolledBack
from schemas.log import LogConfig
from stack.nats_server import EmbeddedNats
from stack.runtime import StackOptions
from tests.stack import StackThread

ADMIN = "metrics-admin-token"
CHAT = "/sessions/{session_id}/v1/chat/completions"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> Samples:
    """Every sample of the exposition at ``url``, parsed by prometheus-client's own parser."""
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def eventually(check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.1)


@pytest.fixture
def stack(nats_server: EmbeddedNats, log_config: LogConfig, engine: ScriptedEngineServer,
          tmp_path: Path) -> Iterator[StackThread]:
    options = StackOptions(port=0, data_dir=tmp_path / "data", nats_url=nats_server.url, engine="sglang",
                           engine_urls=(engine.url,), admin_token=ADMIN, log=log_config, max_trajectory_length=4096,
                           lag_interval=0.2)
    running = StackThread(options).start()
    yield running
    running.stop()


def test_the_edge_metrics_count_what_happened(stack: StackThread, engine: ScriptedEngineServer) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    session = httpx.post(f"{stack.url}/sessions", json={"uid": "metrics"}, headers=admin).json()
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    before = scrape(f"{stack.url}/metrics")
    assert value(before, "rollbus_sessions_open") == 1
    assert value(before, "rollbus_turns_total", wire="openai", finish_reason="stop", status="ok") == 0

    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model="m", messages=messages)  # 1: plain
    messages += [{"role": "assistant", "content": plain.choices[0].message.content},
                 {"role": "user", "content": "more"}]
    chunks = list(client.chat.completions.create(model="m", messages=messages, stream=True))  # 2: streamed
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    messages += [{"role": "assistant", "content": streamed}, {"role": "user", "content": "again"}]
    keyed = {"Idempotency-Key": "turn-3"}
    first = client.chat.completions.create(model="m", messages=messages, extra_headers=keyed)  # 3: keyed
    again = client.chat.completions.create(model="m", messages=messages, extra_headers=keyed)  # its retry: replayed
    assert again.id == first.id and again.choices[0].message.content == first.choices[0].message.content
    messages += [{"role": "assistant", "content": "a rewritten answer"}, {"role": "user", "content": "next"}]
    client.chat.completions.create(model="m", messages=messages)  # 4: rolls the rewritten reply back
    reward = httpx.post(session["reward_url"], json={"reward_info": {"reward": 1.0}},
                        headers={"Authorization": f"Bearer {session['api_key']}"})
    assert reward.status_code == 200, reward.text
    assert httpx.post(f"{stack.url}/sessions/{session['session_id']}/finalize", headers=admin).status_code == 200

    assert len(engine.requests) == 4  # the replay never reached the engine
    events = stack.events(session["session_id"])
    assert sum(isinstance(e, TurnRolledBack) for e in events) == 1
    eventually(lambda: bool(session_rows(stack.trajectories, [session["session_id"]])))
    rows = session_rows(stack.trajectories, [session["session_id"]])
    samples = scrape(f"{stack.url}/metrics")

    assert value(samples, "rollbus_turns_total", wire="openai", finish_reason="stop", status="ok") == 4
    assert value(samples, "rollbus_idempotent_replays_total", wire="openai") == 1
    assert value(samples, "rollbus_rollbacks_total") == 1
    sent = sum(len(request["input_ids"]) for request in engine.requests)
    assert value(samples, "rollbus_input_tokens_total", wire="openai") == sent
    sampled = sum(tokens.count(e.token_ids) for e in events if isinstance(e, TokensGenerated))
    assert sampled > 0 and value(samples, "rollbus_output_tokens_total", wire="openai") == sampled
    assert value(samples, "rollbus_engine_seconds_count") == 4
    assert value(samples, "rollbus_engine_seconds_sum") > 0
    # appends: the session's opening, four turns, the reward, the finalize
    assert value(samples, "rollbus_log_append_seconds_count") == 7
    assert value(samples, "rollbus_http_requests_total", route=CHAT, status="200") == 5
    assert value(samples, "rollbus_http_request_seconds_count") >= 5
    assert value(samples, "rollbus_sessions_open") == 0
    assert value(samples, "rollbus_failures_total", component="edge", reason="engine_error") == 0

    # in one process, the edge's /metrics has the projector's and the materializer's too
    assert value(samples, "rollbus_records_materialized_total") == len(rows) == 1
    assert value(samples, "rollbus_materializer_sessions_total") == 1
    assert value(samples, "rollbus_projector_ready_signals_total") == 1
    assert value(samples, "rollbus_projector_envelopes_total") >= 7

    def caught_up() -> bool:
        now = scrape(f"{stack.url}/metrics")
        return all((f, frozenset({("consumer", c)})) in now and value(now, f, consumer=c) == 0
                   for c in ("projector", "materializer")
                   for f in ("rollbus_consumer_pending_messages", "rollbus_consumer_lag_seconds"))

    eventually(caught_up)


def test_engine_errors_and_refusals_are_counted_by_status(stack: StackThread, engine: ScriptedEngineServer) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    session = httpx.post(f"{stack.url}/sessions", json={}, headers=admin).json()
    url, key = f"{session['base_url']}/chat/completions", {"Authorization": f"Bearer {session['api_key']}"}
    engine.push(ScriptedReply(token_ids=[1], fault="http_500"))
    failed = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, headers=key)
    assert failed.status_code >= 500 and failed.json()["error"]
    too_long = " ".join(["word"] * 5000)  # past the chain's 4096 tokens: refused before the engine
    refused = httpx.post(url, json={"model": "m", "messages": [{"role": "user", "content": too_long}]}, headers=key)
    assert refused.status_code == 200 and refused.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.post(f"{stack.url}/sessions/{session['session_id']}/abort", json={"reason": "runner failed"},
                      headers=admin).status_code == 200
    samples = scrape(f"{stack.url}/metrics")
    assert value(samples, "rollbus_turns_total", wire="openai", finish_reason="none", status="engine_error") == 1
    assert value(samples, "rollbus_turns_total", wire="openai", finish_reason="length", status="refused") == 1
    assert value(samples, "rollbus_turns_total", wire="openai", finish_reason="stop", status="ok") == 0
    assert value(samples, "rollbus_failures_total", component="edge", reason="engine_error") == 1
    assert value(samples, "rollbus_failures_total", component="edge", reason="session_aborted") == 1
    assert value(samples, "rollbus_engine_seconds_count") == 0  # only calls that returned a generation
    assert len(engine.requests) == 1
    assert value(samples, "rollbus_http_requests_total", route=CHAT, status=str(failed.status_code)) == 1
    assert value(samples, "rollbus_input_tokens_total", wire="openai") == 0
