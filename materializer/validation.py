"""What the sinks can hold, checked before anything is written. Pure: records in, problems out.

A session's records go to Parquet (:data:`schemas.records.TRAJECTORY_SCHEMA`) and to
TransferQueue (:mod:`materializer.tq_fields`). A record the sinks cannot hold would fail
the write of every session batched with it, so each session's records are checked on
their own first (:func:`session_problem`), and a session with a problem is quarantined
(:mod:`materializer.quarantine`) instead of written:

- integers in their columns' ranges: ``session_index``, ``trajectory_index``, ``num_turns``
  and the lengths int32; ``global_steps``, ``min_global_steps``, ``max_global_steps`` int64;
- token ids non-negative int32: the log holds them as uint32, and one of 2^31 or more does
  not survive the int32 columns (it would wrap to a negative id, silently);
- 1-D arrays of the schema's dtypes, the response-side ones as long as ``responses``, masks
  of 0 and 1;
- strings that are valid UTF-8, and ``metadata`` / ``reward_extra_info`` that encode as the
  JSON objects the Parquet columns hold (no MessagePack extension values, no non-string keys);
- with padding that refuses overflow (``--overflow error``), records that fit the lengths.

TransferQueue holds tokens as int64 and any Python value as a non-tensor field, so
whatever Parquet can hold, it can too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import msgspec
import numpy as np

from materializer.padding import Padding
from schemas.records import TrajectoryRecord

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
MAX_REASON = 400  # characters of a reason kept (in the event, the log line, `rollbus sessions`)

_INT32_FIELDS = ("session_index", "trajectory_index", "num_turns", "fork_message_index", "fork_token_offset")
_INT64_FIELDS = ("global_steps", "min_global_steps", "max_global_steps")
_STRINGS = ("key", "uid", "session_id", "agent_name", "status", "reward_source", "materialization_reason",
            "parent_key", "fork_cause")
_ARRAYS: tuple[tuple[str, type[np.generic]], ...] = (
    ("prompts", np.int32), ("responses", np.int32), ("response_mask", np.int8), ("loss_mask", np.int8),
    ("rm_scores", np.float32), ("rollout_log_probs", np.float32))
_RESPONSE_SIDE = ("response_mask", "loss_mask", "rm_scores", "rollout_log_probs")
_JSON_ERRORS = (TypeError, ValueError, OverflowError, UnicodeError, msgspec.EncodeError)


def _int_problem(name: str, value: Any, bounds: tuple[int, int]) -> str | None:
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{name} is {type(value).__name__}, not an integer"
    if not bounds[0] <= value <= bounds[1]:
        bits = 32 if bounds == INT32 else 64
        return f"{name}={value} is out of the int{bits} range"
    return None


def _array_problems(record: TrajectoryRecord) -> Iterator[str]:
    for name, dtype in _ARRAYS:
        array = getattr(record, name)
        if array is None and name == "rollout_log_probs":
            continue
        if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype != dtype:
            yield f"{name} is not a 1-D {np.dtype(dtype).name} array"
            return
    for name in ("prompts", "responses"):
        ids = getattr(record, name)
        if ids.size and int(ids.min()) < 0:
            yield f"{name} holds a token id out of the int32 range (2^31 or more)"
    for name in _RESPONSE_SIDE:
        array = getattr(record, name)
        if array is not None and len(array) != len(record.responses):
            yield f"{name} has {len(array)} values for {len(record.responses)} response tokens"
    for name in ("response_mask", "loss_mask"):
        mask = getattr(record, name)
        if mask.size and (int(mask.min()) < 0 or int(mask.max()) > 1):
            yield f"{name} holds values other than 0 and 1"


def _text_problems(record: TrajectoryRecord) -> Iterator[str]:
    for name in _STRINGS:
        value = getattr(record, name)
        if value is None and name == "materialization_reason":
            continue
        if not isinstance(value, str):
            yield f"{name} is {type(value).__name__}, not a string"
            continue
        try:
            value.encode("utf-8")
        except UnicodeError:
            yield f"{name} is not valid UTF-8"
    for name in ("metadata", "reward_extra_info"):
        try:
            msgspec.json.encode(getattr(record, name), order="sorted")  # as the Parquet column is written
        except _JSON_ERRORS as exc:
            yield f"{name} cannot be stored as JSON ({exc})"


def _padding_problems(record: TrajectoryRecord, padding: Padding | None) -> Iterator[str]:
    if padding is None or padding.overflow != "error":
        return
    if record.prompt_len > padding.prompt_length or record.response_len > padding.response_length:
        yield (f"it is longer ({record.prompt_len} + {record.response_len} tokens) than the padded lengths "
               f"({padding.prompt_length} + {padding.response_length}) and overflow is 'error'")


def record_problems(record: TrajectoryRecord, padding: Padding | None = None) -> list[str]:
    """Every reason the sinks cannot hold this record (empty: they can)."""
    problems = [p for name in _INT32_FIELDS if (p := _int_problem(name, getattr(record, name), INT32))]
    problems += [p for name in _INT64_FIELDS if (p := _int_problem(name, getattr(record, name), INT64))]
    problems += _array_problems(record)
    if not problems and record.seq_len > INT32[1]:
        problems.append(f"it has {record.seq_len} tokens, more than an int32 length")
    problems += _text_problems(record)
    problems += _padding_problems(record, padding)
    return problems


def session_problem(records: Iterable[TrajectoryRecord], padding: Padding | None = None) -> str | None:
    """Why the sinks cannot hold this session's records, in one bounded line (None: they can)."""
    for record in records:
        problems = record_problems(record, padding)
        if problems:
            return bounded(f"record {record.key!r}: {'; '.join(problems)}")
    return None


def bounded(text: str, limit: int = MAX_REASON) -> str:
    """One line of at most ``limit`` characters, valid UTF-8 (what it cannot encode escaped)."""
    line = " ".join(text.split()).encode("utf-8", "backslashreplace").decode("utf-8")
    return line if len(line) <= limit else line[: limit - 1] + "…"
