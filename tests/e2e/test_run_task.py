"""``run_task`` end to end: the OpenAI and Anthropic agents drive a real stack whose scripted engine calls
tools (hermes ``<tool_call>`` text); the tools run in the sandbox, their observations reach the next
request, the task scores and the reward lands on the session. The evaluation path posts nothing."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from agent_framework.builtin import RewardPostError, RunTask, TaskConfigError, example_rows, run_task
from agent_framework.builtin.config import TaskFile, load_task_file, resolve_spec
from agent_framework.builtin.datasets import write_examples
from agent_framework.builtin.runner import post_reward
from agent_framework.builtin.tasks.arithmetic import parse_integer
from agent_framework.config import RunnerConfig
from agent_framework.dispatch import load_runner
from agent_framework.session import SessionHandle
from rollbus.testing.scripted import ScriptedReply

IM_END = 151645
ADD = example_rows("python_function")[0]  # def add(a, b); hidden tests: 3 asserts
LOAVES = example_rows("arithmetic")[0]  # 12 loaves an hour for 7 hours: 84


def said(tokenizer, text: str, *, finish: str = "stop") -> ScriptedReply:
    ids = tokenizer.encode(text)
    return ScriptedReply(token_ids=[*ids, IM_END] if finish == "stop" else ids, finish_reason=finish)


def calls(tokenizer, name: str, arguments: dict, text: str = "") -> ScriptedReply:
    payload = json.dumps({"name": name, "arguments": arguments})
    return said(tokenizer, f"{text}<tool_call>\n{payload}\n</tool_call>")


async def open_handle(stack) -> SessionHandle:
    async with httpx.AsyncClient() as client:
        # A uid of its own per session: one session per (uid, session_index), and a test may open several.
        response = await client.post(f"{stack.url}/sessions", json={"uid": f"task-{uuid.uuid4().hex[:12]}"},
                                     headers=stack.admin)
    assert response.status_code == 201, response.text
    body = response.json()
    return SessionHandle(session_id=body["session_id"], base_url=body["base_url"],
                         anthropic_base_url=body["anthropic_base_url"], reward_url=body["reward_url"],
                         api_key=body["api_key"])


async def summary(stack, session: SessionHandle) -> dict:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"{stack.url}/sessions/{session.session_id}", headers=stack.admin)
    return response.json()


def seen(tokenizer, engine, request: int) -> str:
    """What the engine was asked to continue in its ``request``-th generation."""
    return tokenizer.decode(engine.requests[request]["input_ids"])


async def test_openai_agent_computes_with_python_then_submits(stack, engine, tokenizer):
    engine.push(calls(tokenizer, "python", {"code": "print(12 * 7)"}, "Let me compute.\n"),
                calls(tokenizer, "submit", {"answer": "84"}))
    session = await open_handle(stack)
    framework_extras = {"uid": "u", "index": 0, "global_steps": 3, "validate": False, "data_source": "rollbus/x"}
    result = await run_task(session=session, raw_prompt=LOAVES["raw_prompt"], sample_index=0,
                            tools_kwargs=LOAVES["tools_kwargs"], **framework_extras)
    assert result["reward"] == 1.0 and result["finished"] and result["answer"] == "84"
    assert result["turns"] == 2 and result["stop"] == "submit" and result["posted"]
    first, second = seen(tokenizer, engine, 0), seen(tokenizer, engine, 1)
    assert '"name": "python"' in first and '"name": "submit"' in first  # the task's tools reached the template
    assert "12 loaves of bread" in first and "call `submit`" in first  # the row's prompt, the system prompt
    assert "<tool_response>\n84\n</tool_response>" in second  # the sandbox's output, as the next turn's input
    state = await summary(stack, session)
    assert state["reward"] == 1.0 and state["reward_info"] == {"finished": True, "acc": 1.0}


async def test_anthropic_agent_writes_a_function_that_passes_the_hidden_tests(stack, engine, tokenizer, tmp_path):
    config = tmp_path / "tasks.yaml"
    config.write_text("tasks:\n  python_function:\n    agent: {name: anthropic, max_tokens: 256}\n")
    code = "def add(a, b):\n    return a + b\n"
    engine.push(calls(tokenizer, "str_replace_editor", {"command": "create", "path": "solution.py", "file_text": code}),
                calls(tokenizer, "python", {"code": "from solution import add\nprint(add(2, 40))"}),
                calls(tokenizer, "submit", {"answer": "done"}))
    session = await open_handle(stack)
    runner = load_runner(RunnerConfig(name="builtin", runner_fqn="agent_framework.builtin.RunTask",
                                      tool_config_path=str(config)))  # as the framework builds it
    assert isinstance(runner, RunTask)
    result = await runner(session=session, raw_prompt=ADD["raw_prompt"], sample_index=0,
                          tools_kwargs=json.dumps(ADD["tools_kwargs"]))  # as a Parquet row holds it
    assert result["reward"] == 1.0 and result["reward_info"]["pass_rate"] == 1.0 and result["turns"] == 3
    assert "<tool_response>\nFile created: solution.py\n</tool_response>" in seen(tokenizer, engine, 1)
    assert "<tool_response>\n42\n</tool_response>" in seen(tokenizer, engine, 2)
    assert "assert add" not in seen(tokenizer, engine, 2)  # the hidden tests stay hidden
    assert engine.requests[0]["sampling_params"]["max_new_tokens"] <= 256  # the config file's max_tokens
    state = await summary(stack, session)
    assert state["reward"] == 1.0 and state["reward_info"]["acc"] == 1.0


async def test_submitted_code_is_graded_in_the_sandbox_and_failing_tests_give_zero(stack, engine, tokenizer):
    engine.push(calls(tokenizer, "submit", {"answer": "```python\ndef add(a, b):\n    return 3\n```"}))
    session = await open_handle(stack)
    result = await run_task(session=session, raw_prompt=ADD["raw_prompt"], sample_index=0,
                            tools_kwargs=ADD["tools_kwargs"])
    assert result["reward"] == 0.0 and result["finished"]
    assert result["reward_info"]["pass_rate"] == pytest.approx(1 / 3)  # add(1, 2) == 3 only
    state = await summary(stack, session)
    assert state["reward"] == 0.0 and state["reward_info"]["pass_rate"] == pytest.approx(1 / 3)


async def test_the_evaluation_path_returns_the_reward_and_posts_nothing(stack, engine, tokenizer):
    engine.push(said(tokenizer, "12 * 7 = 84, so the answer is 84."))
    session = await open_handle(stack)
    external = SessionHandle.external(session.base_url, api_key=session.api_key)
    result = await run_task(session=external, raw_prompt=LOAVES["raw_prompt"], sample_index=0,
                            tools_kwargs=LOAVES["tools_kwargs"])
    assert result["reward"] == 1.0 and result["stop"] == "final_text" and not result["posted"]
    state = await summary(stack, session)
    assert state["turns"] == 1 and state["reward"] is None


async def test_max_turns_and_a_full_trajectory_end_the_episode_unfinished(stack, engine, tokenizer):
    engine.push(*[calls(tokenizer, "python", {"code": f"print({n})"}) for n in range(2)])
    session = await open_handle(stack)
    looping = {"task": {"name": "arithmetic", "answer": 84, "max_turns": 2}}
    result = await run_task(session=session, raw_prompt=[], sample_index=0, tools_kwargs=looping)
    assert result == {**result, "finished": False, "stop": "max_turns", "turns": 2, "reward": 0.0}
    assert "How many loaves" not in seen(tokenizer, engine, 0)  # no prompt in the row: the task's own
    state = await summary(stack, session)
    assert state["reward"] == 0.0 and state["reward_info"] == {"finished": False, "acc": 0.0}

    engine.push(said(tokenizer, "Let me think about 12 times", finish="length"))
    cut = await open_handle(stack)
    result = await run_task(session=cut, raw_prompt=LOAVES["raw_prompt"], sample_index=0,
                            tools_kwargs={"task": "arithmetic", "answer": 84, "agent": "anthropic"})
    assert result["stop"] == "length" and not result["finished"] and result["reward"] == 0.0


async def test_a_tool_error_is_an_observation_and_the_episode_goes_on(stack, engine, tokenizer):
    engine.push(calls(tokenizer, "python", {"source": "print(1)"}),
                calls(tokenizer, "shell", {"command": "cat /proc/self/net/dev | wc -l; exit 4"}),
                calls(tokenizer, "submit", {"answer": "84"}))
    session = await open_handle(stack)
    result = await run_task(session=session, raw_prompt=LOAVES["raw_prompt"], sample_index=0,
                            tools_kwargs=LOAVES["tools_kwargs"] | {"tools": ["python", "shell", "submit"]})
    assert result["reward"] == 1.0 and result["tool_calls"] == 3
    assert "error: python: missing required argument(s): code" in seen(tokenizer, engine, 1)
    assert "3\n[exit code 4]" in seen(tokenizer, engine, 2)  # the namespace has only lo: 2 header lines + lo


async def test_a_broken_task_raises_before_any_model_call(engine):
    nowhere = SessionHandle.external("http://127.0.0.1:9/v1")
    for tools_kwargs, message in [({"task": "chess"}, "unknown task 'chess'; known tasks: arithmetic"),
                                  ({"task": "arithmetic"}, "answer"),
                                  ({"answer": 3}, "must name the task"),
                                  ('{"task": "arithmetic", "answer": 3, "agent": "gpt"}', "unknown agent 'gpt'"),
                                  ({"task": "arithmetic", "answer": 3, "sandbox": {"cpus": 2}}, "cpus")]:
        with pytest.raises(ValueError, match=message):
            await run_task(session=nowhere, raw_prompt=[], sample_index=0, tools_kwargs=tools_kwargs)
    assert engine.requests == []


async def test_a_refused_reward_post_raises_with_the_status(stack):
    session = await open_handle(stack)
    wrong_key = SessionHandle(session_id=session.session_id, base_url=session.base_url,
                              reward_url=session.reward_url, api_key="rb-not-the-key")
    with pytest.raises(RewardPostError, match="answered 401"):
        await post_reward(wrong_key, {"reward": 1.0})


def test_config_layers_merge_defaults_then_task_then_row(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps({"defaults": {"sandbox": {"cpu_s": 3, "memory_mb": 512}, "max_turns": 4},
                                "tasks": {"arithmetic": {"agent": "anthropic", "sandbox": {"cpu_s": 5}}}}))
    spec = resolve_spec({"task": {"name": "arithmetic", "sandbox": {"wall_s": 7}}, "answer": 9}, load_task_file(path))
    assert spec.agent.name == "anthropic" and spec.agent.max_turns == 4
    assert (spec.sandbox.cpu_s, spec.sandbox.memory_mb, spec.sandbox.wall_s) == (5, 512, 7)
    assert spec.data == {"answer": 9}
    with pytest.raises(TaskConfigError, match="defaults"):
        (tmp_path / "verl.yaml").write_text("tools:\n  - class_name: x\n")
        load_task_file(tmp_path / "verl.yaml")
    assert resolve_spec({"answer": 1}, TaskFile(), default_task="arithmetic").name == "arithmetic"


def test_integer_answers_parse_from_the_last_number():
    assert [parse_integer(t) for t in ["84", "1,234", "-7", "The answer is 84.", "84.0", "\\boxed{84}"]] == [
        84, 1234, -7, 84, 84, 84]
    assert [parse_integer(t) for t in ["84.5", "eighty-four", "", None]] == [None] * 4


def test_the_examples_write_the_prompts_parquet_layout(tmp_path):
    import pyarrow.parquet as pq

    table = pq.read_table(write_examples(tmp_path / "prompts.parquet"))
    assert table.num_rows == 40 and table.column_names == ["raw_prompt", "tools_kwargs", "data_source", "uid", "index"]
    first = table.slice(0, 1).to_pylist()[0]
    assert first["raw_prompt"] == LOAVES["raw_prompt"] and json.loads(first["tools_kwargs"]) == LOAVES["tools_kwargs"]
    assert all("_" not in uid for uid in table.column("uid").to_pylist())
