"""Reward scorers: the second source in the precedence, for sessions whose task posted no reward.

A scorer is anything with ``async def score(request) -> ScoreResult``. It is given the
session's *final* trajectory (its last chain, as verl's agent loop scores the last
output) and the task metadata the session was opened with, and its result is broadcast
to every trajectory of the session.

verl's reward loop sits behind :class:`RewardLoopScorer`: a pool of Ray actor handles
whose ``compute_score.remote(data)`` answers ``{"reward_score": float,
"reward_extra_info": {...}}`` (the contract of verl's ``RewardLoopWorker``), with
``build_input`` turning a :class:`ScoreRequest` into what the worker takes (a one-row
``DataProto`` for verl). ``--reward-scorer module:attr`` names a scorer (or a
zero-argument factory of one) on the command line.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from schemas.errors import ScorerError
from schemas.events import RewardInfo
from schemas.records import TrajectoryRecord


class ScoreRequest(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    uid: str
    session_index: int
    agent_name: str
    metadata: dict[str, Any]  # the task metadata the session was opened with (data_source, reward_model, ...)
    reward_info: RewardInfo  # what the task posted (its reward None: else no scorer is asked)
    trajectory: TrajectoryRecord  # the session's final trajectory, its reward still 0


class ScoreResult(msgspec.Struct, frozen=True, kw_only=True):
    reward: float
    extra: dict[str, Any] = {}


@runtime_checkable
class RewardScorer(Protocol):
    async def score(self, request: ScoreRequest) -> ScoreResult: ...


class FunctionScorer:
    """A scorer from a plain (sync or async) function ``f(request) -> float | ScoreResult``."""

    def __init__(self, fn: Callable[[ScoreRequest], float | ScoreResult | Awaitable[float | ScoreResult]]) -> None:
        self._fn = fn

    async def score(self, request: ScoreRequest) -> ScoreResult:
        result = self._fn(request)
        if asyncio.iscoroutine(result) or isinstance(result, Awaitable):
            result = await result
        if isinstance(result, ScoreResult):
            return result
        if isinstance(result, bool) or not isinstance(result, (int, float)):
            raise ScorerError(f"scorer returned {type(result).__name__}, expected a number or ScoreResult")
        return ScoreResult(reward=float(result))


class _RemoteMethod(Protocol):
    def remote(self, data: Any) -> Awaitable[Any]: ...


class _RewardWorker(Protocol):
    compute_score: _RemoteMethod


class RewardLoopScorer:
    """verl's reward loop behind the scorer protocol: round-robin over worker handles."""

    def __init__(self, workers: Sequence[_RewardWorker], build_input: Callable[[ScoreRequest], Any]) -> None:
        if not workers:
            raise ValueError("RewardLoopScorer needs at least one worker handle")
        self._workers = itertools.cycle(list(workers))
        self._build_input = build_input

    async def score(self, request: ScoreRequest) -> ScoreResult:
        worker = next(self._workers)
        result = await worker.compute_score.remote(self._build_input(request))
        if not isinstance(result, dict) or "reward_score" not in result:
            raise ScorerError(f"reward worker answered {result!r} for session {request.session_id}")
        extra = result.get("reward_extra_info") or {}
        return ScoreResult(reward=float(result["reward_score"]), extra=dict(extra))


def load_scorer(spec: str) -> RewardScorer:
    """``module:attr``: a scorer instance, a class or factory returning one, or a plain scoring function."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--reward-scorer wants module:attr, got {spec!r}")
    target = getattr(importlib.import_module(module_name), attr)
    if isinstance(target, type):  # a class: the protocol check would accept the class itself
        target = target()
        if isinstance(target, RewardScorer):
            return target
        raise ValueError(f"{spec} does not build a reward scorer")
    if isinstance(target, RewardScorer):
        return target
    return FunctionScorer(target)
