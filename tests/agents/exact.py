"""The one check every agent's session passes: its records are token-exact.

Each engine request the agent caused belongs to exactly one record (its input ids, then the tokens it
sampled, a prefix of the record's ``input_ids``; the first of them the record's prompt); per record,
``response_mask`` is 1 on exactly the tokens its requests sampled and 0 on the context between them,
``rollout_log_probs`` are the engine's (the scripted engine's defaults) on those tokens and 0
elsewhere; and ``rollbus replay --verify`` exits 0 for the session.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from materializer.dataset import session_rows
from rollbus.testing.scripted import default_logprobs


def expected_response(inputs: list[list[int]], replies: list[list[int]]) -> tuple[list[int], list[int], list[float]]:
    """The response of a chain whose requests had ``inputs`` and sampled ``replies``: its tokens, the
    mask (1: sampled, 0: context added between turns) and the log probs (the engine's, 0 on context)."""
    tokens: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for turn, (ids, reply) in enumerate(zip(inputs, replies, strict=True)):
        if turn:
            context = ids[len(inputs[0]) + len(tokens):]
            tokens += context
            mask += [0] * len(context)
            logprobs += [0.0] * len(context)
        tokens += reply
        mask += [1] * len(reply)
        logprobs += default_logprobs(len(reply))
    return tokens, mask, logprobs


def owners(rows: list[dict[str, Any]], inputs: list[list[int]], replies: list[list[int]]) -> list[list[int]]:
    """For each request, the indexes of the records whose ``input_ids`` start with its input and then
    its reply (a chain forked from another shares its first input, not what was sampled after it)."""
    turns = [ids + reply for ids, reply in zip(inputs, replies, strict=True)]
    return [[r for r, row in enumerate(rows) if row["input_ids"][: len(ids)] == ids] for ids in turns]


def check_records(rows: list[dict[str, Any]], inputs: list[list[int]], replies: list[list[int]]) -> None:
    """Assert the records are exactly what the engine was asked and sampled (module docstring)."""
    owned = owners(rows, inputs, replies)
    assert all(len(o) == 1 for o in owned), f"requests owned by no record or by several: {owned}"
    for r, row in enumerate(rows):
        mine = [i for i, o in enumerate(owned) if o == [r]]
        assert mine, f"record {row['key']} has no engine request"
        assert row["prompts"] == inputs[mine[0]], f"record {row['key']}: its prompt is not its first request's"
        tokens, mask, logprobs = expected_response([inputs[i] for i in mine], [replies[i] for i in mine])
        assert row["responses"] == tokens, f"record {row['key']}: its response is not what was sent and sampled"
        assert row["response_mask"] == mask, f"record {row['key']}: the mask is not 1 on exactly the sampled tokens"
        np.testing.assert_allclose(row["rollout_log_probs"], logprobs, rtol=1e-6, atol=0)


def finalize(url: str, admin: dict[str, str], session_id: str) -> int:
    """Finalize the session; the number of trajectories it left."""
    answer = httpx.post(f"{url}/sessions/{session_id}/finalize", headers=admin, timeout=60)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["trajectories"])


def wait_rows(trajectories: Path, session_id: str, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while len(rows := session_rows(trajectories, [session_id])) < count:
        assert time.monotonic() < deadline, f"{len(rows)} of {count} records of {session_id} written"
        time.sleep(0.1)
    assert len(rows) == count
    return rows


def replay_verify(data_dir: Path, session_id: str, timeout: float = 60.0) -> str:
    """``rollbus replay --verify SESSION`` against the running ``rollbus up`` of ``data_dir``; retried while
    the marker is not written yet; asserts it exits 0 and returns its output."""
    command = [sys.executable, "-m", "rollbus.cli", "replay", "--verify", session_id, "--data-dir", str(data_dir)]
    deadline = time.monotonic() + timeout
    while True:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode == 0 or "missing_marker" not in done.stdout or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout
