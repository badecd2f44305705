"""Claude Code (``claude -p``), as shipped, against ``rollbus up``: the model calls one of Claude
Code's own tools (Bash) once and answers; then, through its Agent tool, a sub-agent runs (it calls
Bash once and answers), which leaves two chains, the parent's and the sub-agent's. Each record is
token-exact.

Claude Code 2.1.332 runs a sub-agent in the background: the Agent tool's result says it was launched,
the parent answers in the meantime, and the sub-agent's result comes back as a ``<task-notification>``
in a later user turn, which the parent answers again (``claude -p`` waits for it): one parent chain of
three turns (two, when the notification comes with the Agent tool's result).

Behind a chat template that cannot place a system message mid-conversation (a second ``rollbus up``,
on the same engine), the edge answers each chain's first request, which has one, with a 400; Claude
Code resends its text as ``<system-reminder>`` blocks in the first user message and completes, with
the same two exact chains. Its ``/context`` command only counts, through ``count_tokens``: each count
is the ``input_tokens`` a turn for that body reports. These two runs go through a recording proxy
(:mod:`tests.agents.recorder`), so they assert what Claude Code sent and got: 2.1.332 sends no
``HEAD`` (2.1.197 did), and a ``-p`` run no count.

Set: ``ANTHROPIC_BASE_URL`` (the session's ``anthropic_base_url``), ``ANTHROPIC_API_KEY`` (its key),
``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1`` (offline) and a ``HOME`` of its own.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from rollbus.testing.tool_user import TOOL_RESULT, Turn, example_arguments, read_tools, tool_call
from tests.agents.recorder import Recorder
from tests.agents.run import run
from tests.unit.test_mid_system import CLAUDE_CODE_FALLBACK, REFUSES, with_template

pytestmark = pytest.mark.agent("claude-code")
ANSWER = "The command printed rollbus."
SUBTASK = "SUBTASK-7: add 2 and 2 with Bash and answer with the number."
AGENT_CALL = {"description": "Add two numbers", "prompt": SUBTASK, "subagent_type": "general-purpose"}
BASH_CALL = {"command": "echo $((2+2))", "description": "Add 2 and 2"}
SUB_ANSWER = "4"
PARENT_ANSWER = "The sub-agent says 4."
WAITING = "The sub-agent is working on it."
TASK = "Add 2 and 2; delegate it to a sub-agent."
NOTIFICATION = "<task-notification>\n<task-id>"  # a sub-agent's result (its tools' descriptions name the tag too)
REMINDER = "<system-reminder>\n"


def claude_env(session, base_url: str) -> dict[str, str]:
    return {**session.env, "ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": session.session["api_key"],
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def run_claude(claude, session, prompt: str, recorder: Recorder | None = None) -> dict:
    """``claude -p PROMPT`` on the session (through ``recorder`` when given); its JSON result."""
    base_url = session.session["anthropic_base_url"]
    env = claude_env(session, recorder.at(base_url) if recorder is not None else base_url)
    done = run([claude, "-p", prompt, "--output-format", "json"], env, session.workdir)
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
    assert run_claude(agent, session, TASK)["result"] == PARENT_ANSWER
    assert session.called == ["Agent", "Bash"] and session.turns[-1].text == PARENT_ANSWER
    rows = session.check(chains=2)
    texts = [tokenizer.decode(row["input_ids"]) for row in rows]
    (sub,) = [text for text in texts if json.dumps(SUBTASK) not in text]
    assert f"{SUBTASK}<|im_end|>" in sub and "<tool_response>\n4\n" in sub  # the sub-agent's Bash ran
    main, sub_agent = sorted(rows, key=lambda row: row["trajectory_index"])  # its fork: a sub-agent of the main chain
    assert (main["fork_cause"], sub_agent["fork_cause"], sub_agent["parent_key"]) == \
        ("new_conversation", "sub_agent", main["key"])


@pytest.fixture(scope="module")
def refusing_up(start_up, tokenizer, tmp_path_factory):
    """A second ``rollbus up`` on the suite's engine whose template (Qwen2.5's, changed) refuses a system
    message anywhere but first (tests/unit/test_mid_system.py)."""
    saved = tokenizer.save(tmp_path_factory.mktemp("qwen"))
    return start_up("--tokenizer", with_template(saved, tmp_path_factory.mktemp("refuses"), REFUSES))


def blocks(content: str | list[dict[str, Any]]) -> list[str]:
    """The texts of a message's content."""
    return [content] if isinstance(content, str) else [b["text"] for b in content if b["type"] == "text"]


