"""Tools an agent calls, each with an OpenAI function schema, run against a :class:`Sandbox`.

- ``shell`` ``{"command"}``: a ``/bin/sh -c`` command in the sandbox root;
- ``python`` ``{"code"}``: a snippet on the sandbox's interpreter (read from stdin);
- ``str_replace_editor`` ``{"command": view|create|str_replace|insert, "path", ...}``:
  files inside the sandbox root only (``..``, outside absolute paths and symlinks that
  leave the root are refused by the sandbox);
- ``submit`` ``{"answer"}``: the final answer; it ends the episode.

A tool call never raises into the agent: :func:`call_tool` turns unknown tools, arguments
that are not a JSON object or do not fit the schema, and whatever a tool raises into an
``error: ...`` observation the model reads on its next turn.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import msgspec

from agent_framework.builtin.registry import Registry
from agent_framework.builtin.sandbox import ExecResult, Sandbox
from schemas.errors import ToolArgumentError

log = logging.getLogger(__name__)

MAX_OBSERVATION_CHARS = 65536
_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                            "boolean": (bool,), "array": (list,), "object": (dict,)}
_REASONS = {"cpu": "killed: CPU time limit exceeded", "memory": "out of memory (memory limit)",
            "wall": "killed: wall-clock limit exceeded", "file_size": "killed: file size limit exceeded",
            "signal": "killed by a signal"}
_EDITOR_ARGUMENTS = {"view": {"view_range"}, "create": {"file_text"}, "str_replace": {"old_str", "new_str"},
                     "insert": {"insert_line", "new_str"}}


class ToolOutcome(msgspec.Struct, frozen=True, kw_only=True):
    observation: str
    answer: str | None = None  # set by a tool that ends the episode (submit)
    error: bool = False


class Tool:
    """One function the model may call. Subclasses set the class attributes and ``__call__``."""

    name: ClassVar[str]
    description: ClassVar[str]
    parameters: ClassVar[dict[str, Any]]

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool definition."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def final_answer(self, arguments: Mapping[str, Any]) -> str | None:
        """The episode's answer when this call ends the episode, else None."""
        return None

    async def __call__(self, sandbox: Sandbox, **arguments: Any) -> str:
        raise NotImplementedError



TOOLS: Registry[type[Tool]] = Registry("tool")
register_tool = TOOLS.register

def check_arguments(parameters: Mapping[str, Any], arguments: Mapping[str, Any]) -> None:
    """Required keys present, no unknown keys, top-level JSON types right (booleans are not numbers)."""
    properties: Mapping[str, Any] = parameters.get("properties", {})
    missing = [key for key in parameters.get("required", ()) if key not in arguments]
    if missing:
        raise ToolArgumentError(f"missing required argument(s): {', '.join(missing)}")
    unknown = [key for key in arguments if key not in properties]
    if unknown:
        raise ToolArgumentError(f"unknown argument(s): {', '.join(unknown)}; expected: {', '.join(properties)}")
    for key, value in arguments.items():
        expected = properties[key].get("type")
        if expected is None or (value is None and key not in parameters.get("required", ())):
            continue
        kinds = _JSON_TYPES.get(expected, (object,))
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ToolArgumentError(f"argument {key!r} must be of type {expected}, got {type(value).__name__}")
        if "enum" in properties[key] and value not in properties[key]["enum"]:
            raise ToolArgumentError(f"argument {key!r} must be one of {properties[key]['enum']}, got {value!r}")


def decode_arguments(arguments: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ToolArgumentError(f"arguments are not valid JSON ({exc})") from None
    if not isinstance(arguments, Mapping):
        raise ToolArgumentError(f"arguments must be a JSON object, got {type(arguments).__name__}")
    return dict(arguments)


async def call_tool(tools: Mapping[str, Tool], sandbox: Sandbox, name: str,
                    arguments: str | Mapping[str, Any] | None) -> ToolOutcome:
    """Run one tool call; every failure becomes an ``error:`` observation, never an exception."""
    tool = tools.get(name)
    if tool is None:
        return ToolOutcome(observation=f"error: unknown tool {name!r}; available: {', '.join(tools)}", error=True)
    try:
        decoded = decode_arguments(arguments)
        check_arguments(tool.parameters, decoded)
        observation = await tool(sandbox, **decoded)
    except ToolArgumentError as exc:
        return ToolOutcome(observation=f"error: {name}: {exc}", error=True)
    except Exception as exc:  # the plugin boundary: a failing tool is the model's news, not the episode's end
        log.info("tool %s failed: %r", name, exc)
        return ToolOutcome(observation=f"error: {name}: {type(exc).__name__}: {exc}", error=True)
    return ToolOutcome(observation=clip(observation), answer=tool.final_answer(decoded))


def clip(text: str, limit: int = MAX_OBSERVATION_CHARS) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters omitted ...]\n{text[-half:]}"


def format_result(result: ExecResult) -> str:
    """stdout, then stderr, then how it ended when that was not a clean exit."""
    parts = [result.stdout.rstrip("\n")] if result.stdout else []
    if result.stderr:
        parts.append("[stderr]\n" + result.stderr.rstrip("\n"))
    if result.killed_reason is not None:
        parts.append(f"[{_REASONS[result.killed_reason]}, exit code {result.exit_code}]")
    elif result.exit_code != 0:
        parts.append(f"[exit code {result.exit_code}]")
    return "\n".join(parts) or "[no output]"


