"""Forks through the edge's turn runner on the in-memory log (real template, fold and envelopes, no NATS):
a reply sent back with its reasoning in the text, a sibling, and a fork after a takeover (the histories are
edge memory)."""

from __future__ import annotations

import pytest

from edge.codec.fidelity import load_codec
from edge.engines.base import GenerateRequest, GenerateResult
from edge.live import LiveSession
from rollbus.testing.engine import HandlerEngine, result
from rollbus.testing.memory_log import InMemoryLog
from schemas import tokens
from schemas.events import ChainStarted
from tests.unit.test_edge_in_memory import IM_END, SID, Agent, clock, opened, runner


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


async def test_after_a_takeover_a_fork_from_an_earlier_chain_is_unknown(codec) -> None:
    log = InMemoryLog()
    turns = runner(codec, log, replies(codec, "one", "two", "three"))
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
