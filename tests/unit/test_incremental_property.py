"""Property: stored tokens + increment decode to the chat template's full render.

Random conversations (a system message or not, and system messages mid-conversation; user
turns with unicode, emoji, CJK, markup or empty content; assistant turns with text,
reasoning, 0-3 tool calls with nested JSON arguments; runs of 1-3 tool results; tools or
none) are replayed exactly as the edge records them: the first request is encoded whole,
each assistant turn appends what a model emits for it (the template's rendering of its
body, then ``<|im_end|>``, or nothing more when the turn was cut off by ``length``), and
each later request appends ``encode_increment(new_messages, last_token=...)``. After every
request the stored tokens decode to the full render with the generation prompt; at the
end, to the full render less the turn separator the model never emits.

Text is NFC, as the Qwen tokenizer normalizes it (so decode(encode(text)) == text).
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Sequence

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge.chat.conversation import Message, ToolSpec, template_message, template_tools
from edge.tokens.incremental import TemplateCodec
from edge.tokens.tokenizer import load_tokenizer
from schemas.events import ToolCall

TEMPLATES = ["builtin:qwen2.5", "builtin:qwen3", "builtin:qwen3-coder"]


@pytest.fixture(scope="module", params=TEMPLATES)
def codec(request: pytest.FixtureRequest) -> TemplateCodec:
    return TemplateCodec(load_tokenizer(request.param))


# ---------------------------------------------------------------- strategies

_PIECES = ["", " ", "\n", "\n\n", "😀", "👩🏽‍💻", "🇨🇭", "中文字符", "日本語のテキスト", "한국어", "Zürich", "é",
           "<tool_call>", "</think>", "{\"a\": 1}", "  indented\n\tcode", "\u00a0\u3000"]
TEXT = st.lists(st.one_of(st.sampled_from(_PIECES), st.text(st.characters(codec="utf-8"), max_size=8)),
                max_size=4).map(lambda parts: unicodedata.normalize("NFC", "".join(parts)))
NAME = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAME, inner, max_size=3),
    max_leaves=6,
)
TOOL = st.builds(lambda name, description: ToolSpec(name=name, description=description or None,
                                                    parameters={"type": "object", "properties": {}}),
                 NAME, TEXT)


class Round(msgspec.Struct, frozen=True):
    reply: Message
    new: tuple[Message, ...]
    ended: bool  # False: cut off by length, no <|im_end|>


class Conversation(msgspec.Struct, frozen=True):
    tools: tuple[ToolSpec, ...]
    first: tuple[Message, ...]
    rounds: tuple[Round, ...]


@st.composite
def tool_calls(draw: st.DrawFn) -> tuple[ToolCall, ...]:
    count = draw(st.integers(0, 3))
    return tuple(
        ToolCall(id=f"call_{i}", name=draw(NAME),
                 arguments=json.dumps(draw(st.dictionaries(NAME, JSON, max_size=3)), ensure_ascii=False))
        for i in range(count)
    )


@st.composite
def rounds(draw: st.DrawFn, *, last: bool) -> Round:
    calls = draw(tool_calls())
    reasoning = draw(st.none() | TEXT)
    reply = Message(role="assistant", content=draw(TEXT), tool_calls=calls, reasoning=reasoning)
    ended = bool(calls) or draw(st.booleans())
    if last:
        return Round(reply, (), ended)
    new: list[Message] = []
    if calls:
        new += [Message(role="tool", content=draw(TEXT), tool_call_id=f"call_{i}")
                for i in range(draw(st.integers(1, 3)))]
    if not calls or draw(st.booleans()):
        new.append(Message(role="user", content=draw(TEXT)))
    if draw(st.booleans()):  # a system message mid-conversation (Claude Code's), anywhere among them
        new.insert(draw(st.integers(0, len(new))), Message(role="system", content=draw(TEXT)))
    return Round(reply, tuple(new), ended)


@st.composite
def conversations(draw: st.DrawFn) -> Conversation:
    tools = tuple(draw(st.lists(TOOL, max_size=3)))
    first = [Message(role="user", content=draw(TEXT))]
    if draw(st.booleans()):
        first.insert(0, Message(role="system", content=draw(TEXT)))
    if draw(st.booleans()):
        first.append(Message(role="system", content=draw(TEXT)))
    n_rounds = draw(st.integers(1, 4))
    steps = [draw(rounds(last=i == n_rounds - 1)) for i in range(n_rounds)]
    return Conversation(tools, tuple(first), tuple(steps))


# ---------------------------------------------------------------- the edge, replayed


def full_render(codec: TemplateCodec, messages: Sequence[Message], tools: Sequence[ToolSpec], *,
                prompt: bool) -> str:
    return codec.tokenizer.chat_template.render([template_message(m) for m in messages],
                                                tools=template_tools(tuple(tools)), add_generation_prompt=prompt)


def model_output(codec: TemplateCodec, history: list[Message], reply: Message, tools: Sequence[ToolSpec]) -> str:
    """What the model emits for ``reply``: the template's rendering of its body, then ``<|im_end|>``."""
    prompt = full_render(codec, history, tools, prompt=True)
    rendered = full_render(codec, [*history, reply], tools, prompt=False)
    assert rendered.startswith(prompt)
    body = rendered[len(prompt) :]
    assert body.endswith("<|im_end|>\n")
    return body.removesuffix("\n")


