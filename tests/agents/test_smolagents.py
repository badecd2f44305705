"""smolagents' ``ToolCallingAgent``, as shipped, against ``rollbus up``: it calls its one tool once,
then finishes through its ``final_answer`` tool; the session's records are token-exact. It sends
``tool_choice: "required"`` on every step, which the edge serves through the engine's constrained
decoding.

smolagents sends the model's tool calls back as assistant text (``Calling tools:\n[...]``), not as
the calls it got, and their results as a user turn (``Observation:\n...``): the history no longer
holds the reply sampled, so its second step starts a chain of its own (a chain's first reply is
never rolled back), and the session leaves two records, each exactly what the model saw; the second
records its fork from the first as ``tool_calls_as_text``.

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
    first, second = sorted(run.check(chains=2), key=lambda row: len(row["prompts"]))
    decode = run.model.encoding.decode
    assert "Calling tools:" not in decode(first["prompts"]) and "Calling tools:" in decode(second["prompts"])
    # the fork is recorded with its cause: smolagents re-sent the call it got as text
    assert (first["fork_cause"], first["parent_key"]) == ("new_conversation", "")
    assert (second["fork_cause"], second["parent_key"], second["fork_message_index"]) == \
        ("tool_calls_as_text", first["key"], 2)
