"""Training records: one per trajectory (chain), verl's v1 TransferQueue protocol.

A record holds unpadded 1-D arrays (``prompts``, ``responses``, ``input_ids``, masks,
``rm_scores``, ``rollout_log_probs``) plus the key, the session's identity and the tags
verl reads. :data:`TRAJECTORY_SCHEMA` is the one Arrow schema every Parquet file is
written with; nothing is inferred batch by batch. A table holds either the unpadded
arrays or, on request, their padded form (fixed-length lists; the lengths and the
padding rule in the schema metadata under ``rollbus.padding``).

A trajectory of a session with an image processor (issue 29) also carries its images (by digest,
each at its offset in ``input_ids``) and, once :mod:`materializer.vision` has run the processor,
``multi_modal_inputs`` (what verl's agent loop builds: ``pixel_values``, ``image_grid_thw``,
``images_seqlens``) and the three M-RoPE rows of its position ids. Parquet keeps the images by
digest and the three rows, never the pixels (:func:`materializer.vision.restore` rebuilds them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pyarrow as pa

from schemas.events import ImageRef
from schemas.metadata import RecordOptions

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
    reward_source: str = "task"  # "task" | "scorer" | "default"
    min_global_steps: int = 0  # the weight versions the trajectory was sampled with (global_steps when unknown)
    max_global_steps: int = 0
    metadata: dict[str, Any] = {}  # the session's task metadata, as opened
    # The turns (0-based, in the chain's order) sampled under a constraint (a forced tool call, a JSON format):
    # their rollout_log_probs are the constrained distribution's, not the model's own.
    constrained_turns: tuple[int, ...] = ()
    # Where the chain forked from (materializer.records): its parent's key ("" for a root chain), the messages and
    # tokens it shares with the parent, and the cause (schemas.events.FORK_CAUSES; "" when the log did not record it).
    parent_key: str = ""
    fork_message_index: int = 0
    fork_token_offset: int = 0
    fork_cause: str = ""
    # Images (issue 29): the session's processor (None: a text-only session), the trajectory's images in order
    # (``offset`` into input_ids), and what materializer.vision derives from them with the processor: verl's
    # multi_modal_inputs (tensors by name; {} for a trajectory without images) and the 3 M-RoPE rows (3, seq_len).
    processor: str | None = None
    images: tuple[ImageRef, ...] = ()
    multi_modal_inputs: dict[str, Any] | None = None
    vision_position_ids: npt.NDArray[np.int64] | None = None

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
            "min_global_steps": self.min_global_steps,
            "max_global_steps": self.max_global_steps,
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
    status: str = "finalized"  # "finalized" | "aborted" | "duplicate" (a session index its prompt already had)
    uid: str = ""
    session_index: int = 0
    attempt: int = 0  # the prompt's dispatch attempt the session belonged to (its metadata's "attempt")
    parquet_file: str | None = None  # the dataset file holding the records
    reward: float | None = None
    reward_source: str | None = None  # "task" | "scorer" | "default"
    reward_extra_info: dict[str, Any] = {}  # as in the records (with a scorer's, which a re-derivation cannot rerun)
    # the record options the records were derived with (the session's own overrides; the defaults in a
    # marker written before markers kept them)
    options: RecordOptions = RecordOptions()

    @property
    def succeeded(self) -> bool:
        """The session counts as a success for its prompt: finalized with at least one trajectory."""
        return self.status == "finalized" and bool(self.digests)


def record_digest(record: TrajectoryRecord) -> str:
    """A digest of everything a trainer reads from a record (arrays by value, then metadata)."""
    h = hashlib.sha256()
    for array in (record.prompts, record.responses, record.response_mask, record.loss_mask, record.rm_scores):
        h.update(np.ascontiguousarray(array).tobytes())
        h.update(b"|")
    if record.rollout_log_probs is not None:
        h.update(np.ascontiguousarray(record.rollout_log_probs).tobytes())
    meta = [record.key, record.session_id, record.agent_name, record.status, record.global_steps,
            record.materialization_reason, record.num_turns, record.reward, record.reward_extra_info,
            record.reward_source, record.min_global_steps, record.max_global_steps, record.metadata]
    if record.constrained_turns:  # only then: the digests of records from before it existed stay the same
        meta.append(list(record.constrained_turns))
    if record.fork_cause:  # likewise
        meta.append([record.parent_key, record.fork_message_index, record.fork_token_offset, record.fork_cause])
    if record.processor is not None:  # likewise (what the processor derives from the images follows from these)
        meta.append([record.processor, [[i.digest, i.offset, i.tokens] for i in record.images]])
    h.update(msgspec.json.encode(meta, order="sorted"))
    return h.hexdigest()


def _ints() -> pa.DataType:
    return pa.list_(pa.int32())


def _mask() -> pa.DataType:
    return pa.list_(pa.int8())


def _floats() -> pa.DataType:
    return pa.list_(pa.float32())


IMAGE_TYPE = pa.struct([pa.field("digest", pa.string(), nullable=False),
                        pa.field("media_type", pa.string(), nullable=False),
                        pa.field("width", pa.int32(), nullable=False), pa.field("height", pa.int32(), nullable=False),
                        pa.field("offset", pa.int32(), nullable=False), pa.field("tokens", pa.int32(), nullable=False)])

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
        pa.field("reward_source", pa.string(), nullable=False),
        pa.field("min_global_steps", pa.int64(), nullable=False),
        pa.field("max_global_steps", pa.int64(), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),  # JSON object: the session's task metadata
        pa.field("truncated", pa.bool_(), nullable=False),  # padded form only: cut to the padded lengths
        # the turns sampled under a constraint (0-based); null in files written before the column existed
        pa.field("constrained_turns", _ints()),
        # where the chain forked from (null when the log did not record it, and in files written before)
        pa.field("parent_key", pa.string()),  # "" for a chain with no parent
        pa.field("fork_message_index", pa.int32()),
        pa.field("fork_token_offset", pa.int32()),
        pa.field("fork_cause", pa.string()),
        # images (issue 29), null for a text-only session's record: its processor, its images by digest (offsets
        # into input_ids; the bytes in the log's object store), and the three M-RoPE rows of its position ids
        # (verl's position_ids are these under the text row, position_ids): materializer.vision.restore
        pa.field("processor", pa.string()),
        pa.field("images", pa.list_(IMAGE_TYPE)),
        pa.field("vision_position_ids", pa.list_(_ints())),
    ],
    metadata={"rollbus.schema": "trajectory/v1"},
)


SEQUENCE_COLUMNS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                    "loss_mask", "rm_scores", "rollout_log_probs")
PADDING_METADATA = b"rollbus.padding"

Column = list[np.ndarray] | np.ndarray  # rows of 1-D arrays, or one 2-D array of padded rows


def _list_array(rows: Column, value_type: pa.DataType) -> pa.ListArray:
    """A list column built from flat buffers: one concatenation, no per-element Python objects."""
    dtype = value_type.to_pandas_dtype()
    if isinstance(rows, np.ndarray):  # padded: every row has the same width
        offsets = np.arange(rows.shape[0] + 1, dtype=np.int32) * rows.shape[1]
        flat = rows.reshape(-1)
    else:
        lengths = np.fromiter((len(a) for a in rows), dtype=np.int32, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.concatenate(rows) if rows else np.zeros(0)
    values = pa.array(flat.astype(dtype, copy=False), type=value_type)
    return pa.ListArray.from_arrays(pa.array(offsets), values)


def _optional_list_array(rows: list[np.ndarray | None] | np.ndarray | None, present: list[bool],
                         value_type: pa.DataType) -> pa.ListArray:
    """Null where a record has no such array (``rollout_log_probs`` of a record without log probs)."""
    if rows is None:
        rows = [np.zeros(0)] * len(present)
    elif isinstance(rows, list):
        rows = [a if a is not None else np.zeros(0) for a in rows]
    column = _list_array(rows, value_type)
    if all(present):
        return column
    return pa.ListArray.from_arrays(column.offsets, column.values, mask=pa.array([not p for p in present]))


def _json(value: Any) -> str:
    return msgspec.json.encode(value, order="sorted").decode()


def _unpadded(records: list[TrajectoryRecord]) -> dict[str, Any]:
    return {
        "prompts": [r.prompts for r in records],
        "responses": [r.responses for r in records],
        "input_ids": [r.input_ids for r in records],
        "attention_mask": [r.attention_mask for r in records],
        "position_ids": [r.position_ids for r in records],
        "response_mask": [r.response_mask for r in records],
        "loss_mask": [r.loss_mask for r in records],
        "rm_scores": [r.rm_scores for r in records],
        "rollout_log_probs": [r.rollout_log_probs for r in records],
        "prompt_len": [r.prompt_len for r in records],
        "response_len": [r.response_len for r in records],
        "truncated": [False] * len(records),
    }


def records_to_table(records: list[TrajectoryRecord], padded: Mapping[str, Any] | None = None,
                     padding: Mapping[str, Any] | None = None) -> pa.Table:
    """Records as one Arrow table with :data:`TRAJECTORY_SCHEMA`.

    ``padded``: the padded form of the records' arrays (2-D arrays under the
    :data:`SEQUENCE_COLUMNS` names, plus the valid ``prompt_len`` / ``response_len`` and
    ``truncated`` per row), described by ``padding`` in the schema metadata.
    """
    seq = padded if padded is not None else _unpadded(records)
    present = [r.rollout_log_probs is not None for r in records]
    columns: dict[str, pa.Array] = {
        "key": pa.array([r.key for r in records], pa.string()),
        "uid": pa.array([r.uid for r in records], pa.string()),
        "session_index": pa.array([r.session_index for r in records], pa.int32()),
        "trajectory_index": pa.array([r.trajectory_index for r in records], pa.int32()),
        "session_id": pa.array([r.session_id for r in records], pa.string()),
        "agent_name": pa.array([r.agent_name for r in records], pa.string()),
        "status": pa.array([r.status for r in records], pa.string()),
        "prompt_len": pa.array(np.asarray(seq["prompt_len"], dtype=np.int32), pa.int32()),
        "response_len": pa.array(np.asarray(seq["response_len"], dtype=np.int32), pa.int32()),
        "seq_len": pa.array(np.asarray(seq["prompt_len"], dtype=np.int32)
                            + np.asarray(seq["response_len"], dtype=np.int32), pa.int32()),
        "global_steps": pa.array([r.global_steps for r in records], pa.int64()),
        "materialization_reason": pa.array([r.materialization_reason for r in records], pa.string()),
        **{name: _list_array(seq[name], _VALUE_TYPES[name]) for name in SEQUENCE_COLUMNS[:-1]},
        "rollout_log_probs": _optional_list_array(seq["rollout_log_probs"], present, pa.float32()),
        "num_turns": pa.array([r.num_turns for r in records], pa.int32()),
        "reward": pa.array([r.reward for r in records], pa.float64()),
        "reward_extra_info": pa.array([_json(r.reward_extra_info) for r in records], pa.string()),
        "reward_source": pa.array([r.reward_source for r in records], pa.string()),
        "min_global_steps": pa.array([r.min_global_steps for r in records], pa.int64()),
        "max_global_steps": pa.array([r.max_global_steps for r in records], pa.int64()),
        "metadata": pa.array([_json(r.metadata) for r in records], pa.string()),
        "truncated": pa.array(np.asarray(seq["truncated"], dtype=bool), pa.bool_()),
        "constrained_turns": pa.array([list(r.constrained_turns) for r in records], _ints()),
        **_fork_columns(records),
        **_image_columns(records),
    }
    schema = TRAJECTORY_SCHEMA
    if padding is not None:
        schema = schema.with_metadata({**(schema.metadata or {}), PADDING_METADATA: _json(dict(padding)).encode()})
    return pa.Table.from_pydict(columns, schema=schema)


def _fork_columns(records: list[TrajectoryRecord]) -> dict[str, pa.Array]:
    """The fork columns: null for a record whose log did not record its fork."""
    forked = [r if r.fork_cause else None for r in records]
    return {
        "parent_key": pa.array([r and r.parent_key for r in forked], pa.string()),
        "fork_message_index": pa.array([r and r.fork_message_index for r in forked], pa.int32()),
        "fork_token_offset": pa.array([r and r.fork_token_offset for r in forked], pa.int32()),
        "fork_cause": pa.array([r and r.fork_cause for r in forked], pa.string()),
    }


def _image_columns(records: list[TrajectoryRecord]) -> dict[str, pa.Array]:
    """The image columns: null for a text-only session's record."""
    vision = [r if r.processor is not None else None for r in records]
    return {
        "processor": pa.array([r and r.processor for r in vision], pa.string()),
        "images": pa.array([None if r is None else [msgspec.structs.asdict(i) for i in r.images] for r in vision],
                            pa.list_(IMAGE_TYPE)),
        "vision_position_ids": pa.array([None if r is None or r.vision_position_ids is None
                                         else list(r.vision_position_ids.astype(np.int32)) for r in vision],
                                        pa.list_(_ints())),
    }


_VALUE_TYPES: dict[str, pa.DataType] = {
    "prompts": pa.int32(), "responses": pa.int32(), "input_ids": pa.int32(), "attention_mask": pa.int8(),
    "position_ids": pa.int32(), "response_mask": pa.int8(), "loss_mask": pa.int8(), "rm_scores": pa.float32(),
    "rollout_log_probs": pa.float32(),
}
