"""verl's rollout batch as plain per-prompt values: pure, no I/O.

verl hands ``generate_sequences`` a ``TensorDict`` with one row per prompt: ``uid``
(``str(uuid4())``), ``raw_prompt`` (chat messages), ``tools_kwargs``, ``index``, optional
``agent_name``, ``__do_sample__`` (false: greedy) and ``__rollout_n__`` (this prompt's n),
the task fields verl's reward code reads (``data_source``, ``reward_model``,
``extra_info``), and batch-wide ``global_steps`` and ``validate`` (``NonTensorData``).
Everything is converted to JSON-safe Python values (numpy arrays and scalars, tensors), since
it travels in the session's opening event. Per-row token tensors (``input_ids``,
``attention_mask``, ``position_ids`` of verl's tokenized prompt: a tensor with more than one
dimension) are left out: the edge renders the prompt from ``raw_prompt`` itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np

from schemas.errors import BatchError

TASK_FIELDS = ("data_source", "reward_model", "extra_info")
_CONTROL = ("uid", "raw_prompt", "tools_kwargs", "index", "agent_name", "__do_sample__", "__rollout_n__",
            "global_steps", "validate")


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    uid: str
    raw_prompt: list[dict[str, Any]]
    tools_kwargs: dict[str, Any] = {}
    index: int | None = None
    agent_name: str | None = None
    do_sample: bool = True
    rollout_n: int | None = None  # None: the config's n (val_kwargs.n when validating)
    global_steps: int = 0
    validate: bool = False
    task: dict[str, Any] = {}  # data_source, reward_model, extra_info, and any other column

    @property
    def partition(self) -> str:
        return "val" if self.validate else "train"


def plain(value: Any) -> Any:
    """``value`` with numpy and torch containers and scalars turned into Python ones."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "tolist") and callable(value.tolist):  # torch tensors, NonTensorStack
        return plain(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def _columns(batch: Any) -> tuple[int, dict[str, list[Any]], dict[str, Any]]:
    """(rows, per-row columns, batch-wide values) of a TensorDict or a mapping of lists."""
    import torch
    from tensordict import NonTensorData

    rows = int(batch.batch_size[0]) if hasattr(batch, "batch_size") else len(batch["uid"])
    per_row: dict[str, list[Any]] = {}
    shared: dict[str, Any] = {}
    for key in batch.keys():  # noqa: SIM118 - a TensorDict is not a plain mapping
        value = batch.get(key) if hasattr(batch, "get") else batch[key]
        if isinstance(value, torch.Tensor) and (value.is_nested or value.dim() > 1):
            continue  # a tokenized sequence per row: not the agent's business
        if isinstance(value, NonTensorData):
            shared[key] = plain(value.data)
        else:
            column = plain(value)
            if not isinstance(column, list) or len(column) != rows:
                shared[key] = column
            else:
                per_row[key] = column
    return rows, per_row, shared


def prompts_of(batch: Any) -> list[Prompt]:
    """One :class:`Prompt` per row; raises :class:`BatchError` naming the first bad field."""
    rows, per_row, shared = _columns(batch)
    if "uid" not in per_row:
        raise BatchError("the batch has no per-row 'uid' field")
    validate = bool(shared.get("validate", False))
    global_steps = shared.get("global_steps", 0)
    return [_prompt(i, {k: v[i] for k, v in per_row.items()}, validate, global_steps) for i in range(rows)]


def _int(value: Any, field: str, row: int, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BatchError(f"row {row}: {field} must be an integer >= {minimum}, got {value!r}")
    return value


def _prompt(row: int, values: dict[str, Any], validate: bool, global_steps: Any) -> Prompt:
    uid = values["uid"]
    if not isinstance(uid, str) or not uid or "_" in uid or len(uid) > 128:
        raise BatchError(f"row {row}: uid must be 1-128 characters without '_', got {uid!r}")
    raw_prompt = values.get("raw_prompt")
    if not isinstance(raw_prompt, list) or not all(isinstance(m, dict) for m in raw_prompt):
        raise BatchError(f"row {row} ({uid}): raw_prompt must be a list of chat messages, got {raw_prompt!r:.200}")
    tools_kwargs = values.get("tools_kwargs") or {}
    if not isinstance(tools_kwargs, dict):
        raise BatchError(f"row {row} ({uid}): tools_kwargs must be a mapping, got {tools_kwargs!r:.200}")
    steps = values.get("global_steps", global_steps)
    n = values.get("__rollout_n__")
    agent_name = values.get("agent_name")
    return Prompt(
        uid=uid, raw_prompt=raw_prompt, tools_kwargs=tools_kwargs,
        index=None if values.get("index") is None else _int(values["index"], "index", row),
        agent_name=agent_name if isinstance(agent_name, str) and agent_name else None,
        do_sample=bool(values.get("__do_sample__", True)),
        rollout_n=None if n is None else _int(n, "__rollout_n__", row, minimum=1),
        global_steps=_int(steps if steps is not None else 0, "global_steps", row),
        validate=validate,
        task={k: v for k, v in values.items() if k not in _CONTROL},
    )
