"""Records as TransferQueue fields: every row of every batched field is its record's own value."""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from materializer.records import derive_records
from materializer.tq_fields import (
    FLOAT_SEQUENCES,
    INT_SEQUENCES,
    TASK_KEYS,
    extra_fields,
    fields_of,
    grouped,
    to_tensordict,
)
from schemas.records import TrajectoryRecord
from session.fold import fold
from tests.sessions import workload


def _records() -> list[TrajectoryRecord]:
    states = [fold(s.events) for s in workload(prompts=6, n=3, seed=3)]
    return [r for s in states if s.status == "finalized" for r in derive_records(s)]


def _expected(record: TrajectoryRecord, name: str) -> object:
    if name in INT_SEQUENCES or name in FLOAT_SEQUENCES:
        return getattr(record, name).tolist()
    if name == "extra_fields":
        return extra_fields(record)
    if name == "reward_extra_info":
        return dict(record.reward_extra_info)
    if name in TASK_KEYS:
        return record.metadata[name]
    return getattr(record, name)


def _rows(value: object) -> list[object]:
    if isinstance(value, torch.Tensor):
        return [row.tolist() for row in value.unbind()] if value.is_nested else value.tolist()
    if isinstance(value, list):  # tensordict 0.10 hands a NonTensorStack back as its LinkedList (a list)
        return list(value)
    return value.tolist()  # type: ignore[attr-defined]


def test_each_row_is_its_records_value_with_verls_dtypes():
    records = _records()
    masked = records[0]  # a masked episode: its loss mask is not its response mask
    records[0] = msgspec.structs.replace(masked, loss_mask=np.zeros_like(masked.response_mask))
    assert len(records) > 10
    for keys, fields, _tags in grouped(records):
        batch = [r for r in records if r.key in set(keys)]
        for name in fields_of(batch[0]):
            value = fields[name]
            if name in INT_SEQUENCES or name == "num_turns":
                assert value.dtype == torch.int64, name
            if name in FLOAT_SEQUENCES:
                assert value.dtype == torch.float32, name
            assert _rows(value) == [_expected(r, name) for r in batch], name


def test_an_empty_response_is_an_empty_row():
    record = _records()[0]
    empty = np.zeros(0, dtype=np.int32)
    record = msgspec.structs.replace(record, responses=empty, response_mask=empty.astype(np.int8),
                                     loss_mask=empty.astype(np.int8), rm_scores=empty.astype(np.float32),
                                     rollout_log_probs=None)
    fields = to_tensordict([record, _records()[1]], fields_of(record))
    assert fields["responses"].unbind()[0].tolist() == []
    assert fields["position_ids"].unbind()[0].tolist() == list(range(len(record.prompts)))
