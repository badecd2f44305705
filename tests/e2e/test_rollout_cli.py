"""``rollbus rollout``: the adapter over a prompts dataset, without a trainer, as a user runs it.

The built-in tasks end to end: on the local CPU engine (a random model: the rewards are what
they are, the records must be there), and on a scripted SGLang engine whose answers are right
for some prompts and wrong for the others (the rewards must be exactly those).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from agent_framework.builtin import example_rows, write_parquet
from edge.tokens.tokenizer import load_tokenizer
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply

IM_END = 151645
QUESTIONS = example_rows("arithmetic")[:4]


def config_file(tmp_path: Path, *, engine: str, urls: list[str] | None = None, n: int = 1) -> Path:
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text("defaults:\n  max_turns: 3\n  max_tokens: 24\n")
    path = tmp_path / "rollout.yaml"
    path.write_text(f"""
actor_rollout_ref:
  model: {{path: "builtin:qwen2.5"}}
  rollout:
    n: {n}
    prompt_length: 1024
    response_length: 512
    custom:
      agent_framework:
        engine: {engine}
        engine_urls: {json.dumps(urls or [])}
        data_dir: {tmp_path / "data"}
        agent_runners:
          run_task:
            runner_fqn: agent_framework.builtin.RunTask
            runner_kwargs: {{task_config_path: {tasks}}}
""")
    return path


def rollout(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollbus.cli", "rollout", *args], cwd=tmp_path, text=True,
                          capture_output=True, timeout=600)


def records(tmp_path: Path) -> list[dict]:
    return ds.dataset(tmp_path / "data" / "trajectories").to_table(columns=["uid", "reward", "response_mask"]
                                                                    ).to_pylist()


@pytest.mark.timeout(600)  # a rollout starts Ray and TransferQueue: over 300 s on a loaded 2-core VM
def test_the_builtin_tasks_roll_out_on_the_local_engine(tmp_path):
    rows = [example_rows("arithmetic")[0], example_rows("python_function")[0]]
    data = write_parquet(rows, tmp_path / "prompts.parquet")
    done = rollout(tmp_path, "--config", str(config_file(tmp_path, engine="local")), "--data", str(data))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 prompts, 2 sessions: 2 succeeded, 0 failed" in done.stdout
    assert "rollouts: 2/2 sessions ended (0 failed)" in done.stderr  # plain progress lines off a terminal
    ray_lines = [line for line in done.stderr.splitlines() if re.search(r"\b(INFO|WARNING) \S+\.py:\d+ --", line)]
    assert ray_lines == [], ray_lines  # Ray's own notices (started a local instance, token auth, SIGTERM) are off
    written = records(tmp_path)
    assert len(written) == 2 and all(r["reward"] in (0.0, 1.0) for r in written)
    assert all(1 in r["response_mask"] for r in written)  # the model's sampled tokens are in the records


@pytest.fixture
def engine() -> Iterator[ScriptedEngineServer]:
    """Submits the right answer to questions 0 and 2 and a wrong one to 1 and 3."""
    tokenizer = load_tokenizer("builtin:qwen2.5")
    answers = {row["raw_prompt"][0]["content"]: (i, row["tools_kwargs"]["answer"]) for i, row in enumerate(QUESTIONS)}

    def reply(input_ids: list[int], body: dict) -> ScriptedReply:
        text = tokenizer.decode(input_ids)
        index, answer = next(v for q, v in answers.items() if q in text)
        said = answer if index % 2 == 0 else answer + 1
        call = json.dumps({"name": "submit", "arguments": {"answer": str(said)}})
        return ScriptedReply(token_ids=[*tokenizer.encode(f"<tool_call>\n{call}\n</tool_call>"), IM_END])

    with ScriptedEngineServer(responder=reply) as server:
        yield server


@pytest.mark.timeout(600)  # a rollout starts Ray and TransferQueue: over 300 s on a loaded 2-core VM
def test_the_rewards_are_the_scripted_engines_answers(tmp_path, engine):
    config = config_file(tmp_path, engine="sglang", urls=[engine.url], n=2)
    done = rollout(tmp_path, "--config", str(config), "--data", "builtin:arithmetic", "--limit", "4",
                   "--batch-size", "3")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if re.match(r"^[0-9a-f-]{36} ", line)]
    assert [(int(line.split()[1]), line.split()[2], line.split()[4]) for line in lines] == [
        (0, "2", "1.00"), (1, "2", "0.00"), (2, "2", "1.00"), (3, "2", "0.00")]
    assert "4 prompts, 8 sessions: 8 succeeded, 0 failed" in done.stdout
    assert sorted(r["reward"] for r in records(tmp_path)) == [0.0] * 4 + [1.0] * 4


def test_mistakes_are_one_line(tmp_path):
    missing = rollout(tmp_path, "--data", str(tmp_path / "nope.parquet"))
    assert missing.returncode == 2 and missing.stderr.strip().count("\n") == 0
    assert "no such file" in missing.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text('actor_rollout_ref: {model: {path: "builtin:qwen2.5"}, rollout: {n: 0, custom: '
                   '{agent_framework: {agent_runners: {a: {runner_fqn: x.y}}}}}}\n')
    wrong = rollout(tmp_path, "--config", str(bad), "--data", "builtin:arithmetic")
    assert wrong.returncode == 2 and "actor_rollout_ref.rollout.n must be >= 1" in wrong.stderr
    assert "Traceback" not in wrong.stderr
    bad.write_text(bad.read_text().replace("n: 0", "nn: 2, temperature: hot"))  # verl's n, mistyped: named
    typo = rollout(tmp_path, "--config", str(bad), "--data", "builtin:arithmetic")
    assert typo.returncode == 2 and typo.stderr.strip().count("\n") == 0, typo.stderr
    assert typo.stderr.strip() == ("rollbus rollout: actor_rollout_ref.rollout.nn: unknown key (did you mean n?); "
                                   "actor_rollout_ref.rollout.temperature must be float >= 0, got 'hot'")


def test_the_evaluation_path_points_the_runner_at_any_openai_url_and_writes_no_records(tmp_path, stack):
    import httpx

    session = httpx.post(f"{stack.url}/sessions", json={"uid": "evaluation"}, headers=stack.admin).json()
    config = config_file(tmp_path, engine="local")
    done = rollout(tmp_path, "--config", str(config), "--data", "builtin:arithmetic", "--limit", "2",
                   "--eval-url", session["base_url"], "--eval-api-key", session["api_key"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 prompts evaluated against" in done.stdout and "mean reward 0.500" in done.stdout
    assert not (tmp_path / "data").exists()  # no stack, no records
    summary = httpx.get(f"{stack.url}/sessions/{session['session_id']}", headers=stack.admin).json()
    assert summary["reward"] is None  # nothing was posted to the session it borrowed
