import json

import pytest

from edge.codec.tool_parsers import HermesParser, get_parser


def ids(i: int) -> str:
    return f"call_9_{i}"


def test_plain_text_is_content_verbatim():
    out = HermesParser().parse("  Hello\nworld  ", ids)
    assert out.content == "  Hello\nworld  " and out.tool_calls == () and out.parse_error is None


def test_single_and_multiple_calls():
    text = ('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "1+2"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": {"q": "é"}}\n</tool_call>')
    out = HermesParser().parse(text, ids)
    assert out.content == "Let me compute."
    assert [(c.id, c.name) for c in out.tool_calls] == [("call_9_0", "calc"), ("call_9_1", "search")]
    assert json.loads(out.tool_calls[0].arguments) == {"expression": "1+2"}
    assert out.tool_calls[1].arguments == '{"q": "é"}'


def test_string_arguments_pass_through():
    out = HermesParser().parse('<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', ids)
    assert out.tool_calls[0].arguments == '{"a": 1}' and out.content == ""


@pytest.mark.parametrize("text", [
    "<tool_call>\n{not json}\n</tool_call>",
    '<tool_call>\n{"arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {}}',
])
def test_unparseable_calls_are_returned_as_content_with_a_reason(text):
    out = HermesParser().parse(text, ids)
    assert out.content == text and out.tool_calls == () and out.parse_error


def test_unknown_format_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown tool format"):
        get_parser("nope")
