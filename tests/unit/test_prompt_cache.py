"""A new chain's prompt is encoded once per exact (messages, tools): the cache never changes a token."""

from edge.chat.conversation import Message, ToolSpec
from edge.tokens.incremental import TemplateCodec
from edge.tokens.tokenizer import load_tokenizer

QWEN = load_tokenizer("builtin:qwen2.5")
FIRST = [Message(role="system", content="You are terse."), Message(role="user", content="List the files.")]
TOOLS = (ToolSpec(name="ls", description="List files", parameters={"type": "object", "properties": {
    "path": {"type": "string"}, "all": {"type": "boolean"}}}),)


def test_cached_prompt_equals_a_fresh_render_and_is_a_private_copy():
    codec = TemplateCodec(QWEN)
    expected = QWEN.encode(codec.prompt_text(FIRST, TOOLS))
    first = codec.encode_prompt(FIRST, TOOLS)
    first.append(-1)  # a caller's list is its own
    assert codec.encode_prompt(list(FIRST), TOOLS) == expected
    assert TemplateCodec(QWEN, prompt_cache=0).encode_prompt(FIRST, TOOLS) == expected


def test_schemas_in_another_key_order_are_another_prompt():
    codec = TemplateCodec(QWEN)
    reordered = (ToolSpec(name="ls", description="List files", parameters={"properties": {
        "all": {"type": "boolean"}, "path": {"type": "string"}}, "type": "object"}),)
    codec.encode_prompt(FIRST, TOOLS)
    assert codec.encode_prompt(FIRST, reordered) == QWEN.encode(codec.prompt_text(FIRST, reordered))
    assert codec.encode_prompt(FIRST, reordered) != codec.encode_prompt(FIRST, TOOLS)


def test_other_messages_are_another_prompt():
    codec = TemplateCodec(QWEN)
    codec.encode_prompt(FIRST, ())
    other = [FIRST[0], Message(role="user", content="List the files!")]
    assert codec.encode_prompt(other, ()) == QWEN.encode(codec.prompt_text(other, ()))
