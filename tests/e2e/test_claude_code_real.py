"""The real Claude Code (``claude -p``), as shipped, against a stack whose scripted SGLang engine reads
Claude Code's own tool list from the prompt: the model calls the Agent tool once, the sub-agent it
starts calls Bash once, each answers. The session then holds two chains, the parent's and the
sub-agent's, each token-exact: every engine input is a prefix of its record, ``response_mask`` is 1
on exactly the sampled tokens, the log probs are the engine's, ``rollbus replay --verify`` exits 0.
Once more with a chat template that cannot place a system message mid-conversation: Claude Code
falls back on the 400 it gets and completes. Its ``/context`` counts through ``count_tokens``.

Skipped when ``claude`` is not installed (``npm install -g @anthropic-ai/claude-code@2.1.197``, or
``ROLLBUS_CLAUDE`` naming its binary); ``ROLLBUS_REQUIRE_CLAUDE=1`` makes that a failure. Offline,
it needs only ``ANTHROPIC_BASE_URL`` (the session's ``anthropic_base_url``), ``ANTHROPIC_API_KEY``
(the session's key), ``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1`` and a ``HOME`` of its own."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import httpx
import nats
import numpy as np
import pytest

from edge.codec.tokenizer import Tokenizer
from materializer.dataset import session_rows
from materializer.verify import read_marker
from rollbus.cli import build_parser
from rollbus.commands.replay import replay_main
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply, default_logprobs
from tests.e2e.test_openai_session import IM_END, _expected_mask, open_session
from tests.stack import StackThread
from tests.unit.test_mid_system import REFUSES, with_template

TASK = "Add 2 and 2; delegate it to a sub-agent."
SUBTASK = "SUBTASK-7: add 2 and 2 with Bash and answer with the number."
AGENT_CALL = {"name": "Agent", "arguments": {"description": "Add two numbers", "prompt": SUBTASK,
                                             "subagent_type": "general-purpose"}}
BASH_CALL = {"name": "Bash", "arguments": {"command": "echo $((2+2))", "description": "Add 2 and 2"}}
ANSWER = "The sub-agent says 4."
LENGTH = 32768  # Claude Code's first prompt is some 19k tokens (its tools' schemas)


@pytest.fixture(autouse=True)
def claude() -> str:
    """Claude Code's binary (first, before a stack is started for nothing)."""
    found = os.environ.get("ROLLBUS_CLAUDE") or shutil.which("claude")
    if found is None:
        reason = "Claude Code is not installed (npm install -g @anthropic-ai/claude-code@2.1.197, or ROLLBUS_CLAUDE)"
        if os.environ.get("ROLLBUS_REQUIRE_CLAUDE") == "1":
            pytest.fail(f"ROLLBUS_REQUIRE_CLAUDE=1 but {reason}")
        pytest.skip(reason)
    return found


class Script:
    """The model: reads the tools from the prompt (the template's ``<tools>`` block), calls Agent
    once in the parent chain and Bash once in the sub-agent's, then answers; each reply kept."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.replies: list[list[int]] = []  # by engine request, in order

    def __call__(self, input_ids: list[int], body: dict[str, Any]) -> ScriptedReply:
        ids = [*self.tokenizer.encode(self.reply(self.tokenizer.decode(input_ids))), IM_END]
        self.replies.append(ids)
        return ScriptedReply(token_ids=ids, logprobs=default_logprobs(len(ids)))

    @staticmethod
    def reply(prompt: str) -> str:
        block = re.search(r"<tools>\n(.*?)\n</tools>", prompt, re.S)
        tools = {json.loads(line)["function"]["name"] for line in block.group(1).split("\n")} if block else set()
        answered = "<tool_response>" in prompt
        if SUBTASK in prompt and json.dumps(SUBTASK) not in prompt:  # the sub-agent: the task is its user turn
            return "4" if answered or "Bash" not in tools else call(BASH_CALL)
        return ANSWER if answered or "Agent" not in tools else call(AGENT_CALL)


def call(tool: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps(tool)}\n</tool_call>"


@pytest.fixture
def stack(make_stack: Any) -> StackThread:
    return make_stack(max_trajectory_length=LENGTH)


@pytest.fixture
def script(tokenizer: Tokenizer) -> Script:
    return Script(tokenizer)


@pytest.fixture
def engine(script: Script) -> Iterator[ScriptedEngineServer]:
    with ScriptedEngineServer(responder=script) as server:
        yield server


def run_claude(claude: str, session: dict[str, str], home: Path, prompt: str) -> dict[str, Any]:
    home.mkdir()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "ANTHROPIC_BASE_URL": session["anthropic_base_url"],
           "ANTHROPIC_API_KEY": session["api_key"], "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    done = subprocess.run([claude, "-p", prompt, "--output-format", "json"], env=env, cwd=home,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(done.stdout)


def records(stack: StackThread, session_id: str, count: int) -> list[dict[str, Any]]:
    answer = httpx.post(f"{stack.url}/sessions/{session_id}/finalize", headers=stack.admin, timeout=60).json()
    assert answer["trajectories"] == count
    deadline = time.monotonic() + 60
    while len(rows := session_rows(stack.trajectories, [session_id])) < count:
        assert time.monotonic() < deadline, f"{len(rows)} of {count} records"
        time.sleep(0.1)
    return rows


def check_exact(rows: list[dict[str, Any]], engine: ScriptedEngineServer, replies: list[list[int]]) -> None:
    """Each engine request belongs to one record (its input a prefix of it); per record, the mask is 1
    on exactly its requests' sampled tokens (``replies``, by request), with their log probs."""
    inputs = [r["input_ids"] for r in engine.requests]
    for row in rows:
        mine = [i for i, ids in enumerate(inputs) if row["input_ids"][: len(ids)] == ids]
        assert mine and inputs[mine[0]] == row["prompts"]
        mask, logprobs = _expected_mask([inputs[i] for i in mine], [replies[i] for i in mine])
        assert row["response_mask"] == mask
        np.testing.assert_allclose(row["rollout_log_probs"], logprobs, rtol=1e-6)
        sampled = [t for t, m in zip(row["responses"], mask, strict=True) if m]
        assert sampled == [t for i in mine for t in replies[i]]
    owners = [sum(row["input_ids"][: len(ids)] == ids for row in rows) for ids in inputs]
    assert owners == [1] * len(inputs)


