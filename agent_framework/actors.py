"""The adapter's Ray actors: rollbus components in processes of their own.

- :class:`StackActor` runs a :class:`stack.runtime.Stack` with some components on the
  actor's event loop (a Ray async actor): an **edge** (HTTP on its own port, calling verl's
  ``llm_client`` through :class:`edge.engines.verl.VerlEngine`), or the **consumers**
  (projector and materializer, the materializer joining the TransferQueue that verl's
  trainer initialized, scoring through verl's reward-loop workers when asked).
- :class:`RunnerWorker` runs agent runners on an event loop of its own (``num_workers``),
  so CPU-heavy tools do not stall the adapter's loop or an edge's.

Neither is decorated here: the adapter wraps them with ``ray.remote`` and its resource
options, so importing this module does not need Ray initialized.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from agent_framework.config import RunnerConfig
from agent_framework.dispatch import Runner, call_runner
from agent_framework.rewards import verl_reward_input
from stack.heap import settle_heap
from stack.runtime import Stack, StackOptions

log = logging.getLogger(__name__)


class StackActor:
    def __init__(self, options: StackOptions, llm_client: Any | None = None,
                 reward_workers: Sequence[Any] | None = None) -> None:
        self._options = options
        self._llm_client = llm_client
        self._reward_workers = list(reward_workers or [])
        self._stack: Stack | None = None

    async def start(self) -> str:
        """Start the components; returns the edge's URL ("" without an edge)."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        engine = None
        if self._llm_client is not None:
            from edge.engines.verl import VerlEngine

            engine = VerlEngine(self._llm_client)
        scorer = None
        if self._reward_workers:
            from reward.scorer import RewardLoopScorer

            scorer = RewardLoopScorer(self._reward_workers, build_input=verl_reward_input)
        self._stack = Stack(self._options, engine=engine, scorer=scorer)
        await self._stack.start()
        settle_heap()  # as `rollbus up` does: the collector never walks the startup heap again
        return self._stack.url

    async def alive(self) -> bool:
        """Whether every component still runs (a failed one stops the stack)."""
        return self._stack is not None and not self._stack.stop_event.is_set()

    async def stop(self) -> None:
        if self._stack is not None:
            await self._stack.stop()
            self._stack = None


class RunnerWorker:
    """Runs agent runners in its own process; one runner object per configuration, built once."""

    def __init__(self) -> None:
        self._cache: dict[str, Runner] = {}

    async def run(self, runner: RunnerConfig, call: dict[str, Any]) -> Any:
        return await call_runner(runner, call, self._cache)
