"""Framed increments (rendered once per message shape) equal the template's own render."""

import pytest

from edge.chat.conversation import Message
from edge.tokens.incremental import TemplateCodec
from edge.tokens.template import ChatTemplate
from edge.tokens.tokenizer import Tokenizer, load_tokenizer

QWEN = load_tokenizer("builtin:qwen2.5")


def rendered_increment(codec: TemplateCodec, messages: list[Message]) -> str:
    from edge.chat.conversation import template_message

    return codec.separator + codec._rendered_tail([template_message(m) for m in messages])


SHAPES = [
    [Message(role="tool", content="42", tool_call_id="call_1_0")],
    [Message(role="tool", content="a"), Message(role="tool", content=""), Message(role="user", content=" next ")],
    [Message(role="user", content="héllo <|im_end|> {{ x }}", name="bob")],
    [Message(role="system", content="new rules"), Message(role="user", content="go")],
]


@pytest.mark.parametrize("messages", SHAPES)
def test_framed_increment_equals_render(messages):
    codec = TemplateCodec(QWEN)
    assert codec.increment_text(messages, ended_with_eos=True) == rendered_increment(codec, messages)
    assert codec._frame(messages) is not None


def test_messages_with_tool_calls_are_rendered_not_framed():
    from schemas.events import ToolCall

    codec = TemplateCodec(QWEN)
    message = Message(role="assistant", content="", tool_calls=(ToolCall(id="c", name="f", arguments="{}"),))
    assert codec._frame([message, Message(role="tool", content="x")]) is None


def test_a_template_that_trims_contents_is_never_framed():
    source = QWEN.chat_template.source.replace("message.content", "message.content | trim")
    trimming = Tokenizer("trim", QWEN._backend, vocab_size=QWEN.vocab_size, eos_token=QWEN.eos_token,
                         pad_token=None, stop_tokens=("<|endoftext|>",),
                         chat_template=ChatTemplate(source, eos_token=QWEN.eos_token))
    codec = TemplateCodec(trimming)
    messages = [Message(role="user", content="  padded  ")]
    assert codec._frame(messages) is None
    assert codec.increment_text(messages, ended_with_eos=True).endswith(
        "<|im_start|>user\npadded<|im_end|>\n<|im_start|>assistant\n")
