"""Sessions created and abandoned are reclaimed by the idle timeout, at scale and through a real
``rollbus up`` (``tests/integration/test_idle.py`` tests the keeper itself): 300 sessions opened, a turn
each, and left; every one must end aborted with reason ``idle_timeout`` (its summary and its
materializer marker say so), none before it was idle, and the edge's live sessions must drop back to
what they were. ``ops/chaos/soak.py --abandoned 10000`` is the long run."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import httpx

from rollbus.testing.burst import Driver, nats_url, sessions_open, sessions_open_at_most, wait_marked
from tests.e2e.test_cli import Up

SESSIONS, IDLE_S = 300, 6.0


async def _summaries(up: Up, session_ids: list[str]) -> Counter[str]:
    async with httpx.AsyncClient(base_url=up.url, headers={"Authorization": "Bearer tok"}, timeout=60) as client:
        gate = asyncio.Semaphore(32)

        async def one(sid: str) -> str:
            async with gate:
                body = (await client.get(f"/sessions/{sid}")).json()
                return f"{body['status']} {body.get('close_reason')}"

        return Counter(await asyncio.gather(*(one(s) for s in session_ids)))


async def _abandon_and_wait(up: Up) -> tuple[float, float, list[str], str]:
    async with httpx.AsyncClient(timeout=30) as client:
        before = await sessions_open(client, up.url)
    left = await Driver(up.url, "tok", concurrency=32).abandon(SESSIONS, "idle-")
    newest = (await _summaries(up, left[-1:])).most_common(1)[0][0]  # just opened: not idle yet
    return before, await sessions_open_at_most(up.url, before, 120), left, newest


def test_hundreds_of_abandoned_sessions_are_aborted_by_the_idle_timeout_and_released(tmp_path: Path, tool_engine):
    up = Up(tmp_path / "data", tool_engine.url, "--log-level", "WARNING", "--idle-timeout", str(IDLE_S))
    try:
        before, after, left, newest = asyncio.run(_abandon_and_wait(up))
        assert len(set(left)) == SESSIONS
        assert newest.startswith("open"), newest
        assert after == before == 0, f"the edge still holds {after} sessions live"
        assert asyncio.run(_summaries(up, left)) == Counter({"aborted idle_timeout": SESSIONS})
        markers, _ = asyncio.run(wait_marked(nats_url("".join(up.lines)), left, 120))
        assert Counter(markers.values()) == Counter({"aborted": SESSIONS})  # the materializer saw them end
    finally:
        assert up.stop() == 0, "".join(up.lines[-40:])
