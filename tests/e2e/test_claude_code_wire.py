"""End to end through the official ``anthropic`` SDK, shaped as Claude Code 2.1 sends it: ``system``
messages inside ``messages``, streamed turns with ``?beta=true``, ``thinking: adaptive``,
``context_management``, ``output_config``, ``metadata`` and ``cache_control`` everywhere, a
``count_tokens`` before each turn, and ``HEAD`` on the session URL. The session is one token-exact
chain; each count is exactly the turn's ``input_tokens``. A template that cannot place a system
message mid-conversation answers it with a 400 in the words Claude Code falls back on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import msgspec
import pytest
from openai import BadRequestError as OpenAIBadRequest
from openai import OpenAI

from edge.chat.conversation import Conversation
from edge.wires.anthropic import decode_request, neutral_messages
from rollbus.testing.scripted import ScriptedReply, default_logprobs
from schemas.wire_anthropic import MessagesRequest
from tests.e2e import scenario
from tests.e2e.test_anthropic_session import finalize
from tests.e2e.test_claude_code_header import billing
from tests.e2e.test_openai_session import IM_END, call_text, open_session, reply
from tests.unit.test_mid_system import CLAUDE_CODE_FALLBACK, REFUSES, with_template

PROMPT = "You are a Claude agent, built on Anthropic's Claude Agent SDK."
AGENTS = "Available agent types for the Agent tool:\n- general-purpose: researches and executes tasks. (Tools: *)"
REMINDER = "Reminder: answer in one sentence."
EPHEMERAL = {"type": "ephemeral"}
TOOLS = [{**tool, "cache_control": EPHEMERAL} for tool in scenario.ANTHROPIC_TOOLS]
FIELDS: dict[str, Any] = {
    "model": "claude-opus-4-8", "thinking": {"type": "adaptive"},
    "metadata": {"user_id": json.dumps({"device_id": "9b7b", "account_uuid": "", "session_id": "2187"})},
    "extra_body": {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                   "output_config": {"effort": "high"}},
    "extra_query": {"beta": "true"},
    "extra_headers": {"anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07"},
}


def system(turn: int) -> list[dict[str, Any]]:
    return [{"type": "text", "text": billing(turn)}, {"type": "text", "text": PROMPT, "cache_control": EPHEMERAL}]


def first_messages() -> list[dict[str, Any]]:
    return [{"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>\nToday's date is 2026-12-02.\n</system-reminder>\n\n"},
                {"type": "text", "text": "What is 6*7?", "cache_control": EPHEMERAL}]},
            {"role": "system", "content": AGENTS}]


def streamed(client: anthropic.Anthropic, messages: list[dict[str, Any]], turn: int) -> Any:
    with client.messages.stream(max_tokens=64000, system=system(turn), messages=messages, tools=TOOLS,
                                **FIELDS) as events:
        return events.get_final_message()


def counted(client: anthropic.Anthropic, messages: list[dict[str, Any]], turn: int) -> int:
    fields = {k: v for k, v in FIELDS.items() if k not in ("metadata", "extra_body")}  # as Claude Code counts
    return client.messages.count_tokens(system=system(turn), messages=messages, tools=TOOLS, **fields).input_tokens


def rendered(tokenizer, messages: list[dict[str, Any]]) -> str:
    """The template's render of the whole conversation (it ends with an assistant turn, which a request
    may not), system messages where they stand."""
    request = msgspec.json.decode(json.dumps({"max_tokens": 1, "system": system(0), "messages": messages}),
                                  type=MessagesRequest)
    tools = decode_request(json.dumps({"max_tokens": 1, "tools": TOOLS, "messages": messages[:1]}).encode()).tools
    return scenario.render(tokenizer, Conversation(messages=neutral_messages(request), tools=tools))


def test_a_claude_code_shaped_session_is_one_exact_chain_and_counts_are_exact(stack, engine, tokenizer):
    # The second reply is sampled a character a token, as no tokenizer would encode it: the count of a
    # turn that continues the chain is the chain's tokens and the increment, not a fresh render's.
    spelled = [t for ch in "The answer is 42." for t in tokenizer.encode(ch)] + [IM_END]
    replies = [reply(tokenizer, call_text("6*7")), ScriptedReply(token_ids=spelled, logprobs=default_logprobs(
        len(spelled))), reply(tokenizer, "You're welcome.")]
    engine.push(*replies)
    session = open_session(stack, uid="claudecode", metadata={"agent_name": "claude-code"})
    assert httpx.head(session["anthropic_base_url"], timeout=30).status_code == 200  # its preconnect
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    messages = first_messages()
    counts = []
    for turn in range(3):
        counts.append(counted(client, messages, turn))
        message = streamed(client, messages, turn)
        assert message.usage.input_tokens == counts[-1] == len(engine.requests[turn]["input_ids"])
        blocks = [b.model_dump(exclude_none=True) for b in message.content]
        messages.append({"role": "assistant", "content": blocks})
        if turn == 0:
            (use,) = [b for b in blocks if b["type"] == "tool_use"]
            messages += [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                       "content": "42", "cache_control": EPHEMERAL}]},
                         {"role": "system", "content": [{"type": "text", "text": REMINDER}]}]
        elif turn == 1:
            assert blocks == [{"type": "text", "text": "The answer is 42."}]
            messages.append({"role": "user", "content": "Thanks!"})
    assert counts[0] < counts[1] < counts[2]
    fresh = len(tokenizer.encode(rendered(tokenizer, messages[:-1]) + "<|im_start|>assistant\n"))
    assert counts[2] == fresh + len(spelled) - len(tokenizer.encode("The answer is 42.<|im_end|>"))

    summary = httpx.get(f"{stack.url}/sessions/{session['session_id']}", headers=stack.admin).json()
    assert [chain["turns"] for chain in summary["chains"]] == [3]
    assert finalize(stack, session)["trajectories"] == 1
    row = scenario.read_row(stack, session["session_id"])
    full = rendered(tokenizer, messages)
    scenario.check_row(row, engine.requests, replies, tokenizer, full)
    text = tokenizer.decode(row["input_ids"])
    order = [text.index(piece) for piece in ("What is 6*7?", AGENTS, "42\n</tool_response>", REMINDER, "Thanks!")]
    assert order == sorted(order) and f"<|im_start|>system\n{AGENTS}<|im_end|>" in text
    assert "x-anthropic-billing-header" not in text


def test_head_answers_anyone_and_get_stays_the_admins(stack):
    session = open_session(stack)
    url = session["anthropic_base_url"]
    for target in (url, f"{stack.url}/sessions/{'0' * 32}"):  # the same for a session that does not exist
        answer = httpx.head(target, timeout=30)
        assert (answer.status_code, answer.content) == (200, b"")
    for key in (session["api_key"], None):  # the summary is the trainer's: not the agent's
        headers = {"x-api-key": key} if key else {}
        assert httpx.get(url, headers=headers, timeout=30).status_code == 401
    assert httpx.get(url, headers=stack.admin, timeout=30).json()["session_id"] == session["session_id"]


def test_count_tokens_needs_the_key_and_records_nothing(stack, engine, tokenizer):
    session = open_session(stack)
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    stranger = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key="rb-not-this-one",
                                   max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.count_tokens(model="m", messages=first_messages())
    count = client.messages.count_tokens(model="m", messages=first_messages(), tools=TOOLS).input_tokens
    prompt = scenario.render(tokenizer, decode_request(json.dumps(
        {"max_tokens": 1, "messages": first_messages(), "tools": TOOLS}).encode())) + "<|im_start|>assistant\n"
    assert count == len(tokenizer.encode(prompt))
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        client.messages.count_tokens(model="m", messages=[*first_messages(), {"role": "assistant", "content": "x"}])
    summary = httpx.get(f"{stack.url}/sessions/{session['session_id']}", headers=stack.admin).json()
    assert (summary["requests"], summary["chains"], engine.served) == (0, [], 0)


@pytest.fixture
def refusing_stack(make_stack, tmp_path: Path, tokenizer):
    """A stack whose chat template refuses a system message that is not the first message."""
    return make_stack(tokenizer=with_template(tokenizer.save(tmp_path / "qwen"), tmp_path, REFUSES))


def test_a_template_without_mid_conversation_system_answers_in_claude_codes_words(refusing_stack, engine,
                                                                                 tokenizer):
    session = open_session(refusing_stack)
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    for call in (lambda: streamed(client, first_messages(), 0), lambda: counted(client, first_messages(), 0)):
        with pytest.raises(anthropic.BadRequestError) as caught:
            call()
        assert CLAUDE_CODE_FALLBACK.search(str(caught.value)) and "messages: role 'system'" in str(caught.value)
    openai = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    with pytest.raises(OpenAIBadRequest) as refused:
        openai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"},
                                                            {"role": "system", "content": AGENTS}])
    assert refused.value.body["param"] == "messages" and refused.value.body["code"] == "chat_template_error"
    assert engine.served == 0

    # What Claude Code then sends: the text in the user turn, as a <system-reminder>.
    engine.push(reply(tokenizer, "42."))
    folded = [{"role": "user", "content": [{"type": "text", "text": f"<system-reminder>\n{AGENTS}\n</system-reminder>"},
                                           {"type": "text", "text": "What is 6*7?"}]}]
    assert counted(client, folded, 0) == streamed(client, folded, 0).usage.input_tokens
