import json
import re

import pytest

from edge.tokens.parsers import make_parser
from edge.tokens.parsers.hermes import HermesParser


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
        make_parser("nope")


def _regex_parse(text: str) -> tuple[str, list[str]]:
    """The parser's rule, stated as a regular expression: each <tool_call> with the first
    </tool_call> after it is a block; the text outside the blocks, after the first, is content."""
    block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    start = text.find("<tool_call>")
    leftover = block.sub("", text[start:]).strip()
    head = text[:start].rstrip("\n")
    content = f"{head}\n{leftover}" if head and leftover else head or leftover
    return content, [json.loads(m.group(1))["name"] for m in block.finditer(text)]


CALL = '<tool_call>\n{"name": "%s", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize("text", [
    "before\n" + CALL % "a" + " between " + CALL % "b" + "\nafter",
    CALL % "a" + CALL % "b" + " trailing <tool_call> never closed",
    "x\n\n" + CALL % "a" + "</tool_call> stray close",
    CALL % "a" + "\n" + CALL % "b" + "\n" + CALL % "c",
])
def test_text_outside_the_blocks_is_kept_as_content(text):
    out = HermesParser().parse(text, ids)
    assert (out.content, [c.name for c in out.tool_calls]) == _regex_parse(text)
    assert out.parse_error is None


@pytest.mark.parametrize("arguments", [
    {}, {"path": "src/app/main.py", "start": 1, "end": 80}, {"q": "é \u2028 😀", "quote": 'a"b\\c\n'},
    {"nested": {"list": [1, 2.5, -0.0, 1e300, None, True, False], "empty": []}}, {"b": 1, "a": 2},
])
def test_object_arguments_are_dumped_as_json_dumps_does(arguments):
    text = f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
    assert HermesParser().parse(text, ids).tool_calls[0].arguments == json.dumps(arguments, ensure_ascii=False)
