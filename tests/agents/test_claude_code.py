"""Claude Code (``claude -p``), as shipped, against ``rollbus up``: the model calls one of Claude
Code's own tools (Bash) once and answers; then, through its Agent tool, a sub-agent runs (it calls
Bash once and answers), which leaves two chains, the parent's and the sub-agent's. Each record is
token-exact.

Claude Code 2.1.332 runs a sub-agent in the background: the Agent tool's result says it was launched,
the parent answers in the meantime, and the sub-agent's result comes back as a ``<task-notification>``
in a later user turn, which the parent answers again (``claude -p`` waits for it): one parent chain of
three turns (two, when the notification comes with the Agent tool's result).

Set: ``ANTHROPIC_BASE_URL`` (the session's ``anthropic_base_url``), ``ANTHROPIC_API_KEY`` (its key),
``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1`` (offline) and a ``HOME`` of its own.
"""

from __future__ import annotations

import json

import pytest

from rollbus.testing.tool_user import TOOL_RESULT, Turn, example_arguments, read_tools, tool_call
from tests.agents.run import run

pytestmark = pytest.mark.agent("claude-code")
ANSWER = "The command printed rollbus."
SUBTASK = "SUBTASK-7: add 2 and 2 with Bash and answer with the number."
AGENT_CALL = {"description": "Add two numbers", "prompt": SUBTASK, "subagent_type": "general-purpose"}
BASH_CALL = {"command": "echo $((2+2))", "description": "Add 2 and 2"}
SUB_ANSWER = "4"
PARENT_ANSWER = "The sub-agent says 4."
WAITING = "The sub-agent is working on it."
NOTIFICATION = "<task-notification>"


def claude_env(session) -> dict[str, str]:
    return {**session.env, "ANTHROPIC_BASE_URL": session.session["anthropic_base_url"],
            "ANTHROPIC_API_KEY": session.session["api_key"], "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def run_claude(claude, session, prompt: str) -> dict:
    done = run([claude, "-p", prompt, "--output-format", "json"], claude_env(session), session.workdir)
    result = json.loads(done.stdout)
    assert not result["is_error"], result
    return result


def test_claude_code_calls_one_of_its_tools_and_answers(agent, agent_session):
    session = agent_session("claude-code", ANSWER, prefer=("Bash",))
    assert run_claude(agent, session, "Print the word rollbus.")["result"] == ANSWER
    assert session.called == ["Bash"] and len(session.turns) == 2
    (row,) = session.check()
    assert "<tool_response>\nrollbus\n" in session.model.encoding.decode(row["input_ids"])  # it ran


def delegate(prompt: str) -> Turn:
    """The parent calls Agent, the sub-agent (whose user turn is the sub-task) Bash; each then answers
    (the parent once the sub-agent's result came back, and in the meantime that it waits)."""
    tools = {tool.name: tool for tool in read_tools(prompt)}
    if SUBTASK in prompt and json.dumps(SUBTASK) not in prompt:
        if TOOL_RESULT in prompt:
            return Turn(SUB_ANSWER, None)
        assert BASH_CALL.keys() >= example_arguments(tools["Bash"].parameters).keys()
        return Turn(tool_call("Bash", BASH_CALL), "Bash")
    if TOOL_RESULT in prompt:
        return Turn(PARENT_ANSWER if NOTIFICATION in prompt else WAITING, None)
    assert AGENT_CALL.keys() >= example_arguments(tools["Agent"].parameters).keys()
    return Turn(tool_call("Agent", AGENT_CALL), "Agent")


def test_claude_code_runs_a_sub_agent_in_a_chain_of_its_own(agent, agent_session, tokenizer):
    session = agent_session("claude-code-agent", PARENT_ANSWER, policy=delegate)
    assert run_claude(agent, session, "Add 2 and 2; delegate it to a sub-agent.")["result"] == PARENT_ANSWER
    assert session.called == ["Agent", "Bash"] and session.turns[-1].text == PARENT_ANSWER
    rows = session.check(chains=2)
    texts = [tokenizer.decode(row["input_ids"]) for row in rows]
    (sub,) = [text for text in texts if json.dumps(SUBTASK) not in text]
    assert f"{SUBTASK}<|im_end|>" in sub and "<tool_response>\n4\n" in sub  # the sub-agent's Bash ran
