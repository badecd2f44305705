"""Agent runners: loaded from their configuration, run inline, on a worker, or as a Ray task.

A runner is ``async __call__(*, session, raw_prompt, sample_index, tools_kwargs=None, **kwargs)``.
``runner_fqn`` names a class (built once per process with ``runner_kwargs``) or a function
(called with ``runner_kwargs`` as keywords, like ``functools.partial``); a configured
``tool_config_path`` is passed as a keyword too.

Dispatch modes:

- ``inline_async``: awaited on the adapter's loop, or, with ``num_workers``, on the
  least busy :class:`~agent_framework.actors.RunnerWorker`;
- ``ray_task``: each session's runner is one Ray task (``max_retries=0``: a session is never
  run twice; a task that dies is that session's failure).

``max_concurrent_sessions`` bounds the runner's sessions in flight (0: unlimited), from
the session's opening to its end (:meth:`Dispatcher.slot`), so a big batch never holds
sessions open that no runner drives; :class:`Dispatcher` records the peak it saw per runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from agent_framework.config import RunnerConfig
from schemas.errors import RunnerLoadError

Runner = Callable[..., Awaitable[Any]]


def load_runner(config: RunnerConfig) -> Runner:
    module_name, _, attr = config.runner_fqn.rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise RunnerLoadError(f"agent runner {config.name}: cannot load {config.runner_fqn}: {exc}") from exc
    kwargs = dict(config.runner_kwargs)
    if config.tool_config_path is not None:
        kwargs.setdefault("tool_config_path", config.tool_config_path)
    if isinstance(target, type):
        try:
            return target(**kwargs)  # type: ignore[no-any-return]
        except TypeError as exc:
            raise RunnerLoadError(f"agent runner {config.name}: {config.runner_fqn}(**runner_kwargs): {exc}") from exc
    if not callable(target):
        raise RunnerLoadError(f"agent runner {config.name}: {config.runner_fqn} is not callable")
    return functools.partial(target, **kwargs)


async def call_runner(config: RunnerConfig, call: dict[str, Any], cache: dict[str, Runner]) -> Any:
    """Run one session's runner in this process, loading it once per configuration."""
    runner = cache.get(config.name)
    if runner is None:
        runner = cache[config.name] = load_runner(config)
    return await runner(**call)


def _run_in_task(config: RunnerConfig, call: dict[str, Any]) -> Any:
    """The body of a ``ray_task`` dispatch: a fresh loop in a Ray worker process."""
    return asyncio.run(call_runner(config, call, {}))


class Dispatcher:
    def __init__(self, runners: dict[str, RunnerConfig], *, workers: list[Any] | None = None,
                 task_num_cpus: float = 0.0) -> None:
        self._limits = {name: asyncio.Semaphore(r.max_concurrent_sessions) for name, r in runners.items()
                        if r.max_concurrent_sessions > 0}
        self._workers = list(workers or [])
        self._worker_load = [0] * len(self._workers)
        self._local: dict[str, Runner] = {}
        self._task_num_cpus = task_num_cpus
        self._remote_task: Any = None
        self.active: dict[str, int] = dict.fromkeys(runners, 0)
        self.peak: dict[str, int] = dict.fromkeys(runners, 0)

    def check(self, runners: dict[str, RunnerConfig]) -> None:
        """Load every inline runner once now, so a bad ``runner_fqn`` fails at ``create``."""
        for config in runners.values():
            self._local[config.name] = load_runner(config)

    @contextlib.asynccontextmanager
    async def slot(self, config: RunnerConfig) -> AsyncIterator[None]:
        """One of the runner's ``max_concurrent_sessions``, held for a whole session."""
        limit = self._limits.get(config.name)
        async with limit if limit is not None else contextlib.nullcontext():
            self.active[config.name] += 1
            self.peak[config.name] = max(self.peak[config.name], self.active[config.name])
            try:
                yield
            finally:
                self.active[config.name] -= 1

    async def run(self, config: RunnerConfig, call: dict[str, Any]) -> Any:
        """Run one session's runner where its dispatch mode says (inside the session's :meth:`slot`)."""
        if config.dispatch_mode == "ray_task":
            return await self._ray_task(config, call)
        if self._workers:
            return await self._on_worker(config, call)
        return await call_runner(config, call, self._local)

    async def _on_worker(self, config: RunnerConfig, call: dict[str, Any]) -> Any:
        index = min(range(len(self._workers)), key=self._worker_load.__getitem__)
        self._worker_load[index] += 1  # reserved before awaiting
        try:
            return await self._workers[index].run.remote(config, call)
        finally:
            self._worker_load[index] -= 1

    async def _ray_task(self, config: RunnerConfig, call: dict[str, Any]) -> Any:
        import ray

        if self._remote_task is None:
            self._remote_task = ray.remote(max_retries=0, retry_exceptions=False,
                                           num_cpus=self._task_num_cpus)(_run_in_task)
        ref = self._remote_task.remote(config, call)
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref, force=True)
            raise
