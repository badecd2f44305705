"""SmolLM2's tool-call format: a JSON list of calls inside one ``<tool_call>`` block."""

from __future__ import annotations

import json

import pytest

from edge.tokens.parsers import SmolLM2Parser, make_parser


def ids(i: int) -> str:
    return f"call_4_{i}"


def test_a_list_of_calls_with_text_around() -> None:
    text = ('Let me compute.\n<tool_call>[{"name": "calculator", "arguments": {"expression": "6*7"}}, '
            '{"name": "search", "arguments": {"q": "é"}}]</tool_call>')
    out = make_parser("smollm2").parse(text, ids)
    assert out.content == "Let me compute." and out.parse_error is None
    assert [(c.id, c.name) for c in out.tool_calls] == [("call_4_0", "calculator"), ("call_4_1", "search")]
    assert json.loads(out.tool_calls[0].arguments) == {"expression": "6*7"}
    assert out.tool_calls[1].arguments == '{"q": "é"}'


def test_a_lone_object_is_one_call_and_an_empty_list_is_none() -> None:
    out = SmolLM2Parser().parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>', ids)
    assert [c.name for c in out.tool_calls] == ["f"] and out.content == ""
    none = SmolLM2Parser().parse("Nothing to call.\n<tool_call>[]</tool_call>", ids)
    assert none.tool_calls == () and none.content == "Nothing to call." and none.parse_error is None


@pytest.mark.parametrize(("text", "error"), [
    ("<tool_call>[{\"name\": \"f\", </tool_call>", "not JSON"),
    ("<tool_call>[{\"arguments\": {}}]</tool_call>", "no string 'name'"),
    ("<tool_call>[{\"name\": \"f\"", "unterminated"),
])
def test_what_does_not_parse_stays_content_with_the_reason(text: str, error: str) -> None:
    out = SmolLM2Parser().parse(text, ids)
    assert out.content == text and out.tool_calls == ()
    assert error in (out.parse_error or "")


def test_plain_text_is_content_verbatim() -> None:
    out = SmolLM2Parser().parse("  The answer is 42.  ", ids)
    assert out.content == "  The answer is 42.  " and out.tool_calls == () and out.parse_error is None
