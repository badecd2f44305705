"""The built-in agent runner: ``run_task`` over Task / Agent / Tool / Sandbox registries.

Use it as an agent runner (``runner_fqn: agent_framework.builtin.run_task``, or
``agent_framework.builtin.RunTask`` built with ``runner_kwargs``), or call it directly::

    from agent_framework.builtin import run_task, example_rows
    from agent_framework.session import SessionHandle

    row = example_rows("arithmetic")[0]
    await run_task(session=SessionHandle.external("http://127.0.0.1:8000/v1"),
                   raw_prompt=row["raw_prompt"], sample_index=0, tools_kwargs=row["tools_kwargs"])

Modules: :mod:`~agent_framework.builtin.registry` (the four registries),
:mod:`~agent_framework.builtin.sandbox` (the protocol and the ``local`` sandbox),
:mod:`~agent_framework.builtin.tools`, :mod:`~agent_framework.builtin.agents`,
:mod:`~agent_framework.builtin.tasks`, :mod:`~agent_framework.builtin.config` (the task
config file and the row's tools_kwargs), :mod:`~agent_framework.builtin.datasets` (the
shipped examples and their Parquet layout), :mod:`~agent_framework.builtin.runner`.
"""

from agent_framework.builtin import agents, sandbox, tasks, tools
from agent_framework.builtin.agents import AGENTS, Agent, AnthropicReAct, Episode, OpenAIReAct, register_agent
from agent_framework.builtin.config import AgentConfig, TaskSpec, load_task_file, resolve_spec
from agent_framework.builtin.datasets import example_rows, write_examples, write_parquet
from agent_framework.builtin.registry import Registry
from agent_framework.builtin.runner import RunTask, run_task
from agent_framework.builtin.sandbox import (
    SANDBOXES,
    ExecResult,
    LocalSandbox,
    Sandbox,
    SandboxConfig,
    register_sandbox,
)
from agent_framework.builtin.tasks import Score, Task
from agent_framework.builtin.tasks.base import TASKS, register_task
from agent_framework.builtin.tools import TOOLS, Tool, ToolOutcome, call_tool, register_tool
from schemas.errors import RewardPostError, SandboxError, SandboxPathError, SandboxUnavailable, TaskConfigError

__all__ = [
    "AGENTS", "SANDBOXES", "TASKS", "TOOLS", "Agent", "AgentConfig", "AnthropicReAct", "Episode", "ExecResult",
    "LocalSandbox", "OpenAIReAct", "Registry", "RewardPostError", "RunTask", "Sandbox", "SandboxConfig",
    "SandboxError", "SandboxPathError", "SandboxUnavailable", "Score", "Task", "TaskConfigError", "TaskSpec", "Tool",
    "ToolOutcome", "agents", "call_tool", "example_rows", "load_task_file", "register_agent", "register_sandbox",
    "register_task", "register_tool", "resolve_spec", "run_task", "sandbox", "tasks", "tools", "write_examples",
    "write_parquet",
]
