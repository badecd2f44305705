"""Reading the sinks back into one comparable shape: key -> {field: plain Python value}."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import transfer_queue as tq

from materializer.dataset import read_dataset
from materializer.tq_fields import FLOAT_SEQUENCES, INT_SEQUENCES

TOKEN_FIELDS = (*INT_SEQUENCES, *FLOAT_SEQUENCES)
COMMON = (*TOKEN_FIELDS, "num_turns", "uid", "session_id", "agent_name", "reward_extra_info")


def _plain(value: Any) -> Any:
    if hasattr(value, "is_nested") and value.is_nested:
        return value.unbind()[0].tolist()
    if hasattr(value, "tolist"):
        return value.tolist()[0]
    return next(iter(value))


def tq_partition(partition: str) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(trajectories, prompt tags) of a partition; each trajectory read alone, with every field it has."""
    listing = tq.kv_list(partition_id=partition).get(partition, {})
    prompts = {k: t for k, t in listing.items() if t.get("is_prompt")}
    rows: dict[str, dict[str, Any]] = {}
    for key, tag in listing.items():
        if tag.get("is_prompt"):
            continue
        data = tq.kv_batch_get(keys=[key], partition_id=partition)
        rows[key] = {name: _plain(data[name]) for name in data.keys()}  # noqa: SIM118 - a TensorDict iterates rows
        rows[key]["__tags__"] = dict(tag)
    return rows, prompts


def parquet_rows(directory: Path) -> list[dict[str, Any]]:
    rows = read_dataset(directory).to_pylist()
    for row in rows:
        row["reward_extra_info"] = json.loads(row["reward_extra_info"])
    return rows


def common_view(row: dict[str, Any]) -> dict[str, Any]:
    """The fields both sinks hold, as plain values (absent log probs as None)."""
    return {name: row.get(name) for name in COMMON}


def group_by_prompt(keys: list[str]) -> dict[str, list[str]]:
    """verl's grouping: the part of a key before the first ``_`` is its prompt."""
    groups: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        groups[key.split("_")[0]].append(key)
    return groups