def build_tools(names: Sequence[str]) -> dict[str, Tool]:
    """Instances of the registered tools, by name (unknown names: ValueError listing the known ones)."""
    return {name: TOOLS.get(name)() for name in names}


@register_tool("shell")
class Shell(Tool):
    name = "shell"
    description = "Run a shell command (/bin/sh -c) in your working directory. No network access."
    parameters = {"type": "object", "properties": {"command": {"type": "string", "description": "The command."}},
                  "required": ["command"]}

    async def __call__(self, sandbox: Sandbox, *, command: str) -> str:
        return format_result(await sandbox.run(command))


@register_tool("python")
class Python(Tool):
    name = "python"
    description = "Run a Python snippet in your working directory and return what it prints. No network access."
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "Python source."}},
                  "required": ["code"]}

    async def __call__(self, sandbox: Sandbox, *, code: str) -> str:
        return format_result(await sandbox.run([sandbox.python, "-"], stdin=code))


@register_tool("submit")
class Submit(Tool):
    name = "submit"
    description = "Submit your final answer. This ends the task."
    parameters = {"type": "object", "properties": {"answer": {"type": "string", "description": "The final answer."}},
                  "required": ["answer"]}

    def final_answer(self, arguments: Mapping[str, Any]) -> str | None:
        return str(arguments["answer"])

    async def __call__(self, sandbox: Sandbox, *, answer: str) -> str:
        return "Answer submitted."


@register_tool("str_replace_editor")
class StrReplaceEditor(Tool):
    name = "str_replace_editor"
    description = ("View, create and edit files in your working directory. `view` shows a file with line numbers "
                   "(or lists a directory), `create` writes `file_text`, `str_replace` replaces the one occurrence "
                   "of `old_str` with `new_str`, `insert` adds `new_str` after line `insert_line` (0: at the top).")
    parameters = {"type": "object", "required": ["command", "path"], "properties": {
        "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert"]},
        "path": {"type": "string", "description": "Relative to the working directory."},
        "file_text": {"type": "string"}, "old_str": {"type": "string"}, "new_str": {"type": "string"},
        "insert_line": {"type": "integer"},
        "view_range": {"type": "array", "items": {"type": "integer"}, "description": "[first, last] (-1: end)."}}}

    async def __call__(self, sandbox: Sandbox, *, command: str, path: str, **arguments: Any) -> str:
        given = {key: value for key, value in arguments.items() if value is not None}
        extra = sorted(set(given) - _EDITOR_ARGUMENTS[command])
        if extra:
            raise ToolArgumentError(f"{command} takes no {', '.join(extra)}")
        handler = {"view": self._view, "create": self._create, "str_replace": self._replace,
                   "insert": self._insert}[command]
        return await handler(sandbox, path, **given)

    async def _view(self, sandbox: Sandbox, path: str, *, view_range: list[int] | None = None) -> str:
        try:
            return "\n".join(await sandbox.list_dir(path)) or "[empty directory]"
        except NotADirectoryError:
            pass
        lines = (await sandbox.read_file(path)).splitlines()
        if view_range is not None and len(view_range) != 2:
            raise ToolArgumentError(f"view_range must be [first, last], got {view_range}")
        first, last = view_range or (1, -1)
        last = len(lines) if last == -1 else last
        if not 1 <= first <= max(last, 1):
            raise ToolArgumentError(f"view_range {view_range} is not within the file's {len(lines)} lines")
        return "\n".join(f"{n:6}\t{line}" for n, line in enumerate(lines[first - 1:last], start=first))

    async def _create(self, sandbox: Sandbox, path: str, *, file_text: str | None = None) -> str:
        if file_text is None:
            raise ToolArgumentError("create needs file_text")
        await sandbox.write_file(path, file_text)
        return f"File created: {path}"

    async def _replace(self, sandbox: Sandbox, path: str, *, old_str: str | None = None,
                       new_str: str = "") -> str:
        if not old_str:
            raise ToolArgumentError("str_replace needs a non-empty old_str")
        text = await sandbox.read_file(path)
        count = text.count(old_str)
        if count != 1:
            raise ToolArgumentError(f"old_str occurs {count} times in {path}; it must occur exactly once")
        await sandbox.write_file(path, text.replace(old_str, new_str, 1))
        return f"Edited {path}: replaced 1 occurrence."

    async def _insert(self, sandbox: Sandbox, path: str, *, insert_line: int | None = None,
                      new_str: str | None = None) -> str:
        if insert_line is None or new_str is None:
            raise ToolArgumentError("insert needs insert_line and new_str")
        lines = (await sandbox.read_file(path)).splitlines(keepends=True)
        if not 0 <= insert_line <= len(lines):
            raise ToolArgumentError(f"insert_line {insert_line} is not within 0..{len(lines)}")
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        lines.insert(insert_line, new_str if new_str.endswith("\n") else new_str + "\n")
        await sandbox.write_file(path, "".join(lines))
        return f"Edited {path}: inserted after line {insert_line}."
