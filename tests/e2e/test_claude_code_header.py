"""Claude Code puts ``x-anthropic-billing-header: ...; cch=<changes every request>;`` first in its
system prompt. Through the official ``anthropic`` SDK, a session whose every request carries another
header stays one chain, and the header is not in the record's tokens."""

from __future__ import annotations

import anthropic
import httpx

from tests.e2e.scenario import read_row
from tests.e2e.test_anthropic_session import finalize
from tests.e2e.test_openai_session import open_session, reply

PROMPT = "You are Claude Code, Anthropic's official CLI for Claude."


def billing(turn: int) -> str:
    return f"x-anthropic-billing-header: cc_version=2.0.14.e1f; cc_entrypoint=cli; cch={turn:05x}{turn * 7919:x};"


def test_a_new_billing_header_every_request_stays_one_chain(stack, engine, tokenizer):
    turns = 3
    engine.push(*(reply(tokenizer, f"Answer number {i}.") for i in range(turns)))
    session = open_session(stack, uid="claudecode", metadata={"agent_name": "claude-code"})
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[dict] = [{"role": "user", "content": "Hello."}]
    for turn in range(turns):
        system = [{"type": "text", "text": billing(turn)},
                  {"type": "text", "text": PROMPT, "cache_control": {"type": "ephemeral"}}]
        message = client.messages.create(model="claude", max_tokens=64, system=system, messages=messages)
        messages += [{"role": "assistant", "content": message.content[0].text},
                     {"role": "user", "content": f"And then {turn}?"}]

    summary = httpx.get(f"{stack.url}/sessions/{session['session_id']}", headers=stack.admin).json()
    assert len(summary["chains"]) == 1, summary["chains"]
    assert finalize(stack, session)["trajectories"] == 1
    row = read_row(stack, session["session_id"])
    text = tokenizer.decode(row["input_ids"])
    assert PROMPT in text and "x-anthropic-billing-header" not in text and "cch=" not in text
    assert all("x-anthropic-billing-header" not in tokenizer.decode(r["input_ids"]) for r in engine.requests)
