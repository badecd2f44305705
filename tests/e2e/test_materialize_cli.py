"""The command line around records: ``rollbus materialize --from-log [--diff]`` and ``rollbus up --transfer-queue``."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx

from eventlog.publisher import JetStreamLog
from materializer.dataset import iter_padded_batches, read_dataset, session_rows
from materializer.records import derive_records
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply, default_logprobs
from schemas.log import LogConfig
from session.fold import fold
from stack.nats_server import EmbeddedNats
from stack.provision import connect, provision
from tests.e2e.test_cli import Up
from tests.sessions import append, workload

ROLLBUS = [sys.executable, "-m", "rollbus.cli"]


def _write_log(store: Path, scripts) -> None:
    async def write():
        with EmbeddedNats(store, name="log-writer") as server:
            nc = await connect(server.url, name="writer")
            await provision(nc.jetstream(), LogConfig())
            log = JetStreamLog(nc, LogConfig())
            for script in scripts:
                await append(log, script)
            await nc.close()

    asyncio.run(write())


def _materialize(data: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*ROLLBUS, "materialize", "--from-log", "--data-dir", str(data), *args],
                          capture_output=True, text=True, timeout=300)


def test_rematerialize_from_the_log_with_other_options_and_diff(tmp_path: Path):
    scripts = workload(prompts=6, n=2, seed=4)
    scripts[0].reward(9.0)  # a reward after the end: in the log, never in the records
    _write_log(tmp_path / "data" / "nats", scripts)
    expected = {r.key: r for s in scripts if (state := fold(s.events)).status == "finalized"
                for r in derive_records(state)}

    first = _materialize(tmp_path / "data", "--out", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr
    aborted = sum(fold(s.events).status == "aborted" for s in scripts)
    assert f"into {len(expected)} records" in first.stdout and f"; {aborted} aborted" in first.stdout
    assert "log " in first.stderr  # progress on stderr
    listed = read_dataset(tmp_path / "a").to_pylist()
    assert Counter(row["key"] for row in listed) == Counter(list(expected))
    rows = {row["key"]: row for row in listed}
    for key, record in expected.items():
        assert rows[key]["input_ids"] == record.input_ids.tolist() and rows[key]["reward"] == record.reward

    second = _materialize(tmp_path / "data", "--out", str(tmp_path / "b"), "--prompt-length", "8",
                          "--response-length", "16", "--mask-unfinished-episode", "--diff", str(tmp_path / "a"))
    assert second.returncode == 0, second.stderr
    assert f"diff against {tmp_path / 'a'}:" in second.stdout and "padded 8/16" in second.stdout
    assert "changed rows per column:" in second.stdout and "different" in second.stdout
    (batch,) = list(iter_padded_batches(tmp_path / "b", batch_size=len(expected)))
    assert batch["input_ids"].shape == (len(expected), 24)

    again = _materialize(tmp_path / "data", "--out", str(tmp_path / "a"))
    assert again.returncode == 2 and "already holds a dataset" in again.stderr


def test_up_with_transfer_queue_hosts_it_and_writes_both_sinks(tmp_path: Path):
    data = tmp_path / "data"
    with ScriptedEngineServer() as engine:
        up = Up(data, engine.url, "--transfer-queue", "--batch-delay", "0.05")
        try:
            assert any("transferqueue: partition train (hosted by this process)" in line for line in up.lines)
            headers = {"Authorization": "Bearer tok"}
            session = httpx.post(f"{up.url}/sessions", json={"uid": "tq"}, headers=headers).json()
            engine.push(ScriptedReply(token_ids=[9707, 151645], logprobs=default_logprobs(2)))
            reply = httpx.post(f"{session['base_url']}/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}]},
                headers={"Authorization": f"Bearer {session['api_key']}"}, timeout=60)
            assert reply.status_code == 200, reply.text
            httpx.post(f"{up.url}/sessions/{session['session_id']}/finalize", headers=headers)
            rows = _wait(lambda: session_rows(data / "trajectories", [session["session_id"]]))
            assert [row["key"] for row in rows] == ["tq_0_0"]
        finally:
            assert up.stop() == 0, "".join(up.lines)


def _wait(probe, timeout: float = 60.0):
    import time

    deadline = time.monotonic() + timeout
    while not (found := probe()):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return found


def test_materialize_help_lists_the_record_flags():
    result = subprocess.run([*ROLLBUS, "materialize", "--help"], capture_output=True, text=True, timeout=60)
    for flag in ("--from-log", "--diff", "--prompt-length", "--mask-unfinished-episode", "--trajectory-selection",
                 "--reward-scorer"):
        assert flag in result.stdout
    help_text = subprocess.run([*ROLLBUS, "materializer", "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "--transfer-queue" in help_text and "--ray-address" in help_text