def mid_system(body: dict[str, Any]) -> list[str]:
    """The texts of the ``system`` messages inside ``messages``."""
    return [text for m in body["messages"] if m["role"] == "system" for text in blocks(m["content"])]


def first_user(body: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The first message's ``<system-reminder>`` blocks (what is inside each) and its other texts."""
    texts = blocks(body["messages"][0]["content"])
    inner = [t.strip()[len(REMINDER):-len("</system-reminder>")].strip("\n") for t in texts if t.startswith(REMINDER)]
    return inner, [t for t in texts if not t.startswith(REMINDER)]


def resends(refused: dict[str, Any], later: dict[str, Any], text: str) -> bool:
    """``later`` is ``refused`` with its system message's ``text`` moved into its first user message:
    reminders it did not have, which joined (as Claude Code splits it) are that text, the rest alike."""
    before, task = first_user(refused)
    after, same_task = first_user(later)
    return not mid_system(later) and same_task == task and "\n\n".join(r for r in after if r not in before) == text


def test_claude_code_falls_back_where_the_template_cannot_place_system_messages(agent, refusing_up, agent_session,
                                                                                tokenizer):
    session = agent_session("claude-code-fallback", PARENT_ANSWER, policy=delegate, on=refusing_up)
    with Recorder(refusing_up.url) as recorder:
        assert run_claude(agent, session, TASK, recorder)["result"] == PARENT_ANSWER
    sent = recorder.exchanges
    turns = urlparse(session.session["anthropic_base_url"]).path + "/v1/messages"
    assert {(e.method, e.path) for e in sent} == {("POST", turns)}  # turns only: no HEAD, no count
    refused = [i for i, e in enumerate(sent) if e.status == 400]
    assert len(refused) == 2, [e.status for e in sent]  # the first request of the parent's chain, the sub-agent's
    assert all(e.status == 200 for e in sent if e.status != 400)
    assert len(sent) - len(refused) == len(session.turns)  # a refused request never reached the engine
    for i in refused:
        body, error = sent[i].json(), sent[i].answer_json()["error"]
        (text,) = mid_system(body)  # its environment, agent types, skills, ...
        assert error["type"] == "invalid_request_error" and CLAUDE_CODE_FALLBACK.search(error["message"])
        assert any(resends(body, later.json(), text) for later in sent[i + 1:] if later.status == 200)
    rows = session.check(chains=2)
    texts = [tokenizer.decode(row["input_ids"]) for row in rows]
    assert all(text.count("<|im_start|>system") == 1 for text in texts)  # the system prompt only
    assert any(f"{REMINDER}Available agent types for the Agent tool:" in text for text in texts)


def turn_input_tokens(up, uid: str, body: dict[str, Any], query: str) -> int:
    """The ``usage.input_tokens`` of a turn for ``body`` in a session of its own (aborted after it)."""
    opened = httpx.post(f"{up.url}/sessions", json={"uid": uid}, headers=up.admin, timeout=30)
    assert opened.status_code == 201, opened.text
    created = opened.json()
    url = f"{created['anthropic_base_url']}/v1/messages" + (f"?{query}" if query else "")
    answer = httpx.post(url, json={**body, "max_tokens": 1}, headers={"x-api-key": created["api_key"]}, timeout=60)
    assert answer.status_code == 200, answer.text
    aborted = httpx.post(f"{up.url}/sessions/{created['session_id']}/abort", headers=up.admin, timeout=30)
    assert aborted.status_code == 200, aborted.text
    return int(answer.json()["usage"]["input_tokens"])


def test_claude_codes_context_command_counts_through_count_tokens(agent, up, agent_session):
    session = agent_session("claude-code-context", ANSWER)
    with Recorder(up.url) as recorder:
        assert "Estimated usage by category" in run_claude(agent, session, "/context", recorder)["result"]
    counts = urlparse(session.session["anthropic_base_url"]).path + "/v1/messages/count_tokens"
    assert {(e.method, e.path, e.status) for e in recorder.exchanges} == {("POST", counts, 200)}  # nothing else
    assert len(recorder.exchanges) >= 10 and not session.turns  # a count a part of its context; no turn
    assert {"Agent", "Bash"} <= {tool["name"] for e in recorder.exchanges for tool in e.json().get("tools", ())}
    for i, exchange in enumerate(recorder.exchanges):  # each count is what a turn for it reports
        turn = turn_input_tokens(up, f"claude-code-count-{i}", exchange.json(), exchange.query)
        assert exchange.answer_json()["input_tokens"] == turn, exchange.body[:500]
