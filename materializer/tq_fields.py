"""Records as TransferQueue fields and tags, the way verl's agent loop writes them.

Per trajectory key ``{uid}_{session_index}_{trajectory_index}``:

- token fields, each a jagged nested tensor over the batch (verl pads them with
  ``to_padded_tensor`` and reads lengths from ``offsets()``): ``prompts``, ``responses``,
  ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``, ``loss_mask``
  (int64), ``rm_scores`` and, when the record has them, ``rollout_log_probs`` (float32);
- ``num_turns`` (int64, one per trajectory);
- non-tensor fields: ``uid``, ``session_id`` (rollbus's session id), ``agent_name``,
  ``reward_extra_info``, ``extra_fields`` (``reward_extra_info`` where verl's replay
  buffer reads it, the reward and its source, the weight-version span, the
  materialization reason, session and trajectory index, the turns sampled under a
  constraint, and where the chain forked from: ``parent_key``, ``fork_message_index``,
  ``fork_token_offset``, ``fork_cause``) and, when the session was opened with them, the task fields verl reads by
  name (``data_source``, ``reward_model``, ``extra_info``, ``raw_prompt``, ``tools_kwargs``);
- a session with an image processor (issue 29): ``multi_modal_inputs`` (non-tensor, one dict of tensors per
  trajectory, ``{}`` for one without images, as verl's agent loop builds it with a processor) and
  ``position_ids`` of four rows per token (verl's ``_compute_position_ids``: the text positions, then the
  three M-RoPE rows), a jagged tensor ragged in its last dimension, as verl's ``list_of_dict_to_tensordict``
  makes it;
- tags: ``status: success``, ``prompt_len``, ``response_len``, ``seq_len``, ``global_steps``,
  ``min_global_steps``, ``max_global_steps``, ``uid`` and ``materialization_reason``.

TransferQueue needs every key of one put to have the same fields, so records are grouped
by their field set (records without log probs, or without task fields, go in their own
put); which fields a key has depends on its record alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

from schemas.records import TrajectoryRecord

TASK_KEYS = ("data_source", "reward_model", "extra_info", "raw_prompt", "tools_kwargs")
INT_SEQUENCES = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask", "loss_mask")
FLOAT_SEQUENCES = ("rm_scores", "rollout_log_probs")


def _offsets(lengths: np.ndarray) -> torch.Tensor:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return torch.from_numpy(offsets)


def _nested(values: np.ndarray, offsets: torch.Tensor) -> torch.Tensor:
    """One nested (jagged) tensor from flat values and offsets: no per-row tensors."""
    return torch.nested.nested_tensor_from_jagged(torch.from_numpy(values), offsets)


def _flat(rows: list[np.ndarray], dtype: type[np.generic]) -> np.ndarray:
    return np.concatenate(rows, dtype=dtype) if rows else np.zeros(0, dtype=dtype)


class _Layout:
    """The lengths of a batch's records, as offsets every token field of one length shares."""

    def __init__(self, records: list[TrajectoryRecord]) -> None:
        n = len(records)
        self.prompt_lens = np.fromiter((len(r.prompts) for r in records), dtype=np.int64, count=n)
        self.response_lens = np.fromiter((len(r.responses) for r in records), dtype=np.int64, count=n)
        self.seq_lens = self.prompt_lens + self.response_lens
        self.prompt = _offsets(self.prompt_lens)
        self.response = _offsets(self.response_lens)
        self.seq = _offsets(self.seq_lens)


