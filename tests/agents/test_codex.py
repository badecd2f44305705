"""Codex CLI (``codex exec``), as shipped, against ``rollbus up``: Codex speaks only the Responses API
(streamed, ``store: false``, its reasoning sent back as ``encrypted_content``); the model runs one
command through Codex's shell tool, then answers; the session's record is token-exact.

Codex reads its endpoint from a ``config.toml`` (it ignores ``OPENAI_BASE_URL``): the one written
here names the session's ``base_url`` and the variable holding its key, nothing else. ``CODEX_HOME``
and ``HOME`` are the test's own; ``--skip-git-repo-check`` lets it run outside a git repository.
"""

from __future__ import annotations

import json

import pytest

from tests.agents.run import run

pytestmark = pytest.mark.agent("codex")
ANSWER = "The command printed rollbus."
SHELL_TOOLS = ("exec_command", "shell", "shell_command", "local_shell")
CONFIG = """model = "rollbus-model"
model_provider = "rollbus"

[model_providers.rollbus]
name = "rollbus"
base_url = "{base_url}"
env_key = "ROLLBUS_SESSION_KEY"
wire_api = "responses"
"""


def test_codex_exec_runs_a_command_and_answers(agent, agent_session):
    session = agent_session("codex", ANSWER, prefer=SHELL_TOOLS)
    home = session.workdir.parent / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(CONFIG.format(base_url=session.session["base_url"]))
    env = {**session.env, "CODEX_HOME": str(home), "ROLLBUS_SESSION_KEY": session.session["api_key"]}
    last = session.workdir.parent / "last-message.txt"
    done = run([agent, "exec", "--skip-git-repo-check", "--json", "--output-last-message", last,
                "Print the word rollbus with a shell command, then tell me what it printed."], env, session.workdir)
    assert last.read_text().strip() == ANSWER
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    commands = [e["item"] for e in events if e.get("type") == "item.completed"
                and e["item"].get("type") == "command_execution"]
    assert len(commands) == 1 and commands[0]["aggregated_output"] == "rollbus\n", events  # it ran, in its sandbox
    assert len(session.called) == 1 and session.called[0] in SHELL_TOOLS and len(session.turns) == 2
    session.check()
