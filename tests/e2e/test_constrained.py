"""End to end: forced tool use and JSON formats through the engine's constrained decoding.

The official SDKs send ``tool_choice`` ``required`` / a named function / Anthropic ``any`` / ``tool``
and ``response_format`` ``json_schema``; the engine gets the constraint (the scripted SGLang engine
records it and refuses a scripted reply outside it, as a real engine could not sample one); the local
tiny random model, which never writes a call by itself, is forced into a parseable, schema-valid call;
the turn is marked in the log and the record."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import jsonschema
import msgspec
import openai
import pytest

from edge.chat.conversation import NamedTool, ToolSpec
from edge.tokens.constraint import MARKERS, derive_constraint
from edge.tokens.tokenizer import Tokenizer
from rollbus.testing.constraints import grammar_checker
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply, default_logprobs
from schemas import envelope
from schemas.events import TurnCompleted
from stack.runtime import StackOptions
from tests.e2e.conftest import ADMIN_TOKEN
from tests.e2e.test_openai_session import open_session, wait_for_parquet
from tests.stack import StackThread

ARGS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Zürich"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": ARGS}},
         {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}
USER = [{"role": "user", "content": "Weather in Paris?"}]
IM_END = 151645


def scripted(tokenizer: Tokenizer, text: str) -> ScriptedReply:
    ids = [*tokenizer.encode(text), IM_END]
    return ScriptedReply(token_ids=ids, logprobs=default_logprobs(len(ids)))


def call_text(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n</tool_call>'


def start(nats_server, log_config, tmp_path, **options: object) -> StackThread:
    return StackThread(StackOptions(port=0, data_dir=tmp_path / "data", nats_url=nats_server.url,
                                    admin_token=ADMIN_TOKEN, log=log_config, max_trajectory_length=4096,
                                    **options)).start()  # type: ignore[arg-type]


@pytest.fixture
def checked_engine(tokenizer) -> Iterator[ScriptedEngineServer]:
    with ScriptedEngineServer(checker=grammar_checker(tokenizer, 151936)) as server:
        yield server


@pytest.fixture
def checked_stack(nats_server, log_config, tmp_path, checked_engine) -> Iterator[StackThread]:
    stack = start(nats_server, log_config, tmp_path, engine="sglang", engine_urls=(checked_engine.url,))
    yield stack
    stack.stop()


def test_openai_required_and_json_schema_reach_the_engine_and_are_held_to(checked_stack, checked_engine, tokenizer):
    session = open_session(checked_stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    checked_engine.push(scripted(tokenizer, call_text("get_weather", {"city": "Paris", "days": 2})))
    forced = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required")
    (call,) = forced.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    markers = frozenset(m for m in MARKERS if tokenizer.is_added_token(m))
    specs = tuple(ToolSpec(name=t["function"]["name"], description=t["function"].get("description"),
                           parameters=t["function"]["parameters"]) for t in TOOLS)
    assert checked_engine.constraints[-1] == {"ebnf": derive_constraint("hermes", specs, "required",
                                                                         token_markers=markers).grammar}

    checked_engine.push(scripted(tokenizer, '{"answer": 42}'))
    history = [*USER, forced.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}, {"role": "user", "content": "Sum?"}]
    formatted = client.chat.completions.create(model="m", messages=history, response_format={
        "type": "json_schema", "json_schema": {"name": "sum", "schema": ANSWER, "strict": True}})
    assert json.loads(formatted.choices[0].message.content) == {"answer": 42}
    assert checked_engine.constraints[-1] == {"json_schema": json.dumps(ANSWER, separators=(",", ":"))}

    # A reply the constraint does not admit never reaches the agent: the engine refuses it (a 400).
    checked_engine.push(scripted(tokenizer, "I would rather chat."))
    with pytest.raises(openai.BadRequestError, match="constraint: a token the grammar does not admit"):
        client.chat.completions.create(model="m", messages=USER, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "search"}})
    turns = [e for e in checked_stack.events(session["session_id"]) if isinstance(e, TurnCompleted)]
    assert [t.constrained for t in turns] == ["tool:required", "json_schema:sum"]
    free = msgspec.structs.replace(turns[0], constrained=msgspec.UNSET)
    assert b"constrained" not in envelope.encode([free]) and b"constrained" in envelope.encode(turns[:1])


def test_anthropic_any_and_tool_reach_the_engine(checked_stack, checked_engine, tokenizer):
    session = open_session(checked_stack)
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    checked_engine.push(scripted(tokenizer, call_text("search", {"q": "news"})))
    message = client.messages.create(model="m", max_tokens=64, messages=USER, tools=tools,
                                     tool_choice={"type": "tool", "name": "search", "disable_parallel_tool_use": True})
    assert message.stop_reason == "tool_use" and message.content[0].input == {"q": "news"}
    grammar = checked_engine.constraints[-1]["ebnf"]
    assert '"const": "search"' in grammar and "get_weather" not in grammar and "block_1)*" not in grammar
    checked_engine.push(scripted(tokenizer, call_text("get_weather", {"city": "Zürich", "days": 1})))
    again = client.messages.create(model="m", max_tokens=64, messages=USER, tools=tools, tool_choice={"type": "any"})
    assert again.content[0].name == "get_weather"
    with pytest.raises(anthropic.BadRequestError, match=r"tool_choice\.name"):
        client.messages.create(model="m", max_tokens=64, messages=USER, tools=tools,
                               tool_choice={"type": "tool", "name": "bash"})


def test_responses_required_named_and_json_schema_reach_the_engine(checked_stack, checked_engine, tokenizer):
    session = open_session(checked_stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"],
              **({"description": t["function"]["description"]} if "description" in t["function"] else {})}
             for t in TOOLS]
    checked_engine.push(scripted(tokenizer, call_text("get_weather", {"city": "Paris", "days": 3})))
    forced = client.responses.create(model="m", input="Weather in Paris?", tools=tools, tool_choice="required")
    (call,) = [item for item in forced.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 3})
    assert "ebnf" in checked_engine.constraints[-1]

    checked_engine.push(scripted(tokenizer, call_text("search", {"q": "rain"})))
    named = client.responses.create(model="m", input="Search.", tools=tools, parallel_tool_calls=False,
                                    tool_choice={"type": "function", "name": "search"})
    assert [item.name for item in named.output if item.type == "function_call"] == ["search"]
    grammar = checked_engine.constraints[-1]["ebnf"]
    assert '"const": "search"' in grammar and "get_weather" not in grammar

    checked_engine.push(scripted(tokenizer, '{"answer": 7}'))
    shaped = client.responses.create(model="m", input="Sum?", text={"format": {
        "type": "json_schema", "name": "sum", "schema": ANSWER, "strict": True}})
    assert json.loads(shaped.output_text) == {"answer": 7}
    assert checked_engine.constraints[-1] == {"json_schema": json.dumps(ANSWER, separators=(",", ":"))}
    turns = [e for e in checked_stack.events(session["session_id"]) if isinstance(e, TurnCompleted)]
    assert [t.constrained for t in turns] == ["tool:required", "tool:search", "json_schema:sum"]
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.responses.create(model="m", input="x", tools=tools, tool_choice={"type": "function", "name": "nope"})


def test_bad_forced_choices_are_400s_naming_the_field(checked_stack):
    session = open_session(checked_stack)
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    for kwargs, message in (({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                             "not among the tools"),
                            ({"tool_choice": "required"}, "defines no tools"),
                            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                             "needs its schema")):
        with pytest.raises(openai.BadRequestError, match=message) as caught:
            client.chat.completions.create(model="m", messages=USER, **kwargs)
        assert caught.value.body["param"].startswith(("tool_choice", "response_format"))


def test_the_local_random_model_is_forced_into_a_valid_call(nats_server, log_config, tmp_path):
    stack = start(nats_server, log_config, tmp_path, engine="local")
    try:
        session = open_session(stack, uid="forced", session_index=0)
        client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        completion = client.chat.completions.create(
            model="m", messages=USER, tools=TOOLS, max_tokens=96,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), ARGS)
        (turn,) = [e for e in stack.events(session["session_id"]) if isinstance(e, TurnCompleted)]
        assert turn.constrained == "tool:get_weather" and turn.tool_calls[0].name == "get_weather"
        httpx.post(f"{stack.url}/sessions/{session['session_id']}/finalize", headers=stack.admin)
        (row,) = wait_for_parquet(stack.trajectories, session["session_id"])
        assert row["constrained_turns"] == [0]
    finally:
        stack.stop()


def test_a_named_tool_choice_is_decoded_into_the_conversation():
    from edge.wires.openai import decode_request

    body = {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}},
            "parallel_tool_calls": False}
    conversation = decode_request(json.dumps(body).encode())
    assert conversation.tool_choice == NamedTool(name="search") and not conversation.parallel_tool_calls
