"""LangGraph's prebuilt ReAct agent over langchain-openai's ``ChatOpenAI``, as shipped, against
``rollbus up``: with ``use_responses_api`` false (chat completions) and true (the Responses API), it
calls its one tool once and answers; each session's record is token-exact.

Only the session's URL and key are set (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``); LangSmith tracing
is off unless asked for.
"""

from __future__ import annotations

import pytest

from tests.agents.run import run_python

pytestmark = pytest.mark.agent("langgraph")
ANSWER = "The echo tool answered: rollbus."


@pytest.mark.parametrize("mode", ["chat", "responses"])
def test_langgraph_calls_its_tool_and_answers(mode, agent, agent_session):
    run = agent_session(f"langgraph-{mode}", ANSWER)
    env = {**run.env, "OPENAI_BASE_URL": run.session["base_url"], "OPENAI_API_KEY": run.session["api_key"]}
    result = run_python(agent, "langgraph_run.py", [mode, "Echo the word rollbus, then tell me what you got."],
                        env, run.workdir)
    assert result == {"output": ANSWER, "called": ["rollbus"]}
    assert run.called == ["echo"] and len(run.turns) == 2
    run.check()
