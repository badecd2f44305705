"""End to end with the other builtin templates: Qwen3-Coder XML tool calls reach the OpenAI SDK
with schema-typed arguments, a thinking model's reasoning tokens stay in the record as sampled, and
SGLang's parsers (``sglang:NAME``) serve streamed and plain turns alike."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest
from openai import OpenAI

from edge.chat.conversation import template_message, template_tools
from edge.tokens.tokenizer import load_tokenizer
from edge.wires.openai import decode_request
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply
from schemas.log import LogConfig
from stack.nats_server import EmbeddedNats
from stack.runtime import StackOptions
from tests.e2e.scenario import openai_accumulate
from tests.e2e.test_openai_session import open_session, wait_for_parquet
from tests.stack import StackThread

IM_END = 151645
TOOLS = [{"type": "function", "function": {
    "name": "forecast", "description": "The weather forecast.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"type": "string"}}}}}}]

StackFactory = Callable[..., StackThread]


@pytest.fixture
def make_stack(nats_server: EmbeddedNats, log_config: LogConfig, engine: ScriptedEngineServer,
               tmp_path) -> Iterator[StackFactory]:
    started: list[StackThread] = []

    def make(tokenizer: str, tool_format: str, reasoning_format: str = "think") -> StackThread:
        options = StackOptions(port=0, data_dir=tmp_path / "data", nats_url=nats_server.url, engine="sglang",
                               engine_urls=(engine.url,), admin_token="tok", log=log_config, tokenizer=tokenizer,
                               tool_format=tool_format, reasoning_format=reasoning_format,
                               max_trajectory_length=4096)
        started.append(StackThread(options).start())
        return started[-1]

    yield make
    for running in started:
        running.stop()


def scripted(tokenizer_name: str, text: str) -> ScriptedReply:
    return ScriptedReply(token_ids=[*load_tokenizer(tokenizer_name).encode(text), IM_END])


def finalize_and_read(stack: StackThread, session: dict) -> dict:
    final = httpx.post(f"{stack.url}/sessions/{session['session_id']}/finalize", headers=stack.admin).json()
    assert final["trajectories"] == 1
    (row,) = wait_for_parquet(stack.trajectories, session["session_id"])
    return row


def test_qwen3_coder_xml_calls_arrive_with_typed_arguments(make_stack: StackFactory,
                                                           engine: ScriptedEngineServer) -> None:
    stack = make_stack("builtin:qwen3-coder", "qwen3_coder")
    xml = ("Checking.\n\n<tool_call>\n<function=forecast>\n<parameter=city>\nSão Paulo\n</parameter>\n"
           "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\nfalse\n</parameter>\n"
           '<parameter=fields>\n["rain", "wind"]\n</parameter>\n</function>\n</tool_call>')
    engine.push(scripted("builtin:qwen3-coder", xml), scripted("builtin:qwen3-coder", "Rain all week."))
    session = open_session(stack)
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[dict] = [{"role": "user", "content": "Weather in São Paulo?"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content == "Checking."
    (call,) = first.message.tool_calls
    assert call.function.name == "forecast"
    assert json.loads(call.function.arguments) == {"city": "São Paulo", "days": 3, "hourly": False,
                                                   "fields": ["rain", "wind"]}
    messages += [first.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "rain"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0]
    assert second.message.content == "Rain all week."
    messages.append(second.message.model_dump(exclude_none=True))

    row = finalize_and_read(stack, session)
    tokenizer = load_tokenizer("builtin:qwen3-coder")
    conversation = decode_request(json.dumps({"messages": messages, "tools": TOOLS}).encode())
    render = tokenizer.chat_template.render([template_message(m) for m in conversation.messages],
                                            tools=template_tools(conversation.tools))
    assert tokenizer.decode(row["input_ids"]) + "\n" == render


def test_thinking_tokens_stay_in_the_record_as_sampled(make_stack: StackFactory,
                                                       engine: ScriptedEngineServer) -> None:
    stack = make_stack("builtin:qwen3", "hermes")
    reply = scripted("builtin:qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!")
    engine.push(reply)
    session = open_session(stack)
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])

    row = finalize_and_read(stack, session)
    assert row["responses"] == reply.token_ids and row["response_mask"] == [1] * len(reply.token_ids)
    assert row["responses"][:2] == [151667, 198]  # <think>, "\n": sampled, not part of the prompt
    prompt = load_tokenizer("builtin:qwen3").decode(row["prompts"])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"



def _streamed(client: OpenAI, messages: list[dict]) -> dict:
    """The assistant message of a streamed reply, put together from its chunks, with its finish reason."""
    chunks = list(client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True))
    message, finish, _ = openai_accumulate(chunks)
    return {"content": message["content"] or "", "reasoning_content": message.get("reasoning_content", ""),
            "tool_calls": message.get("tool_calls", []), "finish_reason": finish}


def test_sglang_parsers_serve_streamed_and_plain_turns_alike(make_stack: StackFactory,
                                                             engine: ScriptedEngineServer) -> None:
    stack = make_stack("builtin:qwen3", "sglang:hermes", "sglang:qwen3")
    text = ('<think>\nLook it up.\n</think>\n\nChecking.\n<tool_call>\n{"name": "forecast", "arguments": '
            '{"city": "Oslo", "days": 2}}\n</tool_call>')
    reply = scripted("builtin:qwen3", text)
    messages: list[dict] = [{"role": "user", "content": "Weather in Oslo?"}]
    engine.push(reply, reply)
    plain_session, streamed_session = open_session(stack), open_session(stack)
    plain = OpenAI(base_url=plain_session["base_url"], api_key=plain_session["api_key"], max_retries=0)
    first = plain.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0]
    streamed = _streamed(OpenAI(base_url=streamed_session["base_url"], api_key=streamed_session["api_key"],
                                max_retries=0), messages)
    assert first.finish_reason == streamed["finish_reason"] == "tool_calls"
    assert (first.message.model_extra or {}).get("reasoning_content") == streamed["reasoning_content"]
    assert streamed["reasoning_content"].strip() == "Look it up."  # SGLang's qwen3 keeps the newlines
    assert first.message.content == streamed["content"] == "\n\nChecking."  # the newlines after </think>
    (call,) = first.message.tool_calls
    assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed["tool_calls"]] \
        == [(call.id, "forecast", {"city": "Oslo", "days": 2})] and json.loads(call.function.arguments) == {
            "city": "Oslo", "days": 2}

    engine.push(scripted("builtin:qwen3", "<think>\nDone.\n</think>\n\nSunny."))
    messages += [first.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sun"}]
    second = plain.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0]
    assert second.message.content.strip() == "Sunny."
    row = finalize_and_read(stack, plain_session)  # one chain: the history matched what was recorded
    assert row["responses"][:len(reply.token_ids)] == reply.token_ids  # the sampled tokens, as sampled
