"""Training records: one per trajectory (chain), verl's v1 TransferQueue protocol.

A record holds unpadded 1-D arrays (``prompts``, ``responses``, ``input_ids``, masks,
``rm_scores``, ``rollout_log_probs``) plus the key, the session's identity and the tags
verl reads. :data:`TRAJECTORY_SCHEMA` is the one Arrow schema every Parquet file is
written with; nothing is inferred batch by batch.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pyarrow as pa

IntArray = npt.NDArray[np.int32]
MaskArray = npt.NDArray[np.int8]
FloatArray = npt.NDArray[np.float32]


class TrajectoryRecord(msgspec.Struct, frozen=True, kw_only=True):
    key: str  # "{uid}_{session_index}_{trajectory_index}"
    uid: str
    session_index: int
    trajectory_index: int
    session_id: str
    agent_name: str
    status: str  # "success"
    global_steps: int
    materialization_reason: str | None
    prompts: IntArray
    responses: IntArray
    response_mask: MaskArray
    rm_scores: FloatArray
    rollout_log_probs: FloatArray | None
    num_turns: int
    reward: float
    reward_extra_info: dict[str, Any]
    loss_mask: MaskArray

    @property
    def prompt_len(self) -> int:
        return len(self.prompts)

    @property
    def response_len(self) -> int:
        return len(self.responses)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def input_ids(self) -> IntArray:
        return np.concatenate([self.prompts, self.responses])

    @property
    def attention_mask(self) -> MaskArray:
        return np.ones(self.seq_len, dtype=np.int8)

    @property
    def position_ids(self) -> IntArray:
        return np.arange(self.seq_len, dtype=np.int32)

    def tags(self) -> dict[str, Any]:
        """The TransferQueue tags verl reads for a trajectory key."""
        tags: dict[str, Any] = {
            "status": self.status,
            "prompt_len": self.prompt_len,
            "response_len": self.response_len,
            "seq_len": self.seq_len,
            "global_steps": self.global_steps,
            "uid": self.uid,
        }
        if self.materialization_reason is not None:
            tags["materialization_reason"] = self.materialization_reason
        return tags


class MaterializedMarker(msgspec.Struct, frozen=True, kw_only=True):
    """What the materializer recorded for a session (markers bucket, key = session id).

    ``stream_seq`` is the log position the records were derived from; ``digests`` maps
    each trajectory key to :func:`record_digest` of what was written, so ``rollbus replay
    --verify`` can re-derive and compare without reading the sinks.
    """

    session_id: str
    stream_seq: int
    digests: dict[str, str]
    sinks: tuple[str, ...] = ()


def record_digest(record: TrajectoryRecord) -> str:
    """A digest of everything a trainer reads from a record (arrays by value, then metadata)."""
    h = hashlib.sha256()
    for array in (record.prompts, record.responses, record.response_mask, record.loss_mask, record.rm_scores):
        h.update(np.ascontiguousarray(array).tobytes())
        h.update(b"|")
    if record.rollout_log_probs is not None:
        h.update(np.ascontiguousarray(record.rollout_log_probs).tobytes())
    meta = [record.key, record.session_id, record.agent_name, record.status, record.global_steps,
            record.materialization_reason, record.num_turns, record.reward, record.reward_extra_info]
    h.update(msgspec.json.encode(meta, order="sorted"))
    return h.hexdigest()


def _ints() -> pa.DataType:
    return pa.list_(pa.int32())


def _mask() -> pa.DataType:
    return pa.list_(pa.int8())


def _floats() -> pa.DataType:
    return pa.list_(pa.float32())


TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("uid", pa.string(), nullable=False),
        pa.field("session_index", pa.int32(), nullable=False),
        pa.field("trajectory_index", pa.int32(), nullable=False),
        pa.field("session_id", pa.string(), nullable=False),
        pa.field("agent_name", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field("response_len", pa.int32(), nullable=False),
        pa.field("seq_len", pa.int32(), nullable=False),
        pa.field("global_steps", pa.int64(), nullable=False),
        pa.field("materialization_reason", pa.string()),
        pa.field("prompts", _ints(), nullable=False),
        pa.field("responses", _ints(), nullable=False),
        pa.field("input_ids", _ints(), nullable=False),
        pa.field("attention_mask", _mask(), nullable=False),
        pa.field("position_ids", _ints(), nullable=False),
        pa.field("response_mask", _mask(), nullable=False),
        pa.field("loss_mask", _mask(), nullable=False),
        pa.field("rm_scores", _floats(), nullable=False),
        pa.field("rollout_log_probs", _floats()),
        pa.field("num_turns", pa.int32(), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("reward_extra_info", pa.string(), nullable=False),  # JSON object
    ],
    metadata={"rollbus.schema": "trajectory/v1"},
)


def _list_array(arrays: list[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    """A list column built from flat buffers: one concatenation, no per-element Python objects."""
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate(arrays) if arrays else np.zeros(0)
    values = pa.array(flat.astype(value_type.to_pandas_dtype(), copy=False), type=value_type)
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def _optional_list_array(arrays: list[np.ndarray | None], value_type: pa.DataType) -> pa.ListArray:
    present = [a if a is not None else np.zeros(0) for a in arrays]
    column = _list_array(present, value_type)
    if all(a is not None for a in arrays):
        return column
    mask = pa.array([a is None for a in arrays])
    return pa.ListArray.from_arrays(column.offsets, column.values, mask=mask)


def records_to_table(records: list[TrajectoryRecord]) -> pa.Table:
    """Records as one Arrow table with :data:`TRAJECTORY_SCHEMA`."""
    columns: dict[str, pa.Array] = {
        "key": pa.array([r.key for r in records], pa.string()),
        "uid": pa.array([r.uid for r in records], pa.string()),
        "session_index": pa.array([r.session_index for r in records], pa.int32()),
        "trajectory_index": pa.array([r.trajectory_index for r in records], pa.int32()),
        "session_id": pa.array([r.session_id for r in records], pa.string()),
        "agent_name": pa.array([r.agent_name for r in records], pa.string()),
        "status": pa.array([r.status for r in records], pa.string()),
        "prompt_len": pa.array([r.prompt_len for r in records], pa.int32()),
        "response_len": pa.array([r.response_len for r in records], pa.int32()),
        "seq_len": pa.array([r.seq_len for r in records], pa.int32()),
        "global_steps": pa.array([r.global_steps for r in records], pa.int64()),
        "materialization_reason": pa.array([r.materialization_reason for r in records], pa.string()),
        "prompts": _list_array([r.prompts for r in records], pa.int32()),
        "responses": _list_array([r.responses for r in records], pa.int32()),
        "input_ids": _list_array([r.input_ids for r in records], pa.int32()),
        "attention_mask": _list_array([r.attention_mask for r in records], pa.int8()),
        "position_ids": _list_array([r.position_ids for r in records], pa.int32()),
        "response_mask": _list_array([r.response_mask for r in records], pa.int8()),
        "loss_mask": _list_array([r.loss_mask for r in records], pa.int8()),
        "rm_scores": _list_array([r.rm_scores for r in records], pa.float32()),
        "rollout_log_probs": _optional_list_array([r.rollout_log_probs for r in records], pa.float32()),
        "num_turns": pa.array([r.num_turns for r in records], pa.int32()),
        "reward": pa.array([r.reward for r in records], pa.float64()),
        "reward_extra_info": pa.array(
            [msgspec.json.encode(r.reward_extra_info).decode() for r in records], pa.string()
        ),
    }
    return pa.Table.from_pydict(columns, schema=TRAJECTORY_SCHEMA)
