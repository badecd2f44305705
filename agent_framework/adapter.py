"""``AgentFrameworkRolloutAdapter``: verl's agent loop manager, with rollbus in between.

verl loads the class named by ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``
and calls :meth:`~AgentFrameworkRolloutAdapter.create` once, then
:meth:`~AgentFrameworkRolloutAdapter.generate_sequences` for every batch (training,
validation, and prompts re-issued on resume). That call returns at once; the trainer reads
the results from TransferQueue only::

    verl trainer ─generate_sequences(batch)─▶ adapter (its own event loop, a thread)
        per prompt: tag {uid} running; open n sessions on the edge pool (Ray actors)
        per session: run the agent runner against the session URLs; finalize, or abort with the reason
    edges ──events──▶ JetStream ──▶ projector ──▶ materializer (a Ray actor) ──▶ TransferQueue + Parquet
        the materializer writes {uid}_{session_index}_{trajectory_index} and then the prompt's
        terminal status, decided from the log alone (each session's opening event carries the
        prompt's n, its dispatch attempt, its partition and the status rule)

The adapter never writes a trajectory or a terminal status itself: the materializer is the
one writer of a prompt key after ``running``, so a restarted adapter or materializer reaches
the same statuses, and a re-issued prompt (a newer attempt) starts a clean group.

Failures never vanish: a runner exception aborts its session with the reason in the log
(``session_aborted``), is counted in :attr:`metrics`, and is logged with its traceback; a
batch whose every session failed is logged as an error, and raises from
:meth:`~AgentFrameworkRolloutAdapter.generate_sequences_and_wait`.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import logging
import secrets
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any, Self, TypeVar

import msgspec

from agent_framework.config import AgentFrameworkConfig, RunnerConfig, load_config
from agent_framework.dispatch import Dispatcher
from agent_framework.pool import EdgePool, Placement
from agent_framework.samples import Prompt, prompts_of
from agent_framework.session import SessionHandle
from schemas.errors import ConfigError, EdgeError, RolloutFailed
from schemas.metadata import SessionSettings

log = logging.getLogger(__name__)

T = TypeVar("T")


class SessionResult(msgspec.Struct, frozen=True, kw_only=True):
    uid: str
    session_index: int
    session_id: str = ""  # "": the session could not be opened
    succeeded: bool
    trajectories: int = 0
    error: str = ""


class BatchResult(msgspec.Struct, frozen=True, kw_only=True):
    prompts: int
    sessions: list[SessionResult]
    seconds: float

    @property
    def succeeded(self) -> int:
        return sum(s.succeeded for s in self.sessions)

    @property
    def failed(self) -> int:
        return len(self.sessions) - self.succeeded


def _reason(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)  # a RayTaskError carries the runner's own exception
    exc = cause if isinstance(cause, BaseException) else exc
    return f"runner_error: {type(exc).__name__}: {exc}"


class AgentFrameworkRolloutAdapter:
    def __init__(self, config: AgentFrameworkConfig, *, llm_client: Any = None,
                 reward_workers: Sequence[Any] | None = None) -> None:
        from agent_framework.stack import FrameworkStack

        self.config = config
        self.metrics: collections.Counter[str] = collections.Counter()
        self._stack = FrameworkStack(config, llm_client=llm_client, reward_workers=reward_workers)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollbus-adapter", daemon=True)
        self._batches: set[concurrent.futures.Future[BatchResult]] = set()
        self._pool: EdgePool | None = None
        self._dispatcher: Dispatcher | None = None
        self._closed = False

    # ------------------------------------------------------------------ verl's interface

    @classmethod
    def create(cls, config: Any, llm_client: Any = None, teacher_client: Any = None,
               reward_loop_worker_handles: Sequence[Any] | None = None, **_: Any) -> Self:
        """Build and start the adapter (blocking: edges and consumers are up when it returns)."""
        if teacher_client:
            raise ConfigError("teacher_client: rollbus does not compute teacher log probs (on-policy distillation); "
                              "run without a teacher model")
        settings = load_config(config)
        if settings.use_reward_loop_worker and not reward_loop_worker_handles:
            raise ConfigError("actor_rollout_ref.rollout.custom.agent_framework.use_reward_loop_worker is true, "
                              "but verl passed no reward_loop_worker_handles")
        adapter = cls(settings, llm_client=llm_client,
                      reward_workers=reward_loop_worker_handles if settings.use_reward_loop_worker else None)
        adapter.start()
        return adapter

    def generate_sequences(self, batch: Any) -> None:
        """Start the batch's rollouts and return at once; the records arrive in TransferQueue."""
        self.submit(batch)

    def generate_sequences_and_wait(self, batch: Any, *, timeout: float | None = None) -> BatchResult:
        """Run the batch and wait until every prompt has its terminal status in TransferQueue
        (standalone use); raises :class:`RolloutFailed` when every rollout failed."""
        result = self.submit(batch).result(timeout)
        if result.sessions and not result.succeeded:
            raise RolloutFailed(f"all {len(result.sessions)} rollouts of the batch failed; first error: "
                                f"{result.sessions[0].error}")
        self.wait_records(batch, timeout)
        return result

    def submit(self, batch: Any) -> concurrent.futures.Future[BatchResult]:
        """Start the batch's rollouts; the future holds each session's outcome once all have ended."""
        if self._closed:
            raise RuntimeError("the adapter is closed")
        prompts = prompts_of(batch)
        for prompt in prompts:  # an unknown agent_name is refused here, before anything starts
            self.config.runner_for(prompt.agent_name)
        future = asyncio.run_coroutine_threadsafe(self._run_batch(prompts), self._loop)
        self._batches.add(future)
        future.add_done_callback(self._batch_done)
        return future

    def wait_records(self, batch: Any, timeout: float | None = None) -> None:
        """Until every prompt of the batch has its terminal status in TransferQueue (or was consumed)."""
        self._call(self._stack.wait_terminal(prompts_of(batch)), timeout)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread.start()
        try:
            self._call(self._start())
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)

    async def _start(self) -> None:
        token = secrets.token_urlsafe(18)
        urls = await self._stack.start(admin_token=token)
        self._pool = EdgePool(urls, token)
        self._dispatcher = Dispatcher(self.config.agent_runners, workers=self._stack.runner_workers,
                                      task_num_cpus=self.config.actor_num_cpus)
        self._dispatcher.check({n: r for n, r in self.config.agent_runners.items()
                                if r.dispatch_mode == "inline_async" and not self._stack.runner_workers})
        log.info("rollbus agent framework: %d edges (%s), %d runner workers, runners %s", len(urls), " ".join(urls),
                 len(self._stack.runner_workers), ", ".join(sorted(self.config.agent_runners)))

    def close(self) -> None:
        """Stop the edges, consumers and embedded NATS (what is in the log stays)."""
        if self._closed:
            return
        self._closed = True
        if self._loop.is_running():
            try:
                self._call(self._stop(), 60)
            except Exception as exc:  # closing is best effort: the processes die with this one anyway
                log.warning("closing the agent framework: %r", exc)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _stop(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
        await self._stack.stop()

    @property
    def edge_urls(self) -> list[str]:
        return list(self._pool.urls) if self._pool is not None else []

    @property
    def peak_concurrency(self) -> dict[str, int]:
        return dict(self._dispatcher.peak) if self._dispatcher is not None else {}

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ rollouts

    def _batch_done(self, future: concurrent.futures.Future[BatchResult]) -> None:
        self._batches.discard(future)
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            self.metrics["batches_crashed"] += 1
            log.error("a rollout batch crashed: %r", error, exc_info=error)
            return
        result = future.result()
        level = logging.ERROR if result.sessions and not result.succeeded else logging.INFO
        if level == logging.ERROR:
            self.metrics["batches_all_failed"] += 1
        log.log(level, "batch of %d prompts: %d sessions succeeded, %d failed in %.1fs%s", result.prompts,
                result.succeeded, result.failed, result.seconds,
                "; EVERY ROLLOUT FAILED" if level == logging.ERROR else "")

    async def _run_batch(self, prompts: list[Prompt]) -> BatchResult:
        started = time.monotonic()
        self.metrics["batches"] += 1
        groups = await asyncio.gather(*(self._run_prompt(p) for p in prompts))
        return BatchResult(prompts=len(prompts), sessions=[s for g in groups for s in g],
                           seconds=time.monotonic() - started)

    async def _run_prompt(self, prompt: Prompt) -> list[SessionResult]:
        self.metrics["prompts"] += 1
        attempt = time.time_ns()  # a re-issued uid is a newer attempt: the materializer starts its group afresh
        n = prompt.rollout_n or (self.config.val.n if prompt.validate else self.config.train.n)
        await self._stack.start_attempt(prompt, attempt=attempt, n=n)
        return list(await asyncio.gather(*(self._run_session(prompt, i, n, attempt) for i in range(n))))

    def _started(self) -> tuple[EdgePool, Dispatcher]:
        if self._pool is None or self._dispatcher is None:
            raise RuntimeError("the rollbus agent loop is not started: call start() first")
        return self._pool, self._dispatcher

    async def _run_session(self, prompt: Prompt, index: int, n: int, attempt: int) -> SessionResult:
        pool, dispatcher = self._started()
        runner = self.config.runner_for(prompt.agent_name)
        async with dispatcher.slot(runner):
            placement = pool.reserve()
            try:
                try:
                    session = await pool.open(placement, self._open_spec(prompt, index, n, attempt, runner))
                except EdgeError as exc:
                    return self._failed(prompt, index, "", f"open_failed: {exc}", exc)
                self.metrics["sessions_opened"] += 1
                return await self._drive(prompt, index, session, placement, runner)
            finally:
                placement.release()
                self.metrics["sessions_ended"] += 1

    async def _drive(self, prompt: Prompt, index: int, session: SessionHandle, placement: Placement,
                     runner: RunnerConfig) -> SessionResult:
        call = {"session": session, "raw_prompt": prompt.raw_prompt, "sample_index": index,
                "tools_kwargs": prompt.tools_kwargs, "uid": prompt.uid, "index": prompt.index,
                "global_steps": prompt.global_steps, "validate": prompt.validate, **prompt.task}
        pool, dispatcher = self._started()
        try:
            await asyncio.wait_for(dispatcher.run(runner, call), self.config.session_timeout)
        except Exception as exc:
            reason = ("runner_timeout: no result within "
                      f"{self.config.session_timeout:g}s") if isinstance(exc, TimeoutError) else _reason(exc)
            try:
                await pool.abort(placement, session.session_id, reason)
            except EdgeError as abort_error:
                log.error("session %s: abort failed (%s); the edge's idle sweep will end it", session.session_id,
                          abort_error)
            result = self._failed(prompt, index, session.session_id, reason, exc)
        else:
            try:
                summary = await pool.finalize(placement, session.session_id)
            except EdgeError as exc:
                return self._failed(prompt, index, session.session_id, f"finalize_failed: {exc}", exc)
            trajectories = int(summary.get("trajectories", 0))
            self.metrics["sessions_succeeded" if trajectories else "sessions_without_trajectories"] += 1
            result = SessionResult(uid=prompt.uid, session_index=index, session_id=session.session_id,
                                   succeeded=trajectories > 0, trajectories=trajectories,
                                   error="" if trajectories else "finalized without a trajectory")
        if self.config.log_dir:
            await self._stack.export(session.session_id, prompt.global_steps)
        return result

    def _failed(self, prompt: Prompt, index: int, session_id: str, reason: str, exc: BaseException) -> SessionResult:
        self.metrics["sessions_failed"] += 1
        self.metrics[f"sessions_failed:{reason.split(':', 1)[0]}"] += 1
        log.error("prompt %s session %d (%s) failed: %s", prompt.uid, index, session_id or "not opened", reason,
                  exc_info=exc)
        return SessionResult(uid=prompt.uid, session_index=index, session_id=session_id, succeeded=False,
                             error=reason)

    def _open_spec(self, prompt: Prompt, index: int, n: int, attempt: int, runner: RunnerConfig) -> dict[str, Any]:
        config = self.config
        settings = SessionSettings(
            rollout_n=n, attempt=attempt, global_steps=prompt.global_steps, tq_partition=prompt.partition,
            prompt_status_rule=config.prompt_status_rule, trajectory_selection=runner.trajectory_selection,
            mask_unfinished_episode=config.mask_unfinished_episode)
        metadata: dict[str, Any] = {
            **prompt.task, "raw_prompt": prompt.raw_prompt, "tools_kwargs": prompt.tools_kwargs,
            "agent_name": runner.name, **settings.to_metadata(),
        }
        if prompt.index is not None:
            metadata["index"] = prompt.index
        return {"uid": prompt.uid, "session_index": index, "metadata": metadata, "sampling": self._sampling(prompt)}

    def _sampling(self, prompt: Prompt) -> dict[str, Any]:
        source = self.config.val if prompt.validate else self.config.train
        greedy = (prompt.validate and not source.do_sample) or (not prompt.validate and not prompt.do_sample)
        sampling: dict[str, Any] = {"max_tokens": self.config.response_length}
        if greedy:
            sampling.update(temperature=0.0, top_p=1.0)
        else:
            sampling.update(temperature=source.temperature, top_p=source.top_p)
            if source.top_k > 0:
                sampling["top_k"] = source.top_k
        return sampling

