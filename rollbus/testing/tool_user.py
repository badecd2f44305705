"""A scripted model for real agent programs: it reads the agent's own tools from its prompt, calls
one harmless tool once, then answers.

:class:`ToolUser` is a responder for :class:`rollbus.testing.scripted.ScriptedEngineServer`: it
decodes the input token ids, finds the tools the chat template rendered (Qwen2.5's hermes format
lists them in the system prompt, one JSON object a line between ``<tools>`` and ``</tools>``), and

* while the prompt holds no tool result, calls one tool: the first of ``prefer`` the agent offers,
  else the most harmless by its name (:func:`pick_tool`), with arguments valid for its schema
  (:func:`example_arguments`);
* once a tool result is in the prompt (:data:`TOOL_RESULTS`), answers: with the call that finishes
  the agent where it has one (given as ``finish``: mini-swe-agent finishes on a command's output;
  or its ``final_answer`` tool: smolagents), else in text.

Everything but :meth:`ToolUser.__call__` is pure, to be tested without an engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from rollbus.testing.scripted import ScriptedReply, default_logprobs

TOOLS_BLOCK = re.compile(r"<tools>\n(.*?)\n</tools>", re.S)
TOOL_RESULT = "<tool_response>"
# How a tool's result shows in the prompt: the template's tool turn, or smolagents' (it sends its calls
# back as assistant text and their results as a user turn, "Observation:\n...").
TOOL_RESULTS = (TOOL_RESULT, "<|im_start|>user\nObservation:\n")
# Words of a tool's name that say it only looks (best first), and words that say it may change something.
HARMLESS = ("echo", "glob", "ls", "list", "read", "view", "get", "search", "find", "lookup")
SHELL = ("bash", "shell", "exec", "command", "terminal", "run")
HARMFUL = {"write", "edit", "delete", "remove", "kill", "create", "patch", "apply", "exit", "update", "set", "web",
           "send", "put", "post", "move", "rename", "notebook", "todo", "plan", "stdin", "image"}
FINAL_ANSWER = "final_answer"
ECHO = "echo rollbus"
TEXT = "rollbus"


class Tool(msgspec.Struct, frozen=True):
    """One function the prompt offers: its name and JSON schema."""

    name: str
    parameters: dict[str, Any] = {}
    description: str = ""


def read_tools(prompt: str) -> list[Tool]:
    """The tools of the prompt's first ``<tools>`` block (none when it has none).

    Each line is ``{"type": "function", "function": {...}}``, or the function itself."""
    block = TOOLS_BLOCK.search(prompt)
    if block is None:
        return []
    tools: list[Tool] = []
    for line in block.group(1).split("\n"):
        spec = json.loads(line)
        spec = spec.get("function", spec)
        tools.append(Tool(name=spec["name"], parameters=spec.get("parameters") or {},
                          description=spec.get("description") or ""))
    return tools


def name_words(name: str) -> list[str]:
    """``"KillShell"`` -> ``["kill", "shell"]``; ``"list_mcp-resources"`` -> ``["list", "mcp", "resources"]``."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    return [word.lower() for word in re.split(r"[\s_\-.:/]+", spaced) if word]


def harmless_rank(tool: Tool) -> int | None:
    """Where the tool's name stands among :data:`HARMLESS`, then :data:`SHELL` (called with an
    ``echo``); ``None`` when a word of it says it may change something, or nothing says it is safe."""
    words = name_words(tool.name)
    if HARMFUL.intersection(words):
        return None
    ranks = [HARMLESS.index(w) for w in words if w in HARMLESS]
    ranks += [len(HARMLESS) + SHELL.index(w) for w in words if w in SHELL]
    return min(ranks, default=None)


def pick_tool(tools: Sequence[Tool], prefer: Sequence[str] = ()) -> Tool | None:
    """The first tool named in ``prefer`` that is offered, else the most harmless one (the final-answer
    tool never: that one ends the run)."""
    by_name = {tool.name: tool for tool in tools}
    for name in prefer:
        if name in by_name:
            return by_name[name]
    ranked = [(rank, i) for i, tool in enumerate(tools)
              if tool.name != FINAL_ANSWER and (rank := harmless_rank(tool)) is not None]
    return tools[min(ranked)[1]] if ranked else None


def example_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """Arguments valid for a function's ``parameters`` schema: its required properties, each given
    an example of its type (a command is an ``echo``, a pattern ``*``)."""
    properties = schema.get("properties") or {}
    return {name: example_value(name, properties.get(name) or {}) for name in schema.get("required") or ()}


