"""``run_task``: one dataset row, one episode: task, sandbox, agent, score, reward.

::

    await run_task(session=handle, raw_prompt=[...], sample_index=0,
                   tools_kwargs={"task": "arithmetic", "answer": 42},
                   task_config_path="tasks.yaml")
    # {"task": "arithmetic", "reward": 1.0, "finished": True, "turns": 2, "answer": "42", ...}

The row's ``tools_kwargs`` names the task and carries its data, merged over the task
config file (see :mod:`agent_framework.builtin.config`). The runner builds the task, its
tools and its agent by name from the registries, opens the sandbox, lets the agent run
against the session, scores the episode and, when the session has a ``reward_url``, posts
``{"reward_info": {"reward": r, "finished": bool, **extra}}`` to it with the session key.
An external session (``SessionHandle.external(url)``, the evaluation path) has none: the
reward is only returned.

What a broken task or config raises propagates (the framework aborts that session and
records why), and so does a refused reward post (:class:`RewardPostError`); a failing tool
call does not: the model reads the error as its observation.

:class:`RunTask` is the class form for ``runner_fqn: agent_framework.builtin.RunTask``: it
is built with the runner's ``runner_kwargs`` (``task_config_path``, ``default_task``,
``plugins``) and its ``tool_config_path``, and called like ``run_task``.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from agent_framework.builtin.agents import AGENTS, Episode
from agent_framework.builtin.config import TaskFile, TaskSpec, load_task_file, plain, resolve_spec
from agent_framework.builtin.sandbox import SANDBOXES
from agent_framework.builtin.tasks.base import TASKS, Message, Score, Task
from agent_framework.builtin.tools import build_tools
from agent_framework.session import SessionHandle
from schemas.errors import RewardPostError, TaskConfigError

log = logging.getLogger(__name__)


def normalize_prompt(raw_prompt: Any) -> list[Message]:
    """``raw_prompt`` as a list of ``{"role", "content"}`` dicts (from a list, an array, or JSON text)."""
    value = plain(raw_prompt)
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise TaskConfigError(f"raw_prompt is not a JSON list of messages: {exc}") from exc
    messages = [plain(m) for m in value]
    bad = [m for m in messages if not isinstance(m, Mapping) or "role" not in m or "content" not in m]
    if bad:
        raise TaskConfigError(f"raw_prompt messages need a role and a content, got {bad[0]!r}")
    return [{"role": str(m["role"]), "content": m["content"]} for m in messages]


async def post_reward(session: SessionHandle, reward_info: Mapping[str, Any], *, timeout_s: float = 30.0) -> None:
    headers = {"Authorization": f"Bearer {session.api_key}"}
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        try:
            response = await client.post(session.reward_url, json={"reward_info": dict(reward_info)}, headers=headers)
        except httpx.HTTPError as exc:
            raise RewardPostError(f"posting the reward to {session.reward_url} failed: {exc!r}") from exc
    if not response.is_success:
        raise RewardPostError(f"posting the reward to {session.reward_url} answered {response.status_code}: "
                              f"{response.text[:500]}")


async def play(spec: TaskSpec, session: SessionHandle, raw_prompt: Sequence[Message]) -> tuple[Episode, Score]:
    """Run one episode of ``spec`` against ``session`` and score it (the sandbox closed either way)."""
    task: Task = TASKS.get(spec.name)(spec)
    tools = build_tools(task.tools)
    agent = AGENTS.get(spec.agent.name)(spec.agent)
    messages = task.messages(raw_prompt)
    sandbox = await SANDBOXES.get(spec.sandbox.name)(spec.sandbox)
    try:
        await task.setup(sandbox)
        episode = await agent.run(session, messages, tools, sandbox)
        return episode, await task.score(sandbox, episode)
    finally:
        await sandbox.close()


def import_plugins(plugins: Sequence[str]) -> None:
    """Import modules that register tasks, agents, tools or sandboxes of their own."""
    for module in plugins:
        importlib.import_module(module)


async def run_task(*, session: SessionHandle, raw_prompt: Any, sample_index: int = 0,
                   tools_kwargs: str | Mapping[str, Any] | None = None, task_config_path: str | None = None,
                   tool_config_path: str | None = None, default_task: str | Mapping[str, Any] | None = None,
                   plugins: Sequence[str] = (), **kwargs: Any) -> dict[str, Any]:
    """Play the row's task against ``session``; post the reward when the session takes one; return a summary.

    The task config file is ``task_config_path`` (else ``tool_config_path``, as the framework
    passes a runner's); ``default_task`` (a name or a config mapping) serves rows whose
    tools_kwargs name no task; ``plugins`` are modules to import first (they register their
    own tasks, agents, tools, sandboxes). Other keywords (the row's other columns, as the
    framework passes them) are ignored.
    """
    import_plugins(plugins)
    config = load_task_file(task_config_path or tool_config_path)
    return await run_row(session=session, raw_prompt=raw_prompt, sample_index=sample_index,
                         tools_kwargs=tools_kwargs, config=config, default_task=default_task)


async def run_row(*, session: SessionHandle, raw_prompt: Any, sample_index: int,
                  tools_kwargs: str | Mapping[str, Any] | None, config: TaskFile,
                  default_task: str | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``run_task`` with the task config file already loaded."""
    spec = resolve_spec(tools_kwargs, config, default_task=plain(default_task))
    episode, score = await play(spec, session, normalize_prompt(raw_prompt))
    reward_info = {"reward": score.reward, "finished": episode.finished, **score.extra}
    if session.reward_url:
        await post_reward(session, reward_info)
    log.info("session %s sample %s task %s: reward %s, %s after %d turns", session.session_id, sample_index,
             spec.name, score.reward, episode.stop, episode.turns)
    return {"task": spec.name, "reward": score.reward, "finished": episode.finished, "turns": episode.turns,
            "answer": episode.answer, "stop": episode.stop, "tool_calls": episode.tool_calls,
            "reward_info": reward_info, "posted": bool(session.reward_url)}


class RunTask:
    """``run_task`` with its ``runner_kwargs`` bound; the task config file is read once, here.

    The framework builds it with ``runner_kwargs`` plus the runner's ``tool_config_path``.
    """

    def __init__(self, *, task_config_path: str | None = None, tool_config_path: str | None = None,
                 default_task: str | Mapping[str, Any] | None = None, plugins: Sequence[str] = ()) -> None:
        import_plugins(plugins)
        self.task_config_path = task_config_path or tool_config_path
        self.default_task = plain(default_task)
        self.config = load_task_file(self.task_config_path)

    async def __call__(self, *, session: SessionHandle, raw_prompt: Any, sample_index: int = 0,
                       tools_kwargs: str | Mapping[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        return await run_row(session=session, raw_prompt=raw_prompt, sample_index=sample_index,
                             tools_kwargs=tools_kwargs, config=self.config, default_task=self.default_task)
