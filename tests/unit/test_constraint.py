"""The constraint a request implies (edge.tokens.constraint), derived purely: what the grammar holds.
How it fares against the templates' renderings: tests/integration/test_constraint_grammar.py."""

from __future__ import annotations

import json

import pytest

from edge.chat.conversation import NamedTool, OutputFormat, ToolSpec
from edge.tokens.constraint import JSON_OPTIONS, derive_constraint
from schemas.errors import Unconstrainable

WEATHER = ToolSpec(name="get_weather", parameters={
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                                     "unit": {"enum": ["c", "f"]}, "where": {"type": "object"}},
    "required": ["city"], "additionalProperties": False})
SEARCH = ToolSpec(name="search", parameters={"type": "object", "properties": {"q": {"type": "string"}},
                                             "required": ["q"]})
BARE = ToolSpec(name="now")  # no schema: any object
TOOLS = (WEATHER, SEARCH, BARE)
QWEN_MARKERS = frozenset({"<tool_call>", "</tool_call>", "</think>"})


# --- pure derivation --------------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["auto", "none"])
def test_nothing_forced_is_no_constraint(choice):
    assert derive_constraint("hermes", TOOLS, choice) is None


def test_a_named_tool_admits_only_that_tool():
    c = derive_constraint("hermes", TOOLS, NamedTool(name="search"), token_markers=QWEN_MARKERS)
    assert c is not None and c.label == "tool:search"
    assert '"const": "search"' in c.grammar and "get_weather" not in c.grammar
    assert c.json_schema is None  # the text is not one JSON value: the markers are around it


def test_required_admits_every_tool_with_its_schema():
    c = derive_constraint("hermes", TOOLS, "required", token_markers=QWEN_MARKERS)
    assert c is not None and c.label == "tool:required"
    for tool in TOOLS:
        assert f'"const": "{tool.name}"' in c.grammar
    assert json.dumps(WEATHER.parameters["properties"]) in c.grammar  # arguments as the tool's schema
    assert json.dumps(JSON_OPTIONS) in c.grammar  # the templates' separators, lenient


def test_parallel_calls_repeat_and_single_calls_do_not():
    parallel = derive_constraint("hermes", TOOLS, "required", token_markers=QWEN_MARKERS).grammar
    single = derive_constraint("hermes", TOOLS, "required", parallel=False, token_markers=QWEN_MARKERS).grammar
    assert '("\\n" block_1)*' in parallel
    assert "*" not in single.replace('"\\n"', "")


def test_markers_are_tokens_only_where_the_tokenizer_has_them():
    as_tokens = derive_constraint("hermes", TOOLS, "required", token_markers=QWEN_MARKERS).grammar
    as_text = derive_constraint("hermes", TOOLS, "required").grammar
    assert "block_1: <tool_call> " in as_tokens and " </tool_call>" in as_tokens
    assert 'block_1: "<tool_call>" ' in as_text


@pytest.mark.parametrize("tool_format", ["none", "sglang:kimi_k2", "made_up"])
def test_a_forced_call_in_a_format_without_a_grammar_is_refused(tool_format):
    with pytest.raises(Unconstrainable) as caught:
        derive_constraint(tool_format, TOOLS, "required")
    assert caught.value.param == "tool_choice" and tool_format in caught.value.message


def test_json_formats_carry_their_schema():
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    c = derive_constraint("hermes", (), "auto", output_format=OutputFormat(type="json_schema", schema=schema,
                                                                            name="result"))
    assert c is not None and c.label == "json_schema:result" and c.json_schema == schema
    plain = derive_constraint("none", (), "none", output_format=OutputFormat(type="json_object"))
    assert plain is not None and plain.label == "json_object" and plain.json_schema == {"type": "object"}


def test_a_json_format_beside_tools_also_admits_a_call():
    c = derive_constraint("hermes", TOOLS, "auto", output_format=OutputFormat(type="json_object"))
    assert c is not None and c.json_schema is None and "answer_" in c.grammar and '"const": "now"' in c.grammar
    with pytest.raises(Unconstrainable) as caught:
        derive_constraint("none", TOOLS, "auto", output_format=OutputFormat(type="json_object"))
    assert caught.value.param == "response_format"
    # With tool_choice none, the tools do not matter.
    assert derive_constraint("none", TOOLS, "none", output_format=OutputFormat(type="json_object")) is not None


def test_a_single_llama3_call_is_one_json_value():
    c = derive_constraint("llama3", TOOLS, NamedTool(name="search"), parallel=False)
    assert c is not None and c.json_schema is not None
    assert c.json_schema["properties"]["name"] == {"const": "search"}
    assert c.json_schema["properties"]["parameters"] == SEARCH.parameters


def test_reasoning_comes_first_when_the_prompt_opens_it():
    c = derive_constraint("hermes", TOOLS, "required", token_markers=QWEN_MARKERS, reasoning_open=True)
    assert c is not None and c.grammar.startswith("start: reasoning_") and "</think>" in c.grammar


def test_the_derivation_is_deterministic():
    args = ("qwen3_coder", TOOLS, "required")
    assert derive_constraint(*args, token_markers=QWEN_MARKERS) == derive_constraint(*args,
                                                                                    token_markers=QWEN_MARKERS)
