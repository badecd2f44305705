"""The derived constraints (edge.tokens.constraint) against the chat templates' own renderings, with
llguidance (edge.engines.grammar) and the real tokenizers: a valid call in the model's format is
admitted and parses; other tools, bad arguments, plain text and (when not allowed) parallel calls
are not."""

from __future__ import annotations

import json
from functools import cache

import pytest

from edge.chat.conversation import Message, NamedTool, OutputFormat
from edge.engines.grammar import GrammarTokenizer, TokenMatcher
from edge.tokens.constraint import MARKERS, derive_constraint
from edge.tokens.fidelity import load_codec, sampled_text
from edge.tokens.incremental import TemplateCodec
from edge.tokens.parsers.base import ToolParser
from schemas.events import ToolCall
from tests.unit.test_constraint import TOOLS


@cache
def _codec(tokenizer: str, tool_format: str) -> tuple[TemplateCodec, ToolParser, GrammarTokenizer, frozenset[str]]:
    codec, parser = load_codec(tokenizer, tool_format)
    tok = codec.tokenizer
    markers = frozenset(m for m in MARKERS if tok.is_added_token(m))
    return codec, parser, GrammarTokenizer(tok.to_json(), 151936 if "qwen" in tokenizer else tok.vocab_size,
                                           tok.stop_token_ids), markers


def _call(name: str, arguments: dict) -> ToolCall:
    return ToolCall(id="c1", name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def _matcher(tokenizer: str, tool_format: str, choice, **options) -> tuple[TemplateCodec, TokenMatcher]:
    codec, _, grammar, markers = _codec(tokenizer, tool_format)
    constraint = derive_constraint(tool_format, TOOLS, choice, token_markers=markers, **options)
    assert constraint is not None
    return codec, grammar.matcher(constraint.grammar)


def _reply_ids(codec: TemplateCodec, *calls: ToolCall, content: str = "") -> list[int]:
    history = [Message(role="user", content="Weather in Zürich?")]
    reply = Message(role="assistant", content=content, tool_calls=calls)
    return codec.tokenizer.encode(sampled_text(codec, history, reply, TOOLS))


FORMATS = [("builtin:qwen2.5", "hermes"), ("builtin:qwen3-coder", "qwen3_coder"), ("builtin:smollm2", "smollm2")]
GOOD = _call("get_weather", {"city": "Zürich", "days": 3, "unit": "c"})


@pytest.mark.parametrize(("tokenizer", "tool_format"), FORMATS)
def test_the_templates_own_call_is_admitted_and_parses(tokenizer, tool_format):
    codec, matcher = _matcher(tokenizer, tool_format, NamedTool(name="get_weather"))
    ids = _reply_ids(codec, GOOD)
    assert matcher.accepts(ids)
    _, parser, _, _ = _codec(tokenizer, tool_format)
    parsed = parser.parse(codec.reply_text(ids), lambda i: f"c{i}", TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", json.loads(
        GOOD.arguments))]


@pytest.mark.parametrize(("tokenizer", "tool_format"), FORMATS)
def test_other_tools_bad_arguments_and_plain_text_are_not_admitted(tokenizer, tool_format):
    codec, matcher = _matcher(tokenizer, tool_format, NamedTool(name="get_weather"))
    assert not matcher.accepts(_reply_ids(codec, _call("search", {"q": "x"})))
    assert not matcher.accepts(_reply_ids(codec, _call("get_weather", {"days": 3})))  # city is required
    assert not matcher.accepts(_reply_ids(codec, content="It is sunny."))
    if tool_format != "qwen3_coder":  # there, "3" is the text of a string as much as of an integer
        assert not matcher.accepts(_reply_ids(codec, _call("get_weather", {"city": "Z", "days": "3"})))


@pytest.mark.parametrize(("tokenizer", "tool_format"), FORMATS)
def test_parallel_calls_are_admitted_only_when_allowed(tokenizer, tool_format):
    codec, matcher = _matcher(tokenizer, tool_format, "required")
    two = _reply_ids(codec, GOOD, _call("now", {}))
    assert matcher.accepts(two)
    codec, single = _matcher(tokenizer, tool_format, "required", parallel=False)
    assert not single.accepts(two)
    assert single.accepts(_reply_ids(codec, _call("now", {})))


def test_llama3_calls_are_admitted_as_the_parser_reads_them():
    codec, _, grammar, _ = _codec("builtin:qwen2.5", "hermes")
    constraint = derive_constraint("llama3", TOOLS, "required")
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}'
    assert grammar.matcher(constraint.grammar).accepts([*codec.tokenizer.encode(text), codec.tokenizer.eos_token_id])
    assert not grammar.matcher(constraint.grammar).accepts(codec.tokenizer.encode('{"name": "nope"'))


def test_a_json_schema_format_admits_only_valid_json():
    codec, _, grammar, _ = _codec("builtin:qwen2.5", "hermes")
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    constraint = derive_constraint("hermes", (), "auto", output_format=OutputFormat(type="json_schema",
                                                                                     schema=schema))
    eos = codec.tokenizer.eos_token_id
    assert grammar.matcher(constraint.grammar).accepts([*codec.tokenizer.encode('{"answer": 42}'), eos])
    assert not grammar.matcher(constraint.grammar).accepts(codec.tokenizer.encode('{"answer": "42"}'))
    assert not grammar.matcher(constraint.grammar).accepts(codec.tokenizer.encode("42"))
