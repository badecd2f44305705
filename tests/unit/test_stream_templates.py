"""The streamed text deltas written from byte templates (edge.wires.openai.OpenAIStream,
edge.wires.anthropic.AnthropicStream) are byte for byte what the wire structs encode to, for
any text and any model name, in every block of a stream."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.chat.conversation import Conversation
from edge.chat.deltas import ContentDelta, ReasoningDelta, StreamStarted, ToolCallReady
from edge.wires.adapter import sse
from edge.wires.anthropic import AnthropicWire
from edge.wires.openai import OpenAIWire
from schemas import wire_anthropic as wa
from schemas.events import ToolCall
from schemas.wire_openai import ChatCompletionChunk, ChunkChoice, Delta

ENCODE = msgspec.json.Encoder().encode
STARTED = StreamStarted(session_id="ab" * 16, request_no=3, created=1_700_000_000, prompt_tokens=9)
TEXTS = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # Cs: lone surrogates, never decoded
MODELS = st.one_of(st.just(""), st.just('"content":""'), st.just('m","choices":[{"delta":{"content":""}}]'), TEXTS)
DELTAS = st.lists(st.tuples(st.booleans(), TEXTS), min_size=1, max_size=8)  # (reasoning?, text)


def _openai_chunk(model: str, delta: Delta) -> bytes:
    choice = ChunkChoice(index=0, delta=delta)
    return sse(ENCODE(ChatCompletionChunk(id="chatcmpl-abababababab-3", created=STARTED.created,
                                          model=model or "rollbus", choices=[choice])))


@settings(max_examples=300, deadline=None)
@given(model=MODELS, deltas=DELTAS)
def test_openai_text_deltas_are_the_chunks_the_structs_encode(model: str, deltas: list[tuple[bool, str]]) -> None:
    encoder = OpenAIWire().stream(Conversation(messages=(), model=model), lambda ids: [])
    assert encoder.event(STARTED) == _openai_chunk(model, Delta(role="assistant", content=""))
    for reasoning, text in deltas:
        expected = Delta(reasoning_content=text) if reasoning else Delta(content=text)
        event = ReasoningDelta(text) if reasoning else ContentDelta(text)
        assert encoder.event(event) == _openai_chunk(model, expected)


def _anthropic_delta(index: int, delta: wa.TextDelta | wa.ThinkingDelta) -> bytes:
    return sse(ENCODE(wa.ContentBlockDelta(index=index, delta=delta)), "content_block_delta")


@settings(max_examples=300, deadline=None)
@given(model=MODELS, deltas=DELTAS, tool_after=st.integers(0, 8))
def test_anthropic_text_deltas_are_the_events_the_structs_encode(model: str, deltas: list[tuple[bool, str]],
                                                                 tool_after: int) -> None:
    """Each block (a tool call between them too) gets its own index in its deltas."""
    encoder = AnthropicWire().stream(Conversation(messages=(), model=model), lambda ids: [])
    encoder.event(STARTED)
    index, kind = -1, ""
    for number, (reasoning, text) in enumerate(deltas):
        if number == tool_after:
            encoder.event(ToolCallReady(0, ToolCall(id="call_3_0", name="f", arguments="{}")))
            index, kind = index + 1, "tool"
        wanted = "thinking" if reasoning else "text"
        out = encoder.event(ReasoningDelta(text) if reasoning else ContentDelta(text))
        delta = wa.ThinkingDelta(thinking=text) if reasoning else wa.TextDelta(text=text)
        if wanted == kind:  # the open block goes on: the delta alone
            assert out == _anthropic_delta(index, delta)
        else:  # the open block is closed (unless the tool call's closed it), a new one opens with its delta
            index, kind = index + 1, wanted
            start = wa.ContentBlockStart(index=index, content_block=wa.ThinkingOut(thinking="") if reasoning
                                         else wa.TextOut(text=""))
            assert out.endswith(sse(ENCODE(start), "content_block_start") + _anthropic_delta(index, delta))
