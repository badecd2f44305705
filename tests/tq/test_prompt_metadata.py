"""Per-session metadata against a real TransferQueue: partitions, re-issued attempts, the status rule.

verl's adapter opens sessions with ``tq_partition`` (``val`` for validation batches),
``attempt`` (a re-issued uid is a newer attempt) and ``prompt_status_rule``; what
lands in each partition is read back the way verl's replay buffer reads it.
"""

from __future__ import annotations

import transfer_queue as tq

from materializer.parquet import ParquetSink
from materializer.tq_fields import prompt_tag
from materializer.transfer_queue import TransferQueueSink
from tests.integration.test_materializer import appended, batch_writer, progress_of, prompt_session
from tests.tq.readers import parquet_rows, tq_partition

OLD, NEW = 1_733_000_000_000_000_000, 1_733_000_000_500_000_000  # attempts, as time.time_ns() at dispatch


async def _writer(js, cfg, tmp_path, partition):
    return await batch_writer(js, cfg, ParquetSink(tmp_path / "trajectories"), tq=TransferQueueSink(partition))


def _sessions(rows):
    return {key: row["session_id"] for key, row in rows.items()}


def _statuses(prompts):
    return {uid: tag["status"] for uid, tag in prompts.items()}


async def test_records_and_statuses_go_to_the_partition_their_session_names(nc, js, log_config, tmp_path, partition):
    val = f"{partition}val"
    train = [prompt_session("a1", i, rollout_n=2) for i in range(2)]
    valid = [prompt_session("b1", i, rollout_n=2, chains=2, tq_partition=val) for i in range(2)]
    writer = await _writer(js, log_config, tmp_path, partition)
    await writer.write(await appended(nc, log_config, train[0], valid[0], train[1], valid[1]))  # one batch
    rows, prompts = tq_partition(partition)
    val_rows, val_prompts = tq_partition(val)
    assert _statuses(prompts) == {"a1": "finished"} and _statuses(val_prompts) == {"b1": "finished"}
    assert _sessions(rows) == {"a1_0_0": train[0].session_id, "a1_1_0": train[1].session_id}
    assert _sessions(val_rows) == {f"b1_{i}_{t}": valid[i].session_id for i in range(2) for t in range(2)}
    assert (await progress_of(js, log_config, "b1")).partition == val
    assert (await progress_of(js, log_config, "a1")).partition == partition  # the sink's, as configured


async def test_a_reissued_uid_makes_a_clean_group_of_its_new_attempt(nc, js, log_config, tmp_path, partition):
    old = [prompt_session("r1", i, rollout_n=4, attempt=OLD, chains=2) for i in range(2)]
    new = [prompt_session("r1", i, rollout_n=4, attempt=NEW) for i in range(4)]
    writer = await _writer(js, log_config, tmp_path, partition)
    await writer.write(await appended(nc, log_config, old[0]))
    rows, prompts = tq_partition(partition)
    assert sorted(rows) == ["r1_0_0", "r1_0_1"] and _statuses(prompts) == {"r1": "running"}
    # verl resumes: it clears the uid's trajectories, marks the prompt pending and re-issues it
    tq.kv_clear(keys=sorted(rows), partition_id=partition)
    tq.kv_batch_put(keys=["r1"], partition_id=partition, tags=[prompt_tag("pending", 4)])
    await writer.write(await appended(nc, log_config, *new[:3]))
    rows, prompts = tq_partition(partition)
    assert _statuses(prompts) == {"r1": "running"}  # tagged again, and not done: old[0] is not counted
    await writer.write(await appended(nc, log_config, new[3]))
    rows, prompts = tq_partition(partition)
    assert _statuses(prompts) == {"r1": "finished"}
    assert _sessions(rows) == {f"r1_{i}_0": new[i].session_id for i in range(4)}  # the whole group, nothing older
    await writer.write(await appended(nc, log_config, old[1]))  # the old attempt's straggler ends
    assert tq_partition(partition) == (rows, prompts)
    progress = await progress_of(js, log_config, "r1")
    assert progress.attempt == NEW and {o.session_id for o in progress.outcomes.values()} == {
        s.session_id for s in new}
    (marker,) = (await writer.markers.get_many([old[1].session_id])).values()
    assert marker.sinks == ("parquet",) and marker.attempt == OLD
    assert {r["session_id"] for r in parquet_rows(tmp_path / "trajectories")} == {s.session_id for s in old + new}