def replay(codec: TemplateCodec, conversation: Conversation) -> list[int]:
    tok, tools = codec.tokenizer, conversation.tools
    messages = list(conversation.first)
    stored = codec.encode_prompt(messages, tools)
    assert tok.decode(stored) == full_render(codec, messages, tools, prompt=True)
    for step in conversation.rounds:
        emitted = model_output(codec, messages, step.reply, tools)
        sampled = tok.encode(emitted if step.ended else emitted.removesuffix("<|im_end|>"))
        stored += sampled
        messages.append(step.reply)
        if step.new:
            stored += codec.encode_increment(step.new, last_token=stored[-1])
            messages += step.new
            assert tok.decode(stored) == full_render(codec, messages, tools, prompt=True)
    tail = "\n" if conversation.rounds[-1].ended else "<|im_end|>\n"
    assert tok.decode(stored) + tail == full_render(codec, messages, tools, prompt=False)
    return stored


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(conversation=conversations())
def test_stored_tokens_plus_increments_decode_to_the_full_render(codec: TemplateCodec,
                                                                 conversation: Conversation) -> None:
    replay(codec, conversation)


# ---------------------------------------------------------------- fixed cases


def test_thinking_turns_stay_in_the_trajectory_as_sampled() -> None:
    codec = TemplateCodec(load_tokenizer("builtin:qwen3"))
    call = ToolCall(id="c0", name="calc", arguments='{"expression": "6*7"}')
    conversation = Conversation(
        tools=(ToolSpec(name="calc"),),
        first=(Message(role="user", content="6*7?"),),
        rounds=(
            Round(Message(role="assistant", reasoning="Use the tool.", tool_calls=(call,)),
                  (Message(role="tool", content="42", tool_call_id="c0"),), True),
            Round(Message(role="assistant", content="42", reasoning="It said 42."), (), True),
        ),
    )
    stored = replay(codec, conversation)
    think, end_think = codec.tokenizer.token_to_id("<think>"), codec.tokenizer.token_to_id("</think>")
    assert (think, end_think) == (151667, 151668)
    assert stored.count(think) == stored.count(end_think) == 2  # both turns' reasoning, none stripped
    text = codec.tokenizer.decode(stored)
    assert "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n<tool_call>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nIt said 42.\n</think>\n\n42<|im_end|>")


def test_a_turn_cut_off_by_length_gets_its_end_of_turn_token_in_the_increment() -> None:
    codec = TemplateCodec(load_tokenizer("builtin:qwen2.5"))
    conversation = Conversation(
        tools=(),
        first=(Message(role="user", content="count"),),
        rounds=(Round(Message(role="assistant", content="1 2 3"), (Message(role="user", content="more"),), False),
                Round(Message(role="assistant", content="4"), (), True)),
    )
    replay(codec, conversation)
    cut = codec.tokenizer.encode("1 2 3")
    increment = codec.encode_increment([Message(role="user", content="more")], last_token=cut[-1])
    assert codec.tokenizer.decode(increment) == "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
