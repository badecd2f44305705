"""The OpenAI Agents SDK (``openai-agents``), as shipped, against ``rollbus up``: an Agent with one
function tool calls it once and answers, through the SDK's default model (the Responses API) and
through its chat-completions model, plain and streamed; each session's record is token-exact.

Only the session's URL and key are set (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``), and
``OPENAI_AGENTS_DISABLE_TRACING=1``, which keeps it offline (it would upload traces to OpenAI).
"""

from __future__ import annotations

import pytest

from tests.agents.run import run_python

pytestmark = pytest.mark.agent("openai-agents")
ANSWER = "The echo tool answered: rollbus."


@pytest.mark.parametrize("mode", ["chat", "chat-stream", "responses"])
def test_openai_agents_calls_its_tool_and_answers(mode, agent, agent_session):
    run = agent_session(f"openai-agents-{mode}", ANSWER)
    env = {**run.env, "OPENAI_BASE_URL": run.session["base_url"], "OPENAI_API_KEY": run.session["api_key"],
           "OPENAI_AGENTS_DISABLE_TRACING": "1"}
    result = run_python(agent, "openai_agents_run.py", [mode, "Echo the word rollbus, then tell me what you got."],
                        env, run.workdir)
    assert result == {"output": ANSWER, "called": ["rollbus"]}
    assert run.called == ["echo"] and len(run.turns) == 2
    run.check()
