"""smolagents' ``ToolCallingAgent``, as shipped, against ``rollbus up``: it calls its one tool once,
then finishes through its ``final_answer`` tool; the session's record is token-exact. It sends
``tool_choice: "required"`` on every step, which the edge serves through the engine's constrained
decoding.

Only the session's URL and key are set (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``).
"""

from __future__ import annotations

import pytest

from tests.agents.run import run_python

pytestmark = pytest.mark.agent("smolagents")
ANSWER = "The echo tool answered: rollbus."


def test_smolagents_tool_calling_agent_calls_its_tool_and_answers(agent, agent_session):
    run = agent_session("smolagents", ANSWER)
    env = {**run.env, "OPENAI_BASE_URL": run.session["base_url"], "OPENAI_API_KEY": run.session["api_key"]}
    result = run_python(agent, "smolagents_run.py", ["Echo the word rollbus, then tell me what you got."],
                        env, run.workdir)
    assert result == {"output": ANSWER, "called": ["rollbus"]}
    assert run.called == ["echo", "final_answer"] and len(run.turns) == 2
    run.check()
