"""The adapter for SGLang's parsers (``sglang:NAME``), with SGLang installed (the ``sglang`` extra).

The differential test (``test_parser_differential.py``) checks what they read; here: names,
configuration errors, failures mapped to ``parse_error``, and reasoning.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator

import pytest

import edge.tokens.parsers.sglang_adapter as sglang_adapter
from edge.chat.conversation import ToolSpec
from edge.chat.deltas import ContentDelta, ReasoningDelta
from edge.tokens.parsers import HermesParser, SGLangParser, make_parser, make_reasoning
from edge.tokens.parsers.sglang_adapter import SGLangReasoning, reasoning_parser_names, tool_parser_names
from edge.tokens.reasoning import ThinkReasoning
from edge.tokens.reply import ReplyParser, call_ids

WEATHER = ToolSpec(name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}})


def ids(i: int) -> str:
    return f"call_3_{i}"


def test_every_sglang_parser_is_exposed() -> None:
    """All 44 tool-call and 36 reasoning parsers of sglang 0.5.23 but ``response_template`` (which
    wants the model's template: refused, naming why, below)."""
    assert len(tool_parser_names()) == 44 and len(reasoning_parser_names()) == 36
    for name in tool_parser_names() - {"response_template"}:
        assert make_parser(f"sglang:{name}").name == f"sglang:{name}"
    for name in reasoning_parser_names() - {"response_template"}:
        assert make_reasoning(f"sglang:{name}").name == f"sglang:{name}"


def test_names_and_markers() -> None:
    assert isinstance(make_parser("hermes"), HermesParser)  # a built-in name is the built-in parser
    parser = make_parser("sglang:hermes")
    assert isinstance(parser, SGLangParser) and parser.start_markers == ("<tool_call>",)
    assert make_parser("sglang:kimi_k2").start_markers == ("<|tool_calls_section_begin|>",)
    assert isinstance(make_reasoning("think"), ThinkReasoning)


@pytest.mark.parametrize(("make", "name", "message"), [
    (make_parser, "kimi_k2", r"unknown tool format 'kimi_k2'; expected one of \[.*'hermes'.*\] or sglang:NAME"),
    (make_parser, "sglang:nope", r"sglang has no tool-call parser 'nope'; it has \[.*'kimi_k2'.*\]"),
    (make_reasoning, "qwen3", r"unknown reasoning format 'qwen3'; expected one of \['think'\] or sglang:NAME"),
    (make_reasoning, "sglang:nope", r"sglang has no reasoning parser 'nope'; it has \[.*'qwen3'.*\]"),
    (make_parser, "sglang:response_template", r"^--tool-format sglang:response_template: sglang cannot build it "
                                              r"here \(response_template is required\)$"),
    (make_reasoning, "sglang:response_template", r"^--reasoning-format sglang:response_template: sglang cannot "
                                                 r"build it here \(response_template is required\)$"),
])
def test_unknown_names_are_refused_naming_the_choices(make, name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(name)


@pytest.fixture
def sglang_import_fails(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``import sglang...`` raising what a CUDA torchvision makes it raise (not an ImportError)."""
    real = importlib.import_module

    def import_module(name: str, package: str | None = None) -> object:
        if name.startswith("sglang"):
            raise RuntimeError("operator torchvision::nms does not exist\n(a CUDA build)")
        return real(name, package)

    sglang_adapter._load.cache_clear()
    monkeypatch.setattr(sglang_adapter.importlib, "import_module", import_module)
    yield
    sglang_adapter._load.cache_clear()


def test_a_failing_sglang_import_is_one_configuration_error_naming_its_cause(sglang_import_fails: None) -> None:
    expected = ("--tool-format sglang:hermes: sglang does not import (RuntimeError: operator torchvision::nms does "
                "not exist (a CUDA build)); install the sglang extra (README, Install)")
    with pytest.raises(ValueError) as caught:
        make_parser("sglang:hermes")
    assert str(caught.value) == expected
    with pytest.raises(ValueError, match=r"^--reasoning-format sglang:qwen3: sglang does not import \(RuntimeError"):
        make_reasoning("sglang:qwen3")
    assert isinstance(make_parser("hermes"), HermesParser)  # the built-ins never need it


@pytest.mark.parametrize(("name", "text"), [
    ("qwen25", 'Hi\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    ("qwen3_coder", "Hi\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
                    "</tool_call>"),
    ("llama3", 'Hi<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
])
def test_calls_are_mapped_with_our_ids(name: str, text: str) -> None:
    out = make_parser(f"sglang:{name}").parse(text, ids, (WEATHER,))
    assert out.content == "Hi" and out.parse_error is None
    assert [(c.id, c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("call_3_0", "get_weather", {"city": "Oslo"})]
    assert make_parser(f"sglang:{name}").parse("plain \n", ids, (WEATHER,)).content == "plain \n"


class _Item:
    def __init__(self, name: str | None, parameters: str) -> None:
        self.name, self.parameters = name, parameters


class _Failing:
    """What a detector that raises, or returns a call without a name, looks like to the adapter."""

    def parse_non_stream(self, text: str) -> tuple[str, list[_Item]]:
        if "boom" in text:
            raise RuntimeError("detector failed")
        return "", [_Item(None, "{}")]

    def parse_stream_chunk(self, text: str) -> tuple[str, list[_Item]]:
        raise RuntimeError("stream failed")


def test_sglang_failures_are_parse_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = make_parser("sglang:kimi_k2")
    assert isinstance(parser, SGLangParser)
    monkeypatch.setattr(parser, "new", lambda tools: _Failing())
    for text, reason in [("boom", "sglang kimi_k2 parser failed: RuntimeError('detector failed')"),
                         ("nameless", "sglang kimi_k2 returned an incomplete call")]:
        out = parser.parse(text, ids, (WEATHER,))
        assert (out.content, out.tool_calls, out.parse_error) == (text, (), reason)
    stream = ReplyParser(parser).stream(call_ids(1))  # a stream that fails shows nothing more until the end
    assert stream.feed("some text") == []
    assert stream.finish()[0] == [ContentDelta("some text")]


def test_sglang_reasoning_whole_and_streamed() -> None:
    text = "<think>\nLook it up.\n</think>\n\nIt is sunny."
    qwen3 = make_reasoning("sglang:qwen3")
    assert qwen3.split(text) == ("\nLook it up.\n", "\n\nIt is sunny.")  # SGLang keeps the newlines; ours strips
    assert ThinkReasoning().split(text) == ("Look it up.", "It is sunny.")
    replies = ReplyParser(make_parser("hermes"), reasoning=qwen3)
    stream = replies.stream(call_ids(1))
    deltas = [d for piece in ["<think>", "\nLook", " it up.\n", "</think>", "\n\nIt is", " sunny."]
              for d in stream.feed(piece)]
    last, record = stream.finish()
    deltas += last
    assert "".join(d.text for d in deltas if isinstance(d, ReasoningDelta)) == record.reasoning == "\nLook it up.\n"
    assert "".join(d.text for d in deltas if isinstance(d, ContentDelta)) == record.content == "\n\nIt is sunny."
    assert replies.parse(text, call_ids(1)) == record


def test_a_prompt_that_opens_the_reasoning_forces_it() -> None:
    assert SGLangReasoning("qwen3", starts_open=True).split("Hmm.</think>Done.") == ("Hmm.", "Done.")
    assert SGLangReasoning("qwen3").split("Hmm.</think>Done.") == (None, "Hmm.</think>Done.")