def _sequences(records: list[TrajectoryRecord], layout: _Layout) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and position_ids of every record, built over the whole batch at once."""
    total = int(layout.seq[-1])
    input_ids = _flat([a for r in records for a in (r.prompts, r.responses)], np.int64)
    ramp = np.arange(int(layout.seq_lens.max(initial=0)), dtype=np.int64)
    positions = _flat([ramp[:n] for n in layout.seq_lens.tolist()], np.int64)  # one copy, no arithmetic
    return {"input_ids": _nested(input_ids, layout.seq),
            "attention_mask": _nested(np.ones(total, dtype=np.int64), layout.seq),
            "position_ids": _nested(positions, layout.seq)}


def _vision(record: TrajectoryRecord) -> tuple[np.ndarray, dict[str, Any]]:
    if record.vision_position_ids is None or record.multi_modal_inputs is None:  # materializer.vision runs first
        raise ValueError(f"record {record.key} has no vision inputs")
    return record.vision_position_ids, record.multi_modal_inputs


def _vision_fields(records: list[TrajectoryRecord]) -> dict[str, Any]:
    """position_ids (text row over the three M-RoPE rows, ragged in the last dimension) and multi_modal_inputs."""
    rows = []
    inputs = []
    for record in records:
        rope, mm = _vision(record)
        text = np.arange(record.seq_len, dtype=np.int64)[None, :]
        rows.append(torch.from_numpy(np.concatenate([text, rope.astype(np.int64, copy=False)])))
        inputs.append(mm)
    return {"position_ids": torch.nested.as_nested_tensor(rows, layout=torch.jagged),
            "multi_modal_inputs": NonTensorStack.from_list(inputs)}


def _sequence(record: TrajectoryRecord, name: str) -> np.ndarray:
    value = getattr(record, name)
    if value is None:  # fields_of() leaves absent log probs out; reaching this is a bug
        raise ValueError(f"record {record.key} has no {name}")
    return value


def extra_fields(record: TrajectoryRecord) -> dict[str, Any]:
    return {
        "reward_extra_info": dict(record.reward_extra_info),
        "reward": record.reward,
        "reward_source": record.reward_source,
        "min_global_steps": record.min_global_steps,
        "max_global_steps": record.max_global_steps,
        "materialization_reason": record.materialization_reason,
        "session_index": record.session_index,
        "trajectory_index": record.trajectory_index,
        "constrained_turns": list(record.constrained_turns),
        "parent_key": record.parent_key,
        "fork_message_index": record.fork_message_index,
        "fork_token_offset": record.fork_token_offset,
        "fork_cause": record.fork_cause,
    }


def fields_of(record: TrajectoryRecord) -> tuple[str, ...]:
    """The field names this record's key gets."""
    names = [*INT_SEQUENCES, "rm_scores"]
    if record.rollout_log_probs is not None:
        names.append("rollout_log_probs")
    names += ["num_turns", "uid", "session_id", "agent_name", "reward_extra_info", "extra_fields"]
    names += [k for k in TASK_KEYS if k in record.metadata]
    if record.processor is not None:
        names.append("multi_modal_inputs")
    return tuple(names)


def _non_tensor(record: TrajectoryRecord, name: str) -> Any:
    if name == "extra_fields":
        return extra_fields(record)
    if name == "reward_extra_info":
        return dict(record.reward_extra_info)
    if name in TASK_KEYS:
        return record.metadata[name]
    return getattr(record, name)


def _token_field(records: list[TrajectoryRecord], name: str, layout: _Layout,
                 built: dict[str, torch.Tensor]) -> torch.Tensor:
    offsets = layout.prompt if name == "prompts" else layout.response
    if name == "loss_mask" and "response_mask" in built and all(r.loss_mask is r.response_mask for r in records):
        return built["response_mask"]  # one array in the records (derive_records): one tensor here
    dtype = np.float32 if name in FLOAT_SEQUENCES else np.int64
    return _nested(_flat([_sequence(r, name) for r in records], dtype), offsets)


def to_tensordict(records: list[TrajectoryRecord], names: tuple[str, ...]) -> TensorDict:
    """The fields ``names`` of records that all have them, batched."""
    layout = _Layout(records)
    data: dict[str, Any] = _sequences(records, layout)
    if "multi_modal_inputs" in names:
        data.update(_vision_fields(records))
    for name in names:
        if name in data:
            continue
        if name in INT_SEQUENCES or name in FLOAT_SEQUENCES:
            data[name] = _token_field(records, name, layout, data)
        elif name == "num_turns":
            data[name] = torch.tensor([r.num_turns for r in records], dtype=torch.int64)
        else:
            data[name] = NonTensorStack.from_list([_non_tensor(r, name) for r in records])
    return TensorDict({name: data[name] for name in names}, batch_size=[len(records)])


def grouped(records: list[TrajectoryRecord]) -> list[tuple[list[str], TensorDict, list[dict[str, Any]]]]:
    """(keys, fields, tags) per field set, ready for ``kv_batch_put``."""
    groups: dict[tuple[str, ...], list[TrajectoryRecord]] = {}
    for record in records:
        groups.setdefault(fields_of(record), []).append(record)
    return [([r.key for r in rs], to_tensordict(rs, names), [r.tags() for r in rs]) for names, rs in groups.items()]


def prompt_tag(status: str, global_steps: int) -> dict[str, Any]:
    """The tag of a prompt key ``{uid}``, as verl's replay buffer reads it."""
    return {"is_prompt": True, "status": status, "global_steps": global_steps}
