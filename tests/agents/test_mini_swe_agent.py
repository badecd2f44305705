"""mini-swe-agent's ``mini`` command, as shipped, against ``rollbus up``: its model (LiteLLM, tool
calling) runs one harmless command through its ``bash`` tool, then submits the way the agent finishes
(a command whose output's first line is ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``); the session's
record is token-exact.

Set: the session's URL and key (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``), ``MSWEA_CONFIGURED=true``
(else its first run asks for a default model on the terminal) and ``LITELLM_LOCAL_MODEL_COST_MAP=True``
(else LiteLLM fetches its price list from the internet). ``mini`` is its console script's module, run
with the agent's Python (``python -m minisweagent.run.mini``: a cached virtualenv keeps working
wherever it lies).
"""

from __future__ import annotations

import json

import pytest

from tests.agents.run import run

pytestmark = pytest.mark.agent("mini-swe-agent")
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def test_mini_swe_agent_runs_a_command_and_submits(agent, agent_session):
    session = agent_session("mini-swe-agent", "unused", finish=("bash", {"command": SUBMIT}))
    env = {**session.env, "OPENAI_BASE_URL": session.session["base_url"], "OPENAI_API_KEY": session.session["api_key"],
           "MSWEA_CONFIGURED": "true", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    trajectory = session.workdir / "trajectory.json"
    run([agent, "-m", "minisweagent.run.mini", "--model", "openai/gpt-4.1", "--task", "Print the word rollbus.",
         "--yolo", "--exit-immediately", "--output", trajectory], env, session.workdir)
    saved = json.loads(trajectory.read_text())
    assert saved["info"]["exit_status"] == "Submitted", saved["info"]
    outputs = [m["content"] for m in saved["messages"] if m.get("role") == "tool"]
    assert '"output": "rollbus\\n"' in outputs[0]  # the echo ran; the submission is the second
    assert session.called == ["bash", "bash"] and len(session.turns) == 2
    session.check()
