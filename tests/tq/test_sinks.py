"""One contract, both sinks: what goes in comes back once, equal, however often it is written."""

from __future__ import annotations

import pytest

from materializer.parquet import ParquetSink
from materializer.records import derive_records
from materializer.transfer_queue import TransferQueueSink
from schemas.records import MaterializedMarker
from session.fold import fold
from tests.sessions import workload
from tests.tq.readers import common_view, parquet_rows, tq_partition


def _records():
    states = [fold(s.events) for s in workload(prompts=5, n=2, seed=11)]
    finalized = [s for s in states if s.status == "finalized"]
    return finalized, [r for s in finalized for r in derive_records(s)]


class ParquetHarness:
    def __init__(self, tmp_path, partition):
        self.sink = ParquetSink(tmp_path / "trajectories")

    async def write(self, states, records):
        markers = [MaterializedMarker(session_id=s.session_id, stream_seq=1, digests={}) for s in states]
        staged = self.sink.stage(records, markers)
        self.sink.commit(staged.name)

    def read(self):
        return [(row["key"], common_view(row)) for row in parquet_rows(self.sink.directory)]


class TransferQueueHarness:
    def __init__(self, tmp_path, partition):
        self.sink = TransferQueueSink(partition)

    async def write(self, states, records):
        await self.sink.put_records(records)

    def read(self):
        rows, _ = tq_partition(self.sink.partition)
        return [(key, common_view(row)) for key, row in rows.items()]


@pytest.fixture(params=[ParquetHarness, TransferQueueHarness], ids=["parquet", "transfer_queue"])
def harness(request, tmp_path, partition):
    return request.param(tmp_path, partition)


def _expected(records):
    return {r.key: {"prompts": r.prompts.tolist(), "responses": r.responses.tolist(),
                    "input_ids": r.input_ids.tolist(), "attention_mask": r.attention_mask.tolist(),
                    "position_ids": r.position_ids.tolist(), "response_mask": r.response_mask.tolist(),
                    "loss_mask": r.loss_mask.tolist(), "rm_scores": r.rm_scores.tolist(),
                    "rollout_log_probs": None if r.rollout_log_probs is None else r.rollout_log_probs.tolist(),
                    "num_turns": r.num_turns, "uid": r.uid, "session_id": r.session_id, "agent_name": r.agent_name,
                    "reward_extra_info": r.reward_extra_info} for r in records}


async def test_records_come_back_equal_and_once(harness):
    states, records = _records()
    assert any(r.rollout_log_probs is None for r in records) and any(r.rollout_log_probs is not None for r in records)
    await harness.write(states, records)
    read = harness.read()
    assert sorted(k for k, _ in read) == sorted(r.key for r in records)
    assert dict(read) == _expected(records)


async def test_writing_again_changes_nothing(harness):
    states, records = _records()
    await harness.write(states, records)
    first = sorted(harness.read(), key=lambda item: item[0])
    await harness.write(states, records)
    assert sorted(harness.read(), key=lambda item: item[0]) == first
