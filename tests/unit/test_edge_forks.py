"""Forks through the edge's turn runner on the in-memory log (real template, fold and envelopes, no NATS):
a reply sent back with its reasoning in the text, a sibling, and a fork after a takeover (the histories are
edge memory)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from edge.engines.base import GenerateRequest, GenerateResult
from edge.live import LiveSession
from edge.service import OpenSession
from edge.tokens.fidelity import load_codec
from edge.turns import TurnRequest, TurnRunner
from edge.wires.openai import decode_request
from rollbus.testing.engine import HandlerEngine, result
from rollbus.testing.memory_log import InMemoryLog
from schemas import tokens
from schemas.events import ChainStarted, ContextAppended, SessionOpened
from session.fold import apply, fold
from tests.unit.test_edge_in_memory import IM_END, NOW, SID, Agent, clock, opened, runner, service
from viewer.detail import audit_entry


@pytest.fixture(scope="module")
def codec():
    return load_codec("builtin:qwen2.5", "hermes")


def replies(codec, *texts: str):
    queue = list(texts)

    def handler(request: GenerateRequest) -> GenerateResult:
        return result([*codec[0].tokenizer.encode(queue.pop(0)), IM_END])

    return HandlerEngine(handler)


async def started(log: InMemoryLog) -> list[ChainStarted]:
    return [e for e in (await log.read_session(SID)).events if isinstance(e, ChainStarted)]


async def test_reasoning_left_out_continues_the_chain_and_put_in_the_text_forks_as_reasoning_dropped(codec) -> None:
    log = InMemoryLog()
    turns = runner(codec, log, replies(codec, "<think>Say hi back.</think>Hello!", "Bye.", "Hi.", "Hello again!"))
    live, agent = await opened(log), Agent()
    first = await turns.run(live, agent.request("hi"))
    assert (first.content, first.reasoning) == ("Hello!", "Say hi back.")
    agent.messages.append({"role": "assistant", "content": "Hello!"})  # the reasoning left out: the same history
    await turns.run(live, agent.request("bye"))
    agent.messages[2:] = [{"role": "assistant", "content": "<think>Say hi back.</think>Hello!"}]  # in the text
    await turns.run(live, agent.request("bye"))
    agent.messages[1:] = [{"role": "user", "content": "hi"}]
    await turns.run(live, agent.request(None))  # the first request again: a sibling of chain 0
    root, dropped, sibling = await started(log)
    assert (root.fork.cause, root.fork.parent) == ("new_conversation", None)
    assert (dropped.fork.cause, dropped.fork.parent, dropped.fork.message_index) == ("reasoning_dropped", 0, 2)
    assert (sibling.fork.cause, sibling.fork.message_index, sibling.fork.token_offset) == \
        ("sibling", 2, tokens.count(root.prompt_ids))
    assert 0 < dropped.fork.token_offset == tokens.common_prefix(dropped.prompt_ids, root.prompt_ids + b"".join(
        s.token_ids for s in (await log.load_state(SID))[0].chains[0].segments))
    assert turns.metrics.value("rollbus_chain_forks_total", cause="reasoning_dropped") == 1
    assert turns.metrics.value("rollbus_chain_forks_total", cause="new_conversation") == 0


async def test_after_a_takeover_a_fork_from_an_earlier_chain_is_unknown_without_the_log(codec) -> None:
    log = InMemoryLog()
    turns = runner(codec, log, replies(codec, "one", "two", "three"))  # no service: nothing recovers histories
    live, agent = await opened(log), Agent()
    request = agent.request("hi")
    await turns.run(live, request)
    state, position = await log.load_state(SID)
    taken_over = LiveSession(state, position, clock=clock)  # another edge: the log, no histories
    await turns.run(taken_over, request)  # a sibling of chain 0, which this edge never saw
    await turns.run(taken_over, request)  # a sibling of chain 1, which it did
    _, unknown, known = await started(log)
    assert (unknown.fork.cause, unknown.fork.parent) == ("unknown", None)
    assert (known.fork.cause, known.fork.parent) == ("sibling", 1)


async def test_a_restarted_edge_recovers_the_chains_histories_from_the_log_when_a_request_forks(codec) -> None:
    log = InMemoryLog()
    engine = replies(codec, "one", "two", "three", "four")
    first = service(codec, log, engine)
    session = await first.open_session(OpenSession())
    sid, key = session.session_id, session.api_key
    agent = Agent()
    opening = agent.request("hi")
    agent.heard(await first.complete(await first.authorize(sid, key), opening))
    agent.heard(await first.complete(await first.authorize(sid, key), agent.request("more")))

    restarted = service(codec, log, engine)  # nothing in memory: the log is all it has
    restarted.decoders["openai"] = decode_request  # as the app registers its adapters
    live = await restarted.authorize(sid, key)
    assert live.histories.to_recover and not live.histories.known()
    await restarted.complete(live, agent.request("more"))  # extends chain 0: nothing read
    assert live.histories.to_recover
    await restarted.complete(live, opening)  # a sibling of chain 0's first turn
    assert not live.histories.to_recover
    events = (await log.read_session(sid)).events
    (_, sibling) = [e for e in events if isinstance(e, ChainStarted)]
    assert (sibling.fork.cause, sibling.fork.parent, sibling.fork.message_index) == ("sibling", 0, 2)
    assert sibling.fork.token_offset == tokens.count(fold(events).chains[0].prompt_ids)


ECHO = [{"type": "function", "function": {"name": "echo", "parameters": {"type": "object", "properties": {
    "text": {"type": "string"}}}}}]


def call(name: str, text: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"text": "{text}"}}}}\n</tool_call>'


def smolagents_request(messages: list[dict[str, Any]]) -> TurnRequest:
    body = json.dumps({"model": "m", "messages": messages, "tools": ECHO}).encode()
    return TurnRequest(conversation=decode_request(body), wire="openai", body=body)


async def smolagents_session(codec, log: InMemoryLog, **metadata: object) -> TurnRunner:
    """Three steps of an agent that sends each tool call back as text and its result as a user turn."""
    event = SessionOpened(session_id=SID, seq=1, time=NOW, uid="uid1", session_index=0, api_key_digest="x",
                          max_trajectory_length=4096, tokenizer="builtin:qwen2.5", tool_format="hermes",
                          metadata=metadata)
    live = LiveSession(apply(None, event), (await log.append(SID, [event], 0)).stream_seq, clock=clock)
    turns = runner(codec, log, replies(codec, call("echo", "a"), call("echo", "b"), "Both echoed."))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Use the tools."},
                                      {"role": "user", "content": "Echo a, then b."}]
    for _ in range(3):
        outcome = await turns.run(live, smolagents_request(messages))
        if not outcome.tool_calls:
            return turns
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                 for c in outcome.tool_calls]
        messages += [{"role": "assistant", "content": f"Calling tools:\n{calls!r}"},
                     {"role": "user", "content": f"Observation:\n{json.loads(outcome.tool_calls[0].arguments)}"}]
    return turns


async def test_calls_re_sent_as_text_fork_by_default(codec) -> None:
    log = InMemoryLog()
    turns = await smolagents_session(codec, log)
    assert [e.fork.cause for e in await started(log)] == ["new_conversation", *["tool_calls_as_text"] * 2]
    assert turns.metrics.value("rollbus_chain_forks_total", cause="tool_calls_as_text") == 2


async def test_continue_reserialized_turns_continues_the_chain_with_its_logged_tokens(codec) -> None:
    log = InMemoryLog()
    turns = await smolagents_session(codec, log, continue_reserialized_turns=True)
    events = (await log.read_session(SID)).events
    assert len(await started(log)) == 1
    appended = [e for e in events if isinstance(e, ContextAppended)]
    assert [e.reserialized for e in appended] == ["tool_calls_as_text"] * 2  # the choice, in the log
    assert "continued with its logged tokens" in audit_entry(appended[0]).detail  # the viewer's audit trail
    (chain,) = fold(events).chains
    assert len(chain.turns) == 3 and [t.tool_calls[0].name for t in chain.turns[:2]] == ["echo", "echo"]
    text = codec[0].tokenizer.decode(chain.token_ids()[chain.prompt_len:])
    assert "Calling tools" not in text and text.count("<tool_call>") == 2  # the calls as sampled, not as re-sent
    assert "Observation:" in text
    assert turns.metrics.value("rollbus_chain_forks_total", cause="tool_calls_as_text") == 0
