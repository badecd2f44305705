"""A verl step at its real size: 1,024 sessions (128 prompts x 8), each a short tool-using conversation
through ``rollbus up``, finalized at once; then the stack is killed (SIGKILL) before its materializer
wrote any of them (it gathers ready signals for 20 s), and restarted with the whole step waiting. Every
session must be materialized exactly once, with nothing quarantined (a server limit is never a bad
session), and reading them must not hold a consumer per session on the server (bcb3074 held 160 at once;
JetStream refuses the 1,001st consumer of a stream).

``tests/tq/test_burst_tq.py`` runs the same step into TransferQueue."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from edge.tokens.tokenizer import load_tokenizer
from rollbus.testing.burst import ConsumerPeak, Driver, Outcome, Step, nats_url, outcome, tool_responder, wait_marked
from rollbus.testing.scripted import ScriptedEngineServer
from tests.e2e.test_cli import Up
from tests.processes import busiest_processes

SESSIONS = 1024
DRAIN_TIMEOUT_S = 300.0
DURABLES = 4  # the projector's and the materializer's consumers, the edge's lag watch: a few, whatever the load


async def _step(up: Up) -> tuple[Step, int]:
    async with ConsumerPeak(nats_url("".join(up.lines))) as consumers:
        step = await Driver(up.url, "tok").step(SESSIONS)
    return step, consumers.peak


async def _drain(up: Up, session_ids: list[str], timeout: float) -> tuple[dict[str, str], int]:
    url = nats_url("".join(up.lines))
    async with ConsumerPeak(url) as consumers:
        statuses, _ = await wait_marked(url, session_ids, timeout=timeout)
    return statuses, consumers.peak


def killed_step(data: Path, extra: Sequence[str] = (), drain_timeout: float = DRAIN_TIMEOUT_S) -> Step:
    """Run the step through ``rollbus up``, kill it, restart it and wait for every session's marker; checks
    what the Parquet dataset and the markers say, and the consumers the server held. Each phase's time is
    printed as it ends; a drain that fails or is cut off prints the restarted stack's last lines and the
    machine's busiest processes."""
    tokenizer = load_tokenizer("builtin:qwen2.5")
    responder = tool_responder(tokenizer.encode, tokenizer.decode, tokenizer.eos_token_id)
    with ScriptedEngineServer(responder=responder, keep_requests=16) as engine:
        started = time.monotonic()
        first = Up(data, engine.url, "--log-level", "WARNING", "--batch-delay", "20", "--ack-wait", "60", *extra)
        try:
            _said(f"the stack started in {time.monotonic() - started:.1f} s")
            step, running_peak = asyncio.run(_step(first))
            _said(f"{step.trajectories} sessions ran in {step.ran_s:.1f} s, finalized in {step.finalize_s:.1f} s")
        finally:
            first.kill()
        assert step.trajectories == SESSIONS
        started = time.monotonic()
        second = Up(data, engine.url, "--log-level", "WARNING", *extra)
        try:
            _said(f"killed; restarted in {time.monotonic() - started:.1f} s")
            started = time.monotonic()
            statuses, draining_peak = asyncio.run(_drain(second, step.session_ids, drain_timeout))
            _said(f"{len(statuses)} of {SESSIONS} marked in {time.monotonic() - started:.1f} s")
            assert len(statuses) == SESSIONS, f"{SESSIONS - len(statuses)} sessions unmarked after {drain_timeout} s"
        except BaseException:  # (pytest-timeout's too)
            _said("the restarted stack said:\n" + "".join(second.lines[-60:]) + "busiest processes:\n"
                  + busiest_processes())
            raise
        finally:
            assert second.stop() == 0, "".join(second.lines[-40:])
    assert outcome(data / "trajectories", step.session_ids, statuses) == \
        Outcome(sessions=SESSIONS, lost=0, duplicated=0, quarantined=0, other={}, stray=0)
    assert running_peak <= DURABLES and draining_peak <= DURABLES
    return step


def _said(what: str) -> None:
    print(f"burst of {SESSIONS}: {what}", flush=True)


# About 65 s alone, 95 s beside two busy processes (2-core VM): a drain that has not ended in DRAIN_TIMEOUT_S
# fails with its explanation before this timeout would cut it off without one.
@pytest.mark.timeout(600)
def test_a_step_of_1024_sessions_ending_at_once_is_materialized_exactly_once_across_a_kill(tmp_path: Path):
    killed_step(tmp_path / "data")
