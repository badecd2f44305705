"""Qwen3-Coder XML and Llama-3 JSON parsers, schema-typed values, the registry and SGLang delegation."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge.chat.conversation import Message, ToolSpec
from edge.tokens.incremental import TemplateCodec
from edge.tokens.parsers import BUILTIN, Llama3JsonParser, Qwen3CoderParser, make_parser
from edge.tokens.parsers.base import PlainParser
from edge.tokens.parsers.hermes import HermesParser
from edge.tokens.parsers.schema_values import convert, schema_types
from edge.tokens.tokenizer import load_tokenizer
from schemas.events import ToolCall


def ids(i: int) -> str:
    return f"call_3_{i}"


WEATHER = ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "where": {"type": "object"}, "tags": {"type": "array", "items": {"type": "string"}},
    "limit": {"type": ["integer", "null"]}, "unit": {"enum": ["C", "F"]},
}})

XML = (
    "I'll check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan José\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
    '<parameter=where>\n{"lat": 9.9, "lon": -84.1}\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
    "<parameter=limit>\nnull\n</parameter>\n<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>"
)


# ---------------------------------------------------------------- Qwen3-Coder XML


def test_xml_call_with_values_typed_by_the_schema() -> None:
    out = Qwen3CoderParser().parse(XML, ids, (WEATHER,))
    assert out.content == "I'll check." and out.parse_error is None
    (call,) = out.tool_calls
    assert (call.id, call.name) == ("call_3_0", "get_weather")
    assert json.loads(call.arguments) == {"city": "San José", "days": 3, "metric": True, "ratio": 0.5,
                                          "where": {"lat": 9.9, "lon": -84.1}, "tags": ["a", "b"], "limit": None,
                                          "unit": "C"}
    assert list(json.loads(call.arguments)) == ["city", "days", "metric", "ratio", "where", "tags", "limit", "unit"]


def test_xml_values_without_a_schema_stay_text_verbatim() -> None:
    text = ("<tool_call>\n<function=run>\n<parameter=code>\nif x:\n    print('<b>')\n\n</parameter>\n"
            "<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>")
    (call,) = Qwen3CoderParser().parse(text, ids).tool_calls
    assert json.loads(call.arguments) == {"code": "if x:\n    print('<b>')\n", "n": "3"}


def test_xml_several_calls_and_no_parameters() -> None:
    text = ("<tool_call>\n<function=a>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n<parameter=x>\n1\n"
            "</parameter>\n</function>\n</tool_call>\nafter")
    out = Qwen3CoderParser().parse(text, ids)
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [("call_3_0", "a", "{}"),
                                                                   ("call_3_1", "b", '{"x": "1"}')]
    assert out.content == "after"


def test_xml_values_that_do_not_fit_their_type_stay_text() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>"
    (call,) = Qwen3CoderParser().parse(text, ids, (WEATHER,)).tool_calls
    assert json.loads(call.arguments) == {"days": "three"}


@pytest.mark.parametrize("text", [
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>",  # unterminated
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',  # Hermes JSON
    "<tool_call>\n<function=f>\nstray<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n<parameter=x>\n2\n</parameter>\n</function>\n</tool_call>",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</function>\n</tool_call>",
])
def test_xml_that_does_not_parse_is_content_with_a_reason(text: str) -> None:
    out = Qwen3CoderParser().parse(text, ids)
    assert out.content == text and out.tool_calls == () and out.parse_error


def test_xml_round_trips_through_the_qwen3_coder_template() -> None:
    codec = TemplateCodec(load_tokenizer("builtin:qwen3-coder"))
    arguments = {"city": "東京 🗼", "days": 2, "metric": False, "ratio": 1e-07, "where": {"q": [1, None]},
                 "tags": [], "limit": None, "unit": "F"}
    reply = Message(role="assistant", content="Sure.",
                    tool_calls=(ToolCall(id="x", name="get_weather", arguments=json.dumps(arguments)),))
    prompt = codec.prompt_text([Message(role="user", content="?")], (WEATHER,))
    full = codec.full_text([Message(role="user", content="?"), reply], (WEATHER,), add_generation_prompt=False)
    body = full[len(prompt) :].removesuffix("<|im_end|>\n")
    out = Qwen3CoderParser().parse(body, ids, (WEATHER,))
    assert out.content == "Sure." and json.loads(out.tool_calls[0].arguments) == arguments


# ---------------------------------------------------------------- Llama-3 JSON


def test_llama3_bare_json_call() -> None:
    out = Llama3JsonParser().parse(' {"name": "get_weather", "parameters": {"city": "Paris"}}', ids)
    assert out.content == "" and out.parse_error is None
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_llama3_python_tag_and_several_calls() -> None:
    text = 'Checking.<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1]}};'
    out = Llama3JsonParser().parse(text, ids)
    assert out.content == "Checking."
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [("call_3_0", "a", "{}"),
                                                                   ("call_3_1", "b", '{"x": [1]}')]


def test_llama3_text_after_the_calls_is_content() -> None:
    out = Llama3JsonParser().parse('{"name": "a", "parameters": {"q": "é"}} and more', ids)
    assert out.content == "and more" and out.tool_calls[0].arguments == '{"q": "é"}'


def test_llama3_plain_text_is_content() -> None:
    out = Llama3JsonParser().parse("The answer is {x}.", ids)
    assert out.content == "The answer is {x}." and out.tool_calls == () and out.parse_error is None


@pytest.mark.parametrize("text", [
    '{"answer": 42}',
    "{not json",
    '<|python_tag|>{"name": "a", "parameters": {}}; oops',
    '<|python_tag|>[{"name": "a"}]',
    '{"name": "a", "parameters": [1]}',
])
def test_llama3_that_does_not_parse_is_content_with_a_reason(text: str) -> None:
    out = Llama3JsonParser().parse(text, ids)
    assert out.content == text and out.tool_calls == () and out.parse_error


# ---------------------------------------------------------------- every parser: never an exception


@settings(max_examples=200, deadline=None)
@given(text=st.lists(st.sampled_from(["<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=x>",
                                      "</parameter>", "<|python_tag|>", "{", "}", ";", '"name"', ":", "\n", "x", "1"]),
                     max_size=12).map("".join))
def test_parsers_never_raise(text: str) -> None:
    for parser in (HermesParser(), Qwen3CoderParser(), Llama3JsonParser(), PlainParser()):
        out = parser.parse(text, ids, (WEATHER,))
        assert out.tool_calls or out.content == text


# ---------------------------------------------------------------- schema values


@pytest.mark.parametrize(("schema", "types"), [
    ({"type": "integer"}, ["integer"]),
    ({"type": ["null", "string"]}, ["null", "string"]),
    ({"anyOf": [{"type": "number"}, {"type": "null"}]}, ["number", "null"]),
    ({"enum": [1, "a", None]}, ["integer", "string", "null"]),
    ({"const": True}, ["boolean"]),
    ({}, []),
    (None, []),
])
def test_schema_types(schema: object, types: list[str]) -> None:
    assert schema_types(schema) == types


@pytest.mark.parametrize(("text", "schema", "value"), [
    ("42", {"type": "integer"}, 42),
    ("42.0", {"type": "integer"}, 42),
    ("4.5", {"type": "integer"}, "4.5"),
    ("4.5", {"type": "number"}, 4.5),
    ("true", {"type": "integer"}, "true"),
    ("False", {"type": "boolean"}, False),
    ("None", {"type": ["integer", "null"]}, None),
    ("null", {"type": ["string", "null"]}, "null"),
    ("null", {"type": ["null", "string"]}, None),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("[1, 2]", {"type": "object"}, "[1, 2]"),
    (" 7 ", {}, " 7 "),
])
def test_convert(text: str, schema: object, value: object) -> None:
    assert convert(text, schema) == value
    assert type(convert(text, schema)) is type(value)


# ---------------------------------------------------------------- registry and SGLang


def test_registry_names() -> None:
    assert {name: type(make_parser(name)).__name__ for name in BUILTIN} == {
        "hermes": "HermesParser", "qwen": "HermesParser", "qwen25": "HermesParser", "qwen2_5": "HermesParser",
        "qwen3_coder": "Qwen3CoderParser", "llama3": "Llama3JsonParser", "llama3_json": "Llama3JsonParser",
        "smollm2": "SmolLM2Parser", "none": "PlainParser",
    }
    assert make_parser("qwen3_coder").start_markers == ("<tool_call>",)
    assert make_parser("llama3").start_markers == ("<|python_tag|>", "{")
    assert make_parser("none").start_markers == ()