def example_value(name: str, schema: dict[str, Any]) -> Any:
    """A value valid for one property's schema; ``name`` (the property's) picks a fitting string."""
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    if "default" in schema and schema["default"] is not None:
        return schema["default"]
    for key in ("anyOf", "oneOf", "allOf"):
        options = [o for o in schema.get(key) or () if o.get("type") != "null"]
        if options:
            return example_value(name, options[0])
    kind = schema.get("type", "string")
    kind = next((k for k in kind if k != "null"), "string") if isinstance(kind, list) else kind
    return _EXAMPLES.get(kind, _string)(name, schema)


def _string(name: str, schema: dict[str, Any]) -> str:
    words = set(name_words(name))
    if words & {"command", "cmd", "script"}:
        return ECHO
    if words & {"pattern", "glob"}:
        return "*"
    if words & {"path", "dir", "directory", "file", "cwd"}:
        return "."
    return TEXT


def _array(name: str, schema: dict[str, Any]) -> list[Any]:
    if set(name_words(name)) & {"command", "cmd", "argv", "args"}:
        return ECHO.split()
    count = max(1, schema.get("minItems", 1))
    return [example_value(name, schema.get("items") or {}) for _ in range(count)]


def _number(name: str, schema: dict[str, Any]) -> int:
    return max(1, int(schema.get("minimum", 1)))


_EXAMPLES: dict[str, Callable[[str, dict[str, Any]], Any]] = {
    "string": _string,
    "array": _array,
    "integer": _number,
    "number": _number,
    "boolean": lambda name, schema: False,
    "object": lambda name, schema: example_arguments(schema),
}


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The hermes tool call the template renders and the edge parses."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class Turn(msgspec.Struct, frozen=True):
    """What the model said to one request: its text and the tool it called (``None``: it answered)."""

    text: str
    tool: str | None


Call = tuple[str, dict[str, Any]]  # a tool's name and arguments


def next_turn(prompt: str, answer: str, prefer: Sequence[str] = (), finish: Call | None = None) -> Turn:
    """Call a tool while the prompt has no tool result, then answer: with ``finish`` when given, else
    through the final-answer tool where the agent has one, else in text."""
    tools = read_tools(prompt)
    if any(result in prompt for result in TOOL_RESULTS):
        if finish is not None:
            return Turn(tool_call(*finish), finish[0])
        if any(tool.name == FINAL_ANSWER for tool in tools):
            return Turn(tool_call(FINAL_ANSWER, {"answer": answer}), FINAL_ANSWER)
        return Turn(answer, None)
    chosen = pick_tool(tools, prefer)
    if chosen is None:
        return Turn(answer, None)
    return Turn(tool_call(chosen.name, example_arguments(chosen.parameters)), chosen.name)


class Encoding(msgspec.Struct, frozen=True):
    """What :class:`ToolUser` needs of a tokenizer: ``encode``, ``decode``, and the end-of-turn token."""

    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    end_id: int


Policy = Callable[[str], Turn]


class ToolUser:
    """The engine's responder: each reply is :func:`next_turn`'s (or ``policy``'s) text, encoded, then
    the end-of-turn token; :attr:`turns` and :attr:`replies` keep them, one per request, in order."""

    def __init__(self, encoding: Encoding, answer: str = "Done.") -> None:
        self.encoding = encoding
        self.answer = answer
        self.prefer: Sequence[str] = ()
        self.finish: Call | None = None
        self.policy: Policy | None = None
        self.turns: list[Turn] = []
        self.replies: list[list[int]] = []

    def reset(self, answer: str, prefer: Sequence[str] = (), finish: Call | None = None,
              policy: Policy | None = None) -> None:
        """From now on, :func:`next_turn` with these (or ``policy``)."""
        self.answer, self.prefer, self.finish, self.policy = answer, tuple(prefer), finish, policy

    def turn(self, prompt: str) -> Turn:
        if self.policy is not None:
            return self.policy(prompt)
        return next_turn(prompt, self.answer, self.prefer, self.finish)

    def __call__(self, input_ids: list[int], body: dict[str, Any]) -> ScriptedReply:
        turn = self.turn(self.encoding.decode(input_ids))
        ids = [*self.encoding.encode(turn.text), self.encoding.end_id]
        self.turns.append(turn)
        self.replies.append(ids)
        return ScriptedReply(token_ids=ids, logprobs=default_logprobs(len(ids)))