async def test_attempts_mixed_in_one_batch_keep_only_the_newest(nc, js, log_config, tmp_path, partition):
    old = [prompt_session("m1", i, rollout_n=2, attempt=OLD, chains=2) for i in range(2)]
    new = [prompt_session("m1", i, rollout_n=2, attempt=NEW) for i in range(2)]
    writer = await _writer(js, log_config, tmp_path, partition)
    await writer.write(await appended(nc, log_config, old[0], new[0], old[1], new[1]))
    rows, prompts = tq_partition(partition)
    assert _statuses(prompts) == {"m1": "finished"}
    assert _sessions(rows) == {"m1_0_0": new[0].session_id, "m1_1_0": new[1].session_id}


async def test_all_success_fails_the_group_when_one_session_was_aborted(nc, js, log_config, tmp_path, partition):
    strict = [prompt_session("s1", i, rollout_n=3, abort=i == 2, prompt_status_rule="all_success")
              for i in range(3)]
    lenient = [prompt_session("s2", i, rollout_n=3, abort=i == 2) for i in range(3)]
    writer = await _writer(js, log_config, tmp_path, partition)
    await writer.write(await appended(nc, log_config, *strict, *lenient))
    rows, prompts = tq_partition(partition)
    assert _statuses(prompts) == {"s1": "failure", "s2": "finished"}
    assert sorted(rows) == ["s1_0_0", "s1_1_0", "s2_0_0", "s2_1_0"]  # the successful sessions' records are written


async def test_a_session_may_choose_the_longest_trajectory(nc, js, log_config, tmp_path, partition):
    scripts = [prompt_session("l1", 0, rollout_n=2, chains=3, trajectory_selection="longest"),
               prompt_session("l1", 1, rollout_n=2, chains=3)]
    writer = await _writer(js, log_config, tmp_path, partition)
    await writer.write(await appended(nc, log_config, *scripts))
    rows, _ = tq_partition(partition)
    assert sorted(rows) == ["l1_0_2", "l1_1_0", "l1_1_1", "l1_1_2"]
    assert rows["l1_0_2"]["responses"] == [7, 7, 7]


async def test_an_old_attempts_straggler_after_the_redispatch_stays_out_of_transfer_queue(nc, js, log_config, tmp_path,
                                                                                           partition):
    """The gap the sessions alone leave: verl cleared the group and re-issued it, and an old session ends
    before any session of the new attempt did. The dispatcher recorded the new attempt first."""
    from eventlog.kv import KvStore
    from materializer.ledger import PromptLedger
    from materializer.prompts import PromptProgress

    old = [prompt_session("s1", i, rollout_n=2, attempt=OLD) for i in range(2)]
    new = [prompt_session("s1", i, rollout_n=2, attempt=NEW) for i in range(2)]
    writer = await _writer(js, log_config, tmp_path, partition)
    await writer.write(await appended(nc, log_config, old[0]))
    tq.kv_clear(keys=["s1_0_0"], partition_id=partition)  # verl's resume
    tq.kv_batch_put(keys=["s1"], partition_id=partition, tags=[prompt_tag("pending", 4)])
    ledger = await PromptLedger(KvStore(js, log_config.prompts_bucket, timeout=5.0)).bind()
    fresh = PromptProgress(uid="s1", expected=2, attempt=NEW, partition=partition)
    assert await ledger.start_attempt(fresh) and not await ledger.start_attempt(fresh)  # once
    await writer.write(await appended(nc, log_config, old[1]))  # the straggler
    rows, prompts = tq_partition(partition)
    assert rows == {} and _statuses(prompts) == {"s1": "running"}  # the new attempt is in flight
    await writer.write(await appended(nc, log_config, *new))
    rows, prompts = tq_partition(partition)
    assert _sessions(rows) == {f"s1_{i}_0": new[i].session_id for i in range(2)} and _statuses(prompts) == {
        "s1": "finished"}
    older = PromptProgress(uid="s1", expected=2, attempt=OLD, partition=partition)
    assert not await ledger.start_attempt(older)  # an older dispatch never rewinds the prompt
