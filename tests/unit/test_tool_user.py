"""The scripted model of the agent suite: tools read back from a real template's render, the harmless
one picked, arguments valid for its schema, the turn after a tool result."""

from __future__ import annotations

import json

import pytest

from edge.tokens.tokenizer import load_tokenizer
from rollbus.testing.tool_user import (
    ECHO,
    Encoding,
    Tool,
    ToolUser,
    example_arguments,
    harmless_rank,
    name_words,
    next_turn,
    pick_tool,
    read_tools,
)

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}


def spec(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name}\nsecond line",
                                             "parameters": parameters or SCHEMA}}


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer("builtin:qwen2.5")


def render(qwen, tools: list[dict], messages: list[dict] | None = None) -> str:
    messages = messages or [{"role": "system", "content": "You help."}, {"role": "user", "content": "hi"}]
    return qwen.chat_template.render(messages, tools=tools, add_generation_prompt=True)


def test_read_tools_reads_back_what_the_template_rendered(qwen):
    prompt = render(qwen, [spec("echo"), spec("Read", {"type": "object", "properties": {}})])
    assert read_tools(prompt) == [Tool("echo", SCHEMA, "echo\nsecond line"),
                                  Tool("Read", {"type": "object", "properties": {}}, "Read\nsecond line")]
    assert read_tools(render(qwen, [])) == []


def test_name_words_split_camel_case_and_separators():
    assert name_words("KillShell") == ["kill", "shell"]
    assert name_words("list_mcp-resources") == ["list", "mcp", "resources"]
    assert name_words("exec_command") == ["exec", "command"]


@pytest.mark.parametrize(("names", "chosen"), [
    (["Bash", "Edit", "Glob", "Read", "Write", "KillShell", "WebFetch", "TodoWrite"], "Glob"),  # Claude Code's
    (["exec_command", "write_stdin", "update_plan", "apply_patch", "view_image"], "exec_command"),  # Codex's
    (["bash"], "bash"),  # mini-swe-agent's only tool
    (["final_answer", "echo"], "echo"),
    (["final_answer"], None),
    (["delete_file", "send_email"], None),
])
def test_pick_tool_takes_the_most_harmless(names, chosen):
    tools = [Tool(name) for name in names]
    picked = pick_tool(tools)
    assert (picked.name if picked else None) == chosen


def test_pick_tool_prefers_what_the_test_names_when_offered():
    tools = [Tool("Glob"), Tool("Agent"), Tool("Bash")]
    assert pick_tool(tools, ["Missing", "Agent"]).name == "Agent"
    assert harmless_rank(Tool("Agent")) is None  # only a preference picks it


def test_example_arguments_fit_the_schema():
    schema = {"type": "object", "required": ["command", "pattern", "path", "n", "flag", "mode", "tags", "opt",
                                             "nested", "argv"],
              "properties": {"command": {"type": "string"}, "pattern": {"type": "string"},
                             "path": {"type": "string"}, "n": {"type": "integer", "minimum": 3},
                             "flag": {"type": "boolean"}, "mode": {"enum": ["fast", "slow"]},
                             "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
                             "opt": {"anyOf": [{"type": "null"}, {"type": "number"}]},
                             "nested": {"type": "object", "properties": {"q": {"type": ["null", "string"]}},
                                        "required": ["q"]},
                             "argv": {"type": "array", "items": {"type": "string"}},
                             "unrequired": {"type": "string"}}}
    assert example_arguments(schema) == {"command": ECHO, "pattern": "*", "path": ".", "n": 3, "flag": False,
                                         "mode": "fast", "tags": ["rollbus", "rollbus"], "opt": 1,
                                         "nested": {"q": "rollbus"}, "argv": ["echo", "rollbus"]}
    assert example_arguments({"type": "object"}) == {}


def test_next_turn_calls_once_then_answers(qwen):
    tools = [spec("write_file"), spec("echo")]
    first = next_turn(render(qwen, tools), "All done.")
    assert first.tool == "echo"
    call = json.loads(first.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call == {"name": "echo", "arguments": {"text": "rollbus"}}
    after = render(qwen, tools, [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "", "tool_calls": [
                                     {"type": "function", "function": {"name": "echo", "arguments": {"text": "x"}}}]},
                                 {"role": "tool", "content": "x"}])
    assert next_turn(after, "All done.").text == "All done."
    assert next_turn(after, "All done.", finish=("bash", {"command": "echo END"})).tool == "bash"
    final = next_turn(render(qwen, [*tools, spec("final_answer")]).replace("hi", "<tool_response>"), "42")
    assert json.loads(final.text.split("\n")[1]) == {"name": "final_answer", "arguments": {"answer": "42"}}


def test_next_turn_reads_smolagents_observations_as_tool_results(qwen):
    """smolagents sends its calls back as assistant text and their results as a user turn; its system
    prompt's examples also say "Observation:", which is no result."""
    tools = [spec("echo"), spec("final_answer")]
    system = {"role": "system", "content": "Example:\nObservation: 42\nObservation:\n7"}
    first = [system, {"role": "user", "content": "New task:\nEcho x."}]
    assert next_turn(render(qwen, tools, first), "x").tool == "echo"
    observed = [*first, {"role": "assistant", "content": "Calling tools:\n[{'id': 'call_1_0'}]"},
                {"role": "user", "content": "Observation:\necho: x"}]
    assert next_turn(render(qwen, tools, observed), "x").tool == "final_answer"


def test_tool_user_encodes_each_turn_with_the_end_token_and_keeps_it(qwen):
    user = ToolUser(Encoding(qwen.encode, qwen.decode, qwen.eos_token_id), answer="Fine.")
    reply = user(qwen.encode(render(qwen, [spec("echo")])), {})
    assert reply.token_ids[-1] == qwen.eos_token_id == qwen.token_to_id("<|im_end|>")
    assert qwen.decode(reply.token_ids[:-1]) == user.turns[0].text and user.turns[0].tool == "echo"
    assert reply.logprobs == [-0.01 * (i + 1) for i in range(len(reply.token_ids))]
    user.reset("Other.", policy=lambda prompt: next_turn(prompt, "Policy."))
    assert qwen.decode(user(qwen.encode("<tool_response>"), {}).token_ids[:-1]) == "Policy."
    assert user.replies == [reply.token_ids, [*qwen.encode("Policy."), qwen.eos_token_id]]