async def replay_verify(stack: StackThread, session_id: str) -> tuple[int, str]:
    nc = await nats.connect(stack.nats_url)
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + 60
        while await read_marker(js, stack.options.log, session_id) is None:
            assert time.monotonic() < deadline, "no marker"
            await asyncio.sleep(0.1)
        out = io.StringIO()
        with redirect_stdout(out):
            code = await replay_main(js, stack.options.log, build_parser().parse_args(
                ["replay", "--verify", session_id, "--nats", stack.nats_url]))
        return code, out.getvalue()
    finally:
        await nc.close()


def summary(stack: StackThread, session_id: str) -> dict[str, Any]:
    return httpx.get(f"{stack.url}/sessions/{session_id}", headers=stack.admin, timeout=30).json()


def test_claude_code_with_a_sub_agent_leaves_two_exact_chains(claude, stack, engine, script, tmp_path):
    session = open_session(stack, uid="claudecode", metadata={"agent_name": "claude-code"})
    result = run_claude(claude, session, tmp_path / "home", TASK)
    assert result["result"] == ANSWER and not result["is_error"]
    held = summary(stack, session["session_id"])
    assert [chain["turns"] for chain in held["chains"]] == [2, 2] and held["requests"] == 4
    rows = records(stack, session["session_id"], 2)
    check_exact(rows, engine, script.replies)
    decode = script.tokenizer.decode
    (parent,) = [decode(r["input_ids"]) for r in rows if json.dumps(SUBTASK) in decode(r["input_ids"])]
    (sub,) = [decode(r["input_ids"]) for r in rows if json.dumps(SUBTASK) not in decode(r["input_ids"])]
    agents = parent.index("<|im_start|>system\nAvailable agent types for the Agent tool:")  # where it stood:
    assert parent.index("<|im_start|>user\n") < agents < parent.index("<|im_start|>assistant\n")  # 1st request
    assert f"{SUBTASK}<|im_end|>" in sub and "<tool_call>\n" + json.dumps(BASH_CALL) in sub
    assert asyncio.run(replay_verify(stack, session["session_id"]))[0] == 0


def test_claude_code_falls_back_where_the_template_cannot_place_system_messages(claude, make_stack, engine, script,
                                                                                 tokenizer, tmp_path):
    stack = make_stack(tokenizer=with_template(tokenizer.save(tmp_path / "qwen"), tmp_path, REFUSES),
                       max_trajectory_length=LENGTH)
    session = open_session(stack)
    assert run_claude(claude, session, tmp_path / "home", TASK)["result"] == ANSWER
    held = summary(stack, session["session_id"])
    assert [chain["turns"] for chain in held["chains"]] == [2, 2]
    rows = records(stack, session["session_id"], 2)
    check_exact(rows, engine, script.replies)
    texts = [script.tokenizer.decode(r["input_ids"]) for r in rows]
    assert all(text.count("<|im_start|>system") == 1 for text in texts)  # only the system prompt
    assert any("<system-reminder>\nAvailable agent types for the Agent tool:" in text for text in texts)
    assert asyncio.run(replay_verify(stack, session["session_id"]))[0] == 0


def test_claude_codes_context_command_counts_through_count_tokens(claude, stack, engine, tmp_path):
    session = open_session(stack)
    result = run_claude(claude, session, tmp_path / "home", "/context")
    assert "Estimated usage by category" in result["result"] and not result["is_error"]
    metrics = httpx.get(f"{stack.url}/metrics", timeout=30).text
    counted = re.search(r'route="/sessions/\{session_id\}/v1/messages/count_tokens",status="200"\} (\d+)', metrics)
    assert counted is not None and int(counted.group(1)) >= 10, metrics  # one a part of its context, and tools
    assert re.search(r'route="/sessions/\{session_id\}",status="200"\} [1-9]', metrics)  # its HEAD
    assert summary(stack, session["session_id"])["requests"] == 0 and engine.served == 0
