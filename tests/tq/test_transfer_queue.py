"""The materializer with the TransferQueue sink: verl's protocol, read back the way verl reads it."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import numpy as np
import pytest
import transfer_queue as tq

from eventlog.jetstream import JetStreamPort
from eventlog.kv import KvStore
from eventlog.publisher import JetStreamLog
from materializer.dataset import iter_padded_batches
from materializer.ledger import PromptLedger
from materializer.parquet import ParquetSink
from materializer.prompts import PromptProgress, SessionOutcome
from materializer.service import Materializer, MaterializerOptions
from materializer.transfer_queue import TransferQueueSink
from session_projector.service import Projector
from tests.integration.test_materializer import _drained
from tests.sessions import append, expected_statuses, workload
from tests.tq.readers import group_by_prompt, parquet_rows, tq_partition

FORK_FIELDS = ("parent_key", "fork_message_index", "fork_token_offset", "fork_cause")
DEFAULTS = {"parent_key": "", "fork_message_index": 0, "fork_token_offset": 0, "fork_cause": ""}


@contextlib.asynccontextmanager
async def materializing(nc, cfg, tmp_path, partition, **options):
    stop = asyncio.Event()
    sink = ParquetSink(tmp_path / "trajectories")
    materializer = Materializer(JetStreamPort(nc, cfg), sink, tq=TransferQueueSink(partition),
                                options=MaterializerOptions(max_delay=0.1, transfer_queue=True, **options))
    tasks = [asyncio.ensure_future(Projector(JetStreamPort(nc, cfg)).run(stop)),
             asyncio.ensure_future(materializer.run(stop))]
    try:
        yield sink
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_verl_protocol_keys_tags_and_prompt_statuses(nc, js, log_config, tmp_path, partition):
    scripts = workload(prompts=10, n=3, seed=5)
    log = JetStreamLog(nc, log_config)
    async with materializing(nc, log_config, tmp_path, partition) as sink:
        for script in scripts:
            await append(log, script)
        await _drained(js, log_config, len(scripts))
    rows, prompts = tq_partition(partition)
    assert {uid: tag["status"] for uid, tag in prompts.items()} == expected_statuses(scripts)
    assert all(tag["is_prompt"] is True and tag["global_steps"] == 4 for tag in prompts.values())
    assert "failure" in {t["status"] for t in prompts.values()}  # a prompt whose sessions all failed
    parquet = {row["key"]: row for row in parquet_rows(sink.directory)}
    assert sorted(rows) == sorted(parquet)
    for key, row in rows.items():
        uid, index, _trajectory = key.split("_")
        tags = row["__tags__"]
        assert tags["status"] == "success" and tags["uid"] == uid == row["uid"]
        assert (tags["prompt_len"], tags["response_len"]) == (len(row["prompts"]), len(row["responses"]))
        assert tags["seq_len"] == len(row["input_ids"]) and tags["global_steps"] == 4
        assert tags["min_global_steps"] == tags["max_global_steps"] == 4
        assert tags.get("materialization_reason") == parquet[key]["materialization_reason"]
        assert row["extra_fields"]["reward_extra_info"] == parquet[key]["reward_extra_info"]
        assert row["extra_fields"]["session_index"] == int(index) and row["data_source"] == "synthetic"
        fork = {name: row["extra_fields"][name] for name in FORK_FIELDS}
        assert fork == {name: parquet[key][name] or DEFAULTS[name] for name in FORK_FIELDS}
    causes = {row["extra_fields"]["fork_cause"] for row in rows.values()}
    assert {"sibling", "new_conversation", ""} <= causes  # odd prompts' logs recorded no forks
    assert all(row["extra_fields"]["parent_key"] == row["uid"] + "_" + key.split("_")[1] + "_0"
               for key, row in rows.items() if row["extra_fields"]["fork_cause"] == "sibling")


async def test_a_verl_style_consumer_gets_tensors_equal_to_the_parquet_rows(nc, js, log_config, tmp_path, partition):
    scripts = workload(prompts=6, n=2, seed=9)
    log = JetStreamLog(nc, log_config)
    async with materializing(nc, log_config, tmp_path, partition) as sink:
        for script in scripts:
            await append(log, script)
        await _drained(js, log_config, len(scripts))
    # verl's ReplayBuffer: list the partition, split prompts from trajectories, group by the uid prefix
    listing = tq.kv_list(partition_id=partition)[partition]
    finished = {k for k, t in listing.items() if t.get("is_prompt") and t["status"] == "finished"}
    groups = group_by_prompt([k for k, t in listing.items() if not t.get("is_prompt")])
    assert set(groups) == finished  # failed prompts have no trajectories
    parquet = {row["key"]: row for row in parquet_rows(sink.directory)}
    padded = {key: (batch, i) for batch in iter_padded_batches(sink.directory, batch_size=8, prompt_length=32,
                                                                response_length=64)
              for i, key in enumerate(batch["key"])}
    for uid in sorted(finished):
        keys = sorted(groups[uid])
        data = tq.kv_batch_get(keys=keys, partition_id=partition)
        responses = data["responses"].to_padded_tensor(padding=0)  # as verl pads them
        for i, key in enumerate(keys):
            row = parquet[key]
            for name in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
                         "loss_mask"):
                assert data[name].unbind()[i].tolist() == row[name], (key, name)
            np.testing.assert_array_equal(data["rm_scores"].unbind()[i].numpy(), np.float32(row["rm_scores"]))
            assert int(data["num_turns"][i]) == row["num_turns"]
            batch, j = padded[key]  # the Parquet reader's padded tensors hold the same tokens
            assert batch["responses"][j, :row["response_len"]].equal(responses[i, :row["response_len"]])
            assert batch["rm_scores"][j].sum().item() == pytest.approx(data["rm_scores"].unbind()[i].sum().item())


async def test_a_prompt_consumed_before_a_restart_is_not_brought_back(nc, js, log_config, tmp_path, partition):
    """A crash after the terminal status was written but before it was recorded: the trainer took the group."""
    (script,) = workload(prompts=1, n=1, seed=1)
    ledger = await PromptLedger(KvStore(js, log_config.prompts_bucket, timeout=5.0)).bind()
    crashed = PromptProgress(uid="q00000", expected=1, global_steps=4, published="running", publishing="finished",
                             outcomes={"0": SessionOutcome(script.session_id, True)})
    await ledger.save(crashed, 0)
    from materializer.ledger import Markers
    from materializer.records import derive_records
    from schemas.records import MaterializedMarker, record_digest
    from session.fold import fold

    markers = await Markers(KvStore(js, log_config.markers_bucket, timeout=5.0)).bind()
    state = fold(script.events)
    await markers.create_marker(MaterializedMarker(
        session_id=script.session_id, stream_seq=1, uid=state.uid, session_index=0,
        digests={r.key: record_digest(r) for r in derive_records(state)}))
    async with materializing(nc, log_config, tmp_path, partition):
        await append(JetStreamLog(nc, log_config), script)
        await _drained(js, log_config, 1)
    assert tq.kv_list(partition_id=partition).get(partition, {}) == {}  # not resurrected
    (progress, _), = (await ledger.load(["q00000"])).values()
    assert progress.published == "finished" and progress.publishing == ""


async def test_aborted_prompt_fails_and_late_sessions_stay_out_of_transfer_queue(nc, js, log_config, tmp_path,
                                                                                partition):
    scripts = [s for s in workload(prompts=4, n=2, seed=3) if s.session_id[:16] in ("0" * 15 + "3", "0" * 16)]
    extra = msgspec.structs.replace  # a third session of a prompt that expects two
    late = workload(prompts=1, n=3, seed=3)[2]
    late.events[0] = extra(late.events[0], metadata={"global_steps": 4, "rollout_n": 2})
    log = JetStreamLog(nc, log_config)
    async with materializing(nc, log_config, tmp_path, partition) as sink:
        for script in scripts:
            await append(log, script)
        await _drained(js, log_config, len(scripts))
        await append(log, late)
        await _drained(js, log_config, len(scripts) + 1)
    rows, prompts = tq_partition(partition)
    assert prompts["q00003"]["status"] == "failure" and prompts["q00000"]["status"] == "finished"
    assert not any(key.startswith("q00000_2_") for key in rows)
    assert any(row["key"].startswith("q00000_2_") for row in parquet_rows(sink.directory))  # kept in the dataset


async def test_a_ray_reward_worker_scores_sessions_without_a_task_reward(nc, js, log_config, tmp_path, partition):
    """A Ray actor with verl's reward-worker contract (``compute_score.remote(data) -> {"reward_score", ...}``)."""
    import ray

    from reward.scorer import RewardLoopScorer

    @ray.remote(num_cpus=0)
    class Judge:
        def compute_score(self, data):
            return {"reward_score": 0.5 + 0.01 * len(data["responses"]), "reward_extra_info": {"judge": "ray"}}

    scorer = RewardLoopScorer([Judge.remote()], build_input=lambda r: {"responses": r.trajectory.responses.tolist()})
    scripts = [s for s in workload(prompts=2, n=2, seed=6) if s.session_id[:16] == "0" * 16]
    log = JetStreamLog(nc, log_config)
    stop = asyncio.Event()
    sink = ParquetSink(tmp_path / "trajectories")
    materializer = Materializer(JetStreamPort(nc, log_config), sink, tq=TransferQueueSink(partition), scorer=scorer,
                                options=MaterializerOptions(max_delay=0.1, transfer_queue=True))
    tasks = [asyncio.ensure_future(Projector(JetStreamPort(nc, log_config)).run(stop)),
             asyncio.ensure_future(materializer.run(stop))]
    for script in scripts:
        kept = [e for e in script.events if type(e).__name__ != "RewardReported"]  # no task reward
        script.events = [msgspec.structs.replace(e, seq=i + 1) for i, e in enumerate(kept)]
        await append(log, script)
    await _drained(js, log_config, len(scripts))
    stop.set()
    await asyncio.gather(*tasks)
    rows = parquet_rows(sink.directory)
    final = {}  # session -> its last trajectory, the one the scorer saw
    for row in sorted(rows, key=lambda r: r["trajectory_index"]):
        final[row["session_id"]] = row
    assert len(final) == len(scripts)
    for row in rows:
        assert row["reward_source"] == "scorer" and row["reward_extra_info"] == {"judge": "ray"}
        assert row["reward"] == pytest.approx(0.5 + 0.01 * final[row["session_id"]]["response_len"])
