"""What one episode runs with: a :class:`TaskSpec`, from a task config file and the dataset row.

The config file (YAML or JSON, the runner's ``task_config_path`` or ``tool_config_path``)::

    defaults:                 # every task
      sandbox: {cpu_s: 10, memory_mb: 1024, wall_s: 30}
    tasks:
      arithmetic:
        agent: {name: openai, max_turns: 6, max_tokens: 512}
        tools: [python, submit]
      python_function:
        agent: anthropic      # a name alone is {name: anthropic}
        sandbox: {memory_mb: 512}

A row's ``tools_kwargs`` names the task and carries its data, e.g.
``{"task": "arithmetic", "answer": 42}`` or ``{"task": {"name": "python_function",
"tests": [...]}}``. Merged, later winning, mappings merged key by key: ``defaults``, then
``tasks.<name>``, then the row's other keys, then its ``task`` mapping.

Of the merged mapping, ``name``, ``agent`` (:class:`AgentConfig`), ``sandbox``
(:class:`~agent_framework.builtin.sandbox.SandboxConfig`), ``tools`` (names; null: the
task's own), ``system_prompt`` (null: the task's own; "": none) and the shortcuts
``max_turns`` / ``max_tokens`` (into ``agent``) configure the episode; every other key is
the task's ``data`` (its answer, its hidden tests, ...). A value of the wrong type or an
unknown agent/sandbox field is a :class:`TaskConfigError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from agent_framework.builtin.sandbox import SandboxConfig
from schemas.errors import TaskConfigError

CONFIG_KEYS = frozenset({"name", "agent", "sandbox", "tools", "system_prompt", "max_turns", "max_tokens"})
AGENT_SHORTCUTS = ("max_turns", "max_tokens")


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str = "openai"
    model: str = "rollbus"  # what the agent asks for; the edge serves its one model whatever the name
    max_turns: int = 10  # model calls per episode
    max_tokens: int = 1024  # per model call
    temperature: float | None = None  # None: the server's default
    timeout_s: float = 600.0  # per model call
    max_retries: int = 2  # the SDK's own retries (the edge adopts a retried request)


class TaskSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    agent: AgentConfig = AgentConfig()
    sandbox: SandboxConfig = SandboxConfig()
    tools: tuple[str, ...] | None = None
    system_prompt: str | None = None
    data: dict[str, Any] = {}


class TaskFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    defaults: dict[str, Any] = {}
    tasks: dict[str, dict[str, Any]] = {}


def plain(value: Any) -> Any:
    """An omegaconf ``DictConfig``/``ListConfig`` (as verl hands configs around) as plain containers."""
    try:
        from omegaconf import Container, OmegaConf
    except ImportError:  # no omegaconf: nothing can be one
        return value
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, Container) else value


def load_task_file(path: str | Path | None) -> TaskFile:
    """The config file at ``path`` (``.json``, else YAML); an empty one when ``path`` is None."""
    if path is None:
        return TaskFile()
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as exc:
        raise TaskConfigError(f"cannot read the task config {source}: {exc}") from exc
    raw = json.loads(text) if source.suffix == ".json" else _yaml(text, source)
    try:
        return msgspec.convert(raw or {}, TaskFile)
    except msgspec.ValidationError as exc:
        raise TaskConfigError(f"task config {source}: {exc} (expected top-level 'defaults' and 'tasks')") from exc


def _yaml(text: str, source: Path) -> Any:
    import yaml  # only for YAML configs

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TaskConfigError(f"task config {source} is not valid YAML: {exc}") from exc


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win; mappings under the same key are merged recursively."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            old = merged.get(key)
            both = isinstance(old, Mapping) and isinstance(value, Mapping)
            merged[key] = merge(old, value) if both else value
    return merged


def decode_tools_kwargs(tools_kwargs: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """A row's tools_kwargs: a mapping, a JSON object string (as Parquet stores it), or None."""
    value = plain(tools_kwargs)
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise TaskConfigError(f"tools_kwargs is not valid JSON: {exc}") from exc
    if not isinstance(value, Mapping):
        raise TaskConfigError(f"tools_kwargs must be a mapping, got {type(value).__name__}")
    return dict(value)


def resolve_spec(tools_kwargs: str | Mapping[str, Any] | None, config: TaskFile,
                 default_task: str | Mapping[str, Any] | None = None) -> TaskSpec:
    row = decode_tools_kwargs(tools_kwargs)
    task = row.pop("task", default_task)
    row_task = {"name": task} if isinstance(task, str) else dict(task) if isinstance(task, Mapping) else None
    if row_task is None or not isinstance(row_task.get("name"), str):
        raise TaskConfigError(f"tools_kwargs must name the task ('task': NAME or {{'name': NAME, ...}}), "
                              f"got task={task!r}")
    name = row_task["name"]
    merged = merge(config.defaults, config.tasks.get(name, {}), row, row_task)
    return spec_from(merged)


def spec_from(merged: Mapping[str, Any]) -> TaskSpec:
    agent = merged.get("agent") or {}
    agent = {"name": agent} if isinstance(agent, str) else dict(agent)
    agent.update({key: merged[key] for key in AGENT_SHORTCUTS if key in merged})
    fields = {key: merged[key] for key in ("name", "sandbox", "tools", "system_prompt") if key in merged}
    data = {key: value for key, value in merged.items() if key not in CONFIG_KEYS}
    try:
        return msgspec.convert({**fields, "agent": agent, "data": data}, TaskSpec)
    except msgspec.ValidationError as exc:
        raise TaskConfigError(f"task {merged.get('name')!r}: {exc}") from exc
