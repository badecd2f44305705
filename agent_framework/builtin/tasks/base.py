"""The :class:`Task` contract: a task builds the episode's messages and scores its outcome.

A task is built from its :class:`~agent_framework.builtin.config.TaskSpec` (and refuses
data it cannot use, raising :class:`~schemas.errors.TaskConfigError`),
names its default tools, may prepare the sandbox, and scores the finished
:class:`~agent_framework.builtin.agents.Episode` into a :class:`Score` whose ``extra``
travels with the reward as reward extra info (numbers only, as verl aggregates them).

A task also knows its shipped example dataset (``dataset``, a JSONL file under
``agent_framework/builtin/data/``) and how one of its records becomes a dataset row
(:meth:`Task.example`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import msgspec

from agent_framework.builtin.agents import Episode
from agent_framework.builtin.config import TaskSpec
from agent_framework.builtin.registry import Registry
from agent_framework.builtin.sandbox import Sandbox
from schemas.errors import TaskConfigError

Message = dict[str, Any]
D = TypeVar("D", bound=msgspec.Struct)

SYSTEM_PROMPT = ("You solve the task below in a sandbox: a working directory of your own, without network access. "
                 "Use the tools you are given. When you are done, call `submit` with your final answer.")


class Score(msgspec.Struct, frozen=True, kw_only=True):
    reward: float
    extra: dict[str, float | int] = {}


class Task(ABC):
    default_tools: ClassVar[tuple[str, ...]] = ("shell", "python", "str_replace_editor", "submit")
    system_prompt: ClassVar[str] = SYSTEM_PROMPT
    dataset: ClassVar[str] = ""  # the shipped example file under data/, "" for none

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec

    @property
    def tools(self) -> tuple[str, ...]:
        return self.spec.tools if self.spec.tools is not None else self.default_tools

    @abstractmethod
    def prompt(self) -> str:
        """The user message when the dataset row brings no prompt."""

    @classmethod
    @abstractmethod
    def example(cls, record: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
        """A shipped record as (the user's prompt, the row's tools_kwargs)."""

    def messages(self, raw_prompt: Sequence[Message]) -> list[Message]:
        """The row's prompt (or :meth:`prompt`), with the system prompt first unless it has one."""
        messages = [dict(m) for m in raw_prompt] or [{"role": "user", "content": self.prompt()}]
        system = self.system_prompt if self.spec.system_prompt is None else self.spec.system_prompt
        if system and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": system})
        return messages

    async def setup(self, sandbox: Sandbox) -> None:  # noqa: B027 (a hook: most tasks need nothing)
        """Prepare the sandbox before the agent starts (nothing, unless a task needs files)."""

    @abstractmethod
    async def score(self, sandbox: Sandbox, episode: Episode) -> Score:
        """The episode's reward, computed after the agent stopped (in the sandbox when code must run)."""



TASKS: Registry[type[Task]] = Registry("task")
register_task = TASKS.register

def task_data(spec: TaskSpec, kind: type[D]) -> D:
    """The spec's data as the task's own struct; a missing or mistyped field is a TaskConfigError."""
    try:
        return msgspec.convert(spec.data, kind)
    except msgspec.ValidationError as exc:
        raise TaskConfigError(f"task {spec.name!r}: {exc}") from exc
