"""Reading a record dataset back: Arrow tables, valid tokens, and padded torch batches for a trainer.

::

    from materializer.dataset import iter_padded_batches

    for batch in iter_padded_batches("rollbus-data/trajectories", batch_size=64,
                                     prompt_length=1024, response_length=2048):
        batch["input_ids"]        # int64 [64, 3072]: prompt left-padded, response right-padded
        batch["rollout_log_probs"]  # float32 [64, 2048], when every row of the batch has them
        batch["key"]              # the 64 trajectory keys

A dataset written padded is re-padded from its valid tokens when other lengths are asked
for; the padding rule is :mod:`materializer.padding`'s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds

from materializer.padding import Jagged, Padding, check_overflow, pad
from schemas.records import PADDING_METADATA, SEQUENCE_COLUMNS, TRAJECTORY_SCHEMA

_PROMPT_SIDE = ("input_ids", "attention_mask", "position_ids")


def dataset_files(directory: Path | str) -> list[str]:
    return [str(p) for p in sorted(Path(directory).glob("part-*.parquet"))]


def read_dataset(directory: Path | str, columns: list[str] | None = None) -> pa.Table:
    """The committed files of a dataset as one table (empty when there are none)."""
    files = dataset_files(directory)
    if not files:
        return TRAJECTORY_SCHEMA.empty_table() if columns is None else TRAJECTORY_SCHEMA.empty_table().select(columns)
    return ds.dataset(files, format="parquet").to_table(columns=columns)


def session_rows(directory: Path | str, session_ids: list[str]) -> list[dict[str, Any]]:
    """The rows of some sessions (as Python values), e.g. to see whether they were materialized."""
    files = dataset_files(directory)
    if not files:
        return []
    dataset = ds.dataset(files, format="parquet")
    return dataset.to_table(filter=ds.field("session_id").isin(session_ids)).to_pylist()


def layout(table: pa.Table) -> dict[str, Any] | None:
    """The padding a table was written with (``None``: unpadded)."""
    raw = (table.schema.metadata or {}).get(PADDING_METADATA)
    return json.loads(raw) if raw else None


def _gather(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> Jagged:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    index = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
    return Jagged(values[index], offsets)


def valid_tokens(table: pa.Table, column: str) -> Jagged:
    """A sequence column's valid part per row (the whole row when the table is unpadded)."""
    array = table.column(column).combine_chunks()
    values = np.asarray(array.values.to_numpy(zero_copy_only=False))
    offsets = np.asarray(array.offsets.to_numpy(), dtype=np.int64)
    padded = layout(table)
    if padded is None:
        return Jagged(values, offsets)
    prompt_len = table.column("prompt_len").to_numpy().astype(np.int64)
    response_len = table.column("response_len").to_numpy().astype(np.int64)
    if column == "prompts":
        return _gather(values, offsets[1:] - prompt_len, prompt_len)
    if column in _PROMPT_SIDE:  # the valid tokens meet where the prompt padding ends
        return _gather(values, offsets[:-1] + padded["prompt_length"] - prompt_len, prompt_len + response_len)
    if column in SEQUENCE_COLUMNS:
        return _gather(values, offsets[:-1], response_len)
    raise ValueError(f"{column} is not a sequence column")


def padded_arrays(table: pa.Table, padding: Padding) -> dict[str, np.ndarray]:
    """The table's rows in the padded form (from their valid tokens, whatever layout they were stored in)."""
    logprobs = table.column("rollout_log_probs")
    out = pad(*(valid_tokens(table, c) for c in ("prompts", "responses", "response_mask", "loss_mask", "rm_scores")),
              valid_tokens(table, "rollout_log_probs") if logprobs.null_count < len(table) else None, padding)
    check_overflow(out["truncated"], table.column("key").to_pylist(), padding)
    if logprobs.null_count > 0:
        out["rollout_log_probs"] = None  # a batch mixing rows with and without log probs has none
    return out


def to_torch(table: pa.Table, padding: Padding) -> dict[str, Any]:
    """One padded batch: int64 tokens and masks, float32 scores, and the keys and uids as lists."""
    import torch  # readers of Arrow tables alone do not pay for torch

    arrays = padded_arrays(table, padding)
    batch: dict[str, Any] = {"key": table.column("key").to_pylist(), "uid": table.column("uid").to_pylist()}
    for name in SEQUENCE_COLUMNS:
        if arrays.get(name) is not None:
            dtype = torch.float32 if name in ("rm_scores", "rollout_log_probs") else torch.int64
            batch[name] = torch.from_numpy(np.ascontiguousarray(arrays[name])).to(dtype)
    for name in ("prompt_len", "response_len"):
        batch[name] = torch.from_numpy(arrays[name].astype(np.int64))
    batch["num_turns"] = torch.from_numpy(table.column("num_turns").to_numpy().astype(np.int64))
    batch["reward"] = torch.from_numpy(table.column("reward").to_numpy().astype(np.float32))
    batch["truncated"] = torch.from_numpy(np.asarray(arrays["truncated"], dtype=bool))
    return batch


def iter_padded_batches(directory: Path | str, *, batch_size: int, prompt_length: int | None = None,
                        response_length: int | None = None, pad_token_id: int | None = None,
                        overflow: str = "truncate") -> Iterator[dict[str, Any]]:
    """Padded torch batches of ``batch_size`` rows (the last may be smaller), in dataset order.

    The lengths and pad token default to those the dataset was written with (lengths are
    required for an unpadded one; its pad token defaults to 0).
    """
    files = dataset_files(directory)
    if not files:
        return
    dataset = ds.dataset(files, format="parquet")
    written = layout(dataset.schema.empty_table())
    if prompt_length is None or response_length is None:
        if written is None:
            raise ValueError("an unpadded dataset needs prompt_length and response_length")
        prompt_length, response_length = written["prompt_length"], written["response_length"]
    if pad_token_id is None:
        pad_token_id = written["pad_token_id"] if written is not None else 0
    padding = Padding(prompt_length=prompt_length, response_length=response_length, pad_token_id=pad_token_id,
                      overflow="error" if overflow == "error" else "truncate")
    pending: list[pa.RecordBatch] = []
    rows = 0
    for record_batch in dataset.to_batches(batch_size=batch_size):
        pending.append(record_batch)
        rows += record_batch.num_rows
        while rows >= batch_size:
            table = pa.Table.from_batches(pending, schema=dataset.schema)
            yield to_torch(table.slice(0, batch_size), padding)
            rest = table.slice(batch_size)
            pending, rows = rest.to_batches(), rest.num_rows
    if rows:
        yield to_torch(pa.Table.from_batches(pending, schema=dataset.schema), padding)
