"""State from the session on the Responses wire, through the real ASGI app with the official async SDK,
on the in-memory log and an in-process engine: ``previous_response_id`` continues the stored
conversation's chain token-exact, ``GET .../responses/{id}`` answers it, and ids or references of
another session, forged or unknown, are refused."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from edge.app import create_app
from edge.chat.conversation import Message
from edge.service import EdgeService, OpenSession
from edge.settings import EdgeSettings
from edge.stored import KEEP, with_reasoning
from edge.tokens.fidelity import load_codec
from edge.wires.reasoning_refs import ReasoningRefs, stack_key
from rollbus.testing.engine import HandlerEngine, replying
from rollbus.testing.memory_log import InMemoryLog, in_memory_service

IM_END = 151645
TOOLS = [{"type": "function", "name": "calc", "description": "Evaluate.",
          "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}]
CALL = '<think>\nUse calc.\n</think>\n\n<tool_call>\n{"name": "calc", "arguments": {"x": "6*7"}}\n</tool_call>'
ADMIN = "admin-token"


@pytest.fixture(scope="module")
def codec() -> Any:
    return load_codec("builtin:qwen2.5", "hermes")


class Edge:
    def __init__(self, codec: Any, replies: list[str], log: InMemoryLog | None = None) -> None:
        ids = [[*codec[0].tokenizer.encode(text), IM_END] for text in replies]
        self.engine = HandlerEngine(replying(*ids))
        self.service: EdgeService = in_memory_service(self.engine, codec=codec, log=log,
                                                      settings=EdgeSettings(admin_token=ADMIN))
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(self.service)),
                                      base_url="http://edge")

    async def client(self) -> tuple[str, AsyncOpenAI]:
        opened = await self.service.open_session(OpenSession())
        return opened.session_id, self.client_of(opened.session_id, opened.api_key)

    def client_of(self, session_id: str, key: str) -> AsyncOpenAI:
        return AsyncOpenAI(base_url=f"http://edge/sessions/{session_id}/v1", api_key=key, http_client=self.http,
                           max_retries=0)


@pytest.fixture
async def make_edge(codec: Any) -> AsyncIterator[Any]:
    edges: list[Edge] = []

    def make(*replies: str, log: InMemoryLog | None = None) -> Edge:
        edges.append(Edge(codec, list(replies), log))
        return edges[-1]

    yield make
    for edge in edges:
        await edge.http.aclose()


def output_of(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "42"}


async def test_previous_response_id_continues_the_chain_as_the_full_history_does(make_edge):
    stateful, stateless = make_edge(CALL, "It is 42."), make_edge(CALL, "It is 42.")
    sid, client = await stateful.client()
    first = await client.responses.create(model="m", instructions="Be exact.", input="6*7?", tools=TOOLS)
    call = first.output[-1]
    assert call.type == "function_call" and first.output[0].type == "reasoning"
    second = await client.responses.create(model="m", instructions="Be exact.", previous_response_id=first.id,
                                           input=[output_of(call.call_id)], tools=TOOLS)
    assert second.output_text == "It is 42." and second.previous_response_id == first.id
    state = stateful.service.registry.peek(sid).state
    assert [len(chain.turns) for chain in state.chains] == [2]  # one chain, continued
    # The same conversation sent whole, in another session, leaves the same tokens.
    _, other = await stateless.client()
    again = await other.responses.create(model="m", instructions="Be exact.", input="6*7?", tools=TOOLS)
    history = [{"role": "user", "content": "6*7?"}, *[item.model_dump(exclude_none=True) for item in again.output],
               output_of(call.call_id)]
    await other.responses.create(model="m", instructions="Be exact.", input=history, tools=TOOLS)
    inputs = [[list(r.input_ids) for r in edge.engine.requests] for edge in (stateful, stateless)]
    assert inputs[0] == inputs[1]
    # GET answers the stored response as POST did.
    assert (await client.responses.retrieve(second.id)).model_dump() == second.model_dump()


async def test_instructions_are_not_carried_over(make_edge):
    edge = make_edge(CALL, "It is 42.")
    sid, client = await edge.client()
    first = await client.responses.create(model="m", instructions="Be exact.", input="6*7?", tools=TOOLS)
    await client.responses.create(model="m", previous_response_id=first.id, input=[output_of("call_1_0")],
                                  tools=TOOLS)
    state = edge.service.registry.peek(sid).state
    assert [len(chain.turns) for chain in state.chains] == [1, 1]  # no system message: another prompt
    second_prompt = edge.service._turns.codec.tokenizer.decode(edge.engine.requests[1].input_ids)
    assert "Be exact." not in second_prompt and "Use calc." not in second_prompt


async def test_what_a_session_does_not_hold_is_a_404_and_a_foreign_reference_a_400(make_edge):
    edge = make_edge(CALL, CALL, "a", "b")
    sid, client = await edge.client()
    other_sid, other = await edge.client()
    stored = await client.responses.create(model="m", input="hi", tools=TOOLS)
    unstored = await other.responses.create(model="m", input="hi", tools=TOOLS, store=False,
                                            include=["reasoning.encrypted_content"])
    for name in (unstored.id, f"resp_{sid}_99", f"resp_{other_sid}_1", "resp_nope", "caller-made"):
        with pytest.raises(openai.NotFoundError) as caught:
            await client.responses.create(model="m", input="more", previous_response_id=name)
        assert caught.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(unstored.id)  # store: false
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)  # another session's
    # A reasoning reference issued for the other session: authentic, and still refused here.
    reasoning = unstored.output[0].model_dump(exclude_none=True)
    assert reasoning["encrypted_content"].startswith(f"rbr1.{other_sid}.")
    with pytest.raises(openai.BadRequestError, match="another session") as refused:
        await client.responses.create(model="m", input=[{"role": "user", "content": "hi"}, reasoning,
                                                        {"role": "user", "content": "more"}])
    assert refused.value.body["param"] == "input"
    forged = {**reasoning, "encrypted_content": reasoning["encrypted_content"][:-2] + "AA"}
    with pytest.raises(openai.BadRequestError) as refused:
        await other.responses.create(model="m", input=[{"role": "user", "content": "hi"}, forged])
    assert refused.value.body["param"] == "input[1].encrypted_content"
    assert (await client.responses.retrieve(stored.id)).id == stored.id  # the session still answers


async def test_reasoning_references_render_the_sampled_reasoning(make_edge):
    edge = make_edge(CALL, CALL)
    sid, client = await edge.client()
    await client.responses.create(model="m", input="hi", tools=TOOLS)
    state = edge.service.registry.peek(sid).state
    messages = (Message(role="user", content="hi"), Message(role="assistant", reasoning_ref=1, reasoning="summary"),
                Message(role="assistant", reasoning_ref=5))
    assert [m.reasoning for m in with_reasoning(state, messages)] == [None, "Use calc.", None]
    plain = messages[:1]
    assert with_reasoning(state, plain) is plain
    # The reference the edge issues is under the stack's key (derived from the admin token).
    second = await client.responses.create(model="m", input="again", tools=TOOLS, store=False,
                                           include=["reasoning.encrypted_content"])
    assert second.output[0].encrypted_content == ReasoningRefs(stack_key(ADMIN)).issue(sid, 2)


async def test_a_session_keeps_its_latest_stored_conversations_and_rebuilds_older_ones_from_the_log(make_edge):
    edge = make_edge(*["ok"] * (KEEP + 2))
    sid, client = await edge.client()
    ids = [(await client.responses.create(model="m", input=f"q{i}")).id for i in range(KEEP + 1)]
    stored = edge.service.registry.peek(sid).stored
    assert len(stored) == KEEP and stored.get(1) is None
    await client.responses.create(model="m", input="more", previous_response_id=ids[0])
    first = list(edge.engine.requests[0].input_ids)
    assert list(edge.engine.requests[-1].input_ids[:len(first)]) == first  # the first chain, continued
    assert len(stored) == KEEP and stored.get(1) is not None


async def test_a_restarted_edge_rebuilds_a_stored_conversation_from_the_log(make_edge):
    log = InMemoryLog()
    before = make_edge(CALL, "x", CALL, log=log)
    sid, client = await before.client()
    first = await client.responses.create(model="m", instructions="Be exact.", input="6*7?", tools=TOOLS)
    second = await client.responses.create(model="m", instructions="Be exact.", previous_response_id=first.id,
                                           input=[output_of("call_1_0"), {"role": "user", "content": "and?"}],
                                           tools=TOOLS)
    unstored = await client.responses.create(model="m", input="hi", tools=TOOLS, store=False)
    after = make_edge("It is 42.", log=log)  # another edge on the same log: it holds nothing of the session
    again = after.client_of(sid, client.api_key)
    assert (await again.responses.retrieve(second.id)).model_dump() == second.model_dump()
    third = await again.responses.create(model="m", instructions="Be exact.", previous_response_id=second.id,
                                         input=[output_of("call_3_0")], tools=TOOLS)
    assert third.output_text == "It is 42."
    state = after.service.registry.peek(sid).state
    assert [len(chain.turns) for chain in state.chains] == [3, 1]  # the first chain, continued after the restart
    earlier = list(before.engine.requests[1].input_ids)
    assert list(after.engine.requests[0].input_ids[:len(earlier)]) == earlier
    with pytest.raises(openai.NotFoundError):
        await again.responses.create(model="m", input="more", previous_response_id=unstored.id)
    assert after.service.registry.peek(sid).stored.unrecoverable == {3}
