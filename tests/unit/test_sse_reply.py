"""A streamed turn as the edge's ASGI app writes it (edge.routes.sse.SSEReply): the ASGI messages it
sends, and a client that leaves while nothing is being written (a tool call is held back until the turn
is in the log) still abandons the turn at once, heard through ``http.disconnect`` alone."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import pytest

from edge.app import create_app
from edge.engines.base import GenerateChunk, GenerateRequest, GenerateResult
from edge.service import OpenSession
from edge.tokens.fidelity import load_codec
from rollbus.testing.memory_log import InMemoryLog, in_memory_service
from schemas.events import TurnAbandoned, TurnCompleted

Message = MutableMapping[str, Any]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'


class SlowEngine:
    """Streams ``text`` in chunks of 2 tokens; with ``stall_after``, stops sampling after that many chunks
    until its stream is closed (``closed`` says that it was)."""

    name = "slow"

    def __init__(self, ids: list[int], stall_after: int | None = None) -> None:
        self._ids = tuple(ids)
        self._stall_after = stall_after
        self.closed = asyncio.Event()

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        raise NotImplementedError("only streamed here")

    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk | GenerateResult]:
        try:
            for number, start in enumerate(range(0, len(self._ids), 2)):
                if number == self._stall_after:
                    await asyncio.Event().wait()  # sampling, forever
                yield GenerateChunk(token_ids=self._ids[start:start + 2], logprobs=None)
                await asyncio.sleep(0)
            yield GenerateResult(token_ids=self._ids, logprobs=None, finish_reason="stop")
        finally:
            self.closed.set()

    async def aclose(self) -> None:
        return None


class Client:
    """One ASGI request: its body, then ``http.disconnect`` once it has left (with ``leaves``: once the
    first event is in; the bodies after it go nowhere); what came back."""

    def __init__(self, body: bytes, *, leaves: bool = False) -> None:
        self._body: bytes | None = body
        self._leaves = leaves
        self.leave = asyncio.Event()
        self.sent: list[Message] = []

    async def receive(self) -> Message:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if self._leaves and message["type"] == "http.response.body" and message.get("more_body"):
            self.leave.set()

    def frames(self) -> list[str]:
        body = b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        return [frame for frame in body.decode().split("\n\n") if frame]


@pytest.fixture(scope="module")
def codec() -> Any:
    return load_codec("builtin:qwen2.5", "hermes")


async def _serve(codec: Any, engine: SlowEngine, log: InMemoryLog, client: Client) -> str:
    service = in_memory_service(engine, log=log, codec=codec)  # type: ignore[arg-type]
    opened = await service.open_session(OpenSession())
    scope = {"type": "http", "method": "POST", "path": f"/sessions/{opened.session_id}/v1/chat/completions",
             "headers": [(b"authorization", f"Bearer {opened.api_key}".encode())]}
    await asyncio.wait_for(create_app(service)(scope, client.receive, client.send), 10)
    return opened.session_id


def _body() -> bytes:
    return json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}],
                       "tools": [{"type": "function", "function": {"name": "calc", "parameters": {}}}]}).encode()


async def test_a_stream_is_one_start_then_bodies_then_an_empty_last_body(codec: Any) -> None:
    ids = [*codec[0].tokenizer.encode("Hello there, friend."), codec[0].tokenizer.eos_token_id]
    log, client = InMemoryLog(), Client(_body())
    session_id = await _serve(codec, SlowEngine(ids), log, client)
    start, *bodies = client.sent
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert dict(start["headers"])[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert [m["more_body"] for m in bodies] == [True] * (len(bodies) - 1) + [False] and bodies[-1]["body"] == b""
    frames = client.frames()
    assert frames[-1] == "data: [DONE]"
    chunks = [json.loads(frame.removeprefix("data: ")) for frame in frames[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "Hello there, friend." and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert [type(e) for e in (await log.read_session(session_id)).events][-1] is TurnCompleted


async def test_a_client_leaving_while_a_tool_call_is_held_back_abandons_the_turn(codec: Any) -> None:
    ids = [*codec[0].tokenizer.encode(CALL), codec[0].tokenizer.eos_token_id]
    engine, log, client = SlowEngine(ids, stall_after=3), InMemoryLog(), Client(_body(), leaves=True)
    session_id = await _serve(codec, engine, log, client)
    assert engine.closed.is_set()  # the engine request was closed (an SGLang stream closed early aborts it)
    events = (await log.read_session(session_id)).events
    abandoned = [e for e in events if isinstance(e, TurnAbandoned)]
    assert len(abandoned) == 1 and abandoned[0].reason == "client_disconnected"
    assert 0 < abandoned[0].tokens_sampled <= 6 < len(ids)  # cut while sampling, when the client left
    assert not any(isinstance(e, TurnCompleted) for e in events)
    frames = client.frames()  # the role chunk only: the call was never shown
    assert len(frames) == 1 and json.loads(frames[0].removeprefix("data: "))["choices"][0]["delta"]["role"] == \
        "assistant"
    assert client.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
