"""A verl step at its real size: 1,024 sessions (128 prompts x 8), each a short tool-using conversation
through ``rollbus up``, finalized at once; then the stack is killed (SIGKILL) before its materializer
wrote any of them (it gathers ready signals for 20 s), and restarted with the whole step waiting. Every
session must be materialized exactly once, with nothing quarantined (a server limit is never a bad
session), and reading them must not hold a consumer per session on the server (bcb3074 held 160 at once;
JetStream refuses the 1,001st consumer of a stream).

``tests/tq/test_burst_tq.py`` runs the same step into TransferQueue."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Sequence
from pathlib import Path

from edge.tokens.tokenizer import load_tokenizer
from rollbus.testing.burst import ConsumerPeak, Driver, Outcome, Step, nats_url, outcome, tool_responder, wait_marked
from rollbus.testing.scripted import ScriptedEngineServer
from tests.e2e.test_cli import Up

SESSIONS = 1024
DURABLES = 4  # the projector's and the materializer's consumers, the edge's lag watch: a few, whatever the load


async def _step(up: Up) -> tuple[Step, int]:
    async with ConsumerPeak(nats_url("".join(up.lines))) as consumers:
        step = await Driver(up.url, "tok").step(SESSIONS)
    return step, consumers.peak


async def _drain(up: Up, session_ids: list[str]) -> tuple[dict[str, str], int]:
    url = nats_url("".join(up.lines))
    async with ConsumerPeak(url) as consumers:
        statuses, _ = await wait_marked(url, session_ids, timeout=240)
    return statuses, consumers.peak


def killed_step(data: Path, extra: Sequence[str] = ()) -> Step:
    """Run the step through ``rollbus up``, kill it, restart it and wait for every session's marker; checks
    what the Parquet dataset and the markers say, and the consumers the server held."""
    tokenizer = load_tokenizer("builtin:qwen2.5")
    responder = tool_responder(tokenizer.encode, tokenizer.decode, tokenizer.eos_token_id)
    with ScriptedEngineServer(responder=responder, keep_requests=16) as engine:
        first = Up(data, engine.url, "--log-level", "WARNING", "--batch-delay", "20", "--ack-wait", "60", *extra)
        try:
            step, running_peak = asyncio.run(_step(first))
        finally:
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait(30)
        assert step.trajectories == SESSIONS
        second = Up(data, engine.url, "--log-level", "WARNING", *extra)
        try:
            statuses, draining_peak = asyncio.run(_drain(second, step.session_ids))
        finally:
            assert second.stop() == 0, "".join(second.lines[-40:])
    assert outcome(data / "trajectories", step.session_ids, statuses) == \
        Outcome(sessions=SESSIONS, lost=0, duplicated=0, quarantined=0, other={}, stray=0)
    assert running_peak <= DURABLES and draining_peak <= DURABLES
    return step


def test_a_step_of_1024_sessions_ending_at_once_is_materialized_exactly_once_across_a_kill(tmp_path: Path):
    killed_step(tmp_path / "data")
