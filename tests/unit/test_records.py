import json

import msgspec
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from materializer.records import RecordOptions, derive_records
from schemas.events import ForkPoint, RewardInfo
from schemas.records import TRAJECTORY_SCHEMA, record_digest, records_to_table
from session.fold import fold
from tests.helpers import SessionScript


def _session(reward: float | None = 2.5, **extra: object):
    script = SessionScript(uid="u7", session_index=1)
    script.turn(0, [10, 11, 12], [20, 21], new_chain=True, logprobs=[-0.1, -0.2], chat_turns=1)
    script.turn(0, [30, 31], [40], logprobs=[-0.3], n_messages=4, tip="t2", chat_turns=1)
    script.turn(1, [50, 51], [60, 61, 62], new_chain=True, logprobs=[-1.0, -1.5, -2.0])
    script.close(1)
    script.reward(reward, **extra)
    script.finalize()
    return fold(script.events)


def test_records_follow_the_contract():
    first, second = derive_records(_session(acc=1.0))
    assert first.key == "u7_1_0" and second.key == "u7_1_1"
    assert first.prompts.tolist() == [10, 11, 12]
    assert first.responses.tolist() == [20, 21, 30, 31, 40]
    assert first.input_ids.tolist() == [10, 11, 12, 20, 21, 30, 31, 40]
    assert first.response_mask.tolist() == [1, 1, 0, 0, 1]
    assert first.loss_mask.tolist() == first.response_mask.tolist()
    np.testing.assert_allclose(first.rollout_log_probs, [-0.1, -0.2, 0.0, 0.0, -0.3], rtol=1e-6)
    assert first.rm_scores.tolist() == [0, 0, 0, 0, 2.5]
    assert first.attention_mask.tolist() == [1] * 8 and first.position_ids.tolist() == list(range(8))
    assert first.num_turns == 1 + 1 + 1 + 1 + 1  # user, assistant, user, assistant, +1
    assert first.materialization_reason is None and second.materialization_reason == "max_trajectory_length"
    assert first.reward_extra_info == {"acc": 1.0} and first.global_steps == 3
    assert first.tags() == {"status": "success", "prompt_len": 3, "response_len": 5, "seq_len": 8,
                            "global_steps": 3, "min_global_steps": 3, "max_global_steps": 3, "uid": "u7"}
    assert first.metadata == {"global_steps": 3} and first.agent_name == "agent" and first.reward_source == "task"
    assert second.tags()["materialization_reason"] == "max_trajectory_length"


def test_missing_reward_is_zero():
    (first, _) = derive_records(_session(reward=None))
    assert first.reward == 0.0 and not first.rm_scores.any()


def test_mask_unfinished_episode_zeroes_the_loss_mask():
    first, _ = derive_records(_session(finished=False), RecordOptions(mask_unfinished_episode=True))
    assert not first.loss_mask.any() and not first.response_mask.any()
    assert "finished" not in first.reward_extra_info


def test_missing_logprobs_drop_the_field():
    script = SessionScript()
    script.turn(0, [1], [2], new_chain=True)
    state = fold(script.events)
    chain = state.chains[0]
    import msgspec

    bare = msgspec.structs.replace(chain.segments[0], logprobs=None)
    state = msgspec.structs.replace(state, chains=(msgspec.structs.replace(chain, segments=(bare,)),))
    (record,) = derive_records(state)
    assert record.rollout_log_probs is None


def test_table_uses_the_declared_schema_and_reads_back(tmp_path):
    records = derive_records(_session(acc=1.0))
    table = records_to_table(records)
    assert table.schema.equals(TRAJECTORY_SCHEMA)
    pq.write_table(table, tmp_path / "r.parquet")
    back = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert back[0]["input_ids"] == records[0].input_ids.tolist()
    assert back[1]["rm_scores"] == records[1].rm_scores.tolist()
    assert json.loads(back[0]["reward_extra_info"]) == {"acc": 1.0}
    frame = pl.read_parquet(tmp_path / "r.parquet")
    assert frame["key"].to_list() == ["u7_1_0", "u7_1_1"]
    assert frame["response_mask"][0].to_list() == [1, 1, 0, 0, 1]


def test_table_marks_absent_logprobs_null():
    records = derive_records(_session())
    import msgspec

    records[1] = msgspec.structs.replace(records[1], rollout_log_probs=None)
    column = records_to_table(records).column("rollout_log_probs")
    assert column.null_count == 1 and column[0].as_py() is not None
    assert isinstance(column.type, pa.ListType)


def test_record_digest_changes_with_any_trained_value():
    import msgspec

    from schemas.records import record_digest

    first, second = derive_records(_session(acc=1.0))
    again, _ = derive_records(_session(acc=1.0))
    assert record_digest(first) == record_digest(again) != record_digest(second)
    flipped = first.loss_mask.copy()
    flipped[0] ^= 1
    assert record_digest(msgspec.structs.replace(first, loss_mask=flipped)) != record_digest(first)
    assert record_digest(msgspec.structs.replace(first, reward=0.0)) != record_digest(first)


def test_longest_selection_keeps_the_chain_with_most_sampled_tokens_and_its_index():
    state = _session(acc=1.0)
    (only,) = derive_records(state, RecordOptions(trajectory_selection="longest"))
    assert only.key == "u7_1_0" and only.trajectory_index == 0  # 3 sampled tokens each: 5 response tokens win
    script = SessionScript(uid="u8")
    script.turn(0, [1], [2], new_chain=True)
    script.turn(1, [3], [4, 5, 6], new_chain=True)
    script.finalize()
    (longest,) = derive_records(fold(script.events), RecordOptions(trajectory_selection="longest"))
    assert longest.key == "u8_0_1" and longest.responses.tolist() == [4, 5, 6]


def test_weight_versions_give_the_global_steps_span():
    script = SessionScript()
    script.turn(0, [1], [2], new_chain=True)
    events = list(script.events)
    import msgspec

    events[-1] = msgspec.structs.replace(events[-1], weight_version="7")
    script.events = events
    script.turn(0, [3], [4], n_messages=4, tip="t2")
    script.events[-1] = msgspec.structs.replace(script.events[-1], weight_version="9")
    script.finalize()
    (record,) = derive_records(fold(script.events))
    assert (record.min_global_steps, record.max_global_steps) == (7, 9)
    assert record.tags()["min_global_steps"] == 7 and record.tags()["max_global_steps"] == 9


def test_a_turn_sampled_across_a_weight_update_widens_the_span():
    from materializer.records import version_span

    assert version_span("3") == (3, 3) and version_span("3..4") == (3, 4) and version_span("4..3") == (3, 4)
    for other in ("scripted", "global_step_17", "3..", "..4", "3..4..5", "-1", "\u00b2", "", None):
        assert version_span(other) is None, other
    script = SessionScript(metadata={"global_steps": 5})
    for turn, version in enumerate(("3", "3..4", "scripted", "4")):
        script.turn(0, [turn], [turn + 10], new_chain=turn == 0, n_messages=2 + 2 * turn, tip=f"t{turn}")
        script.events[-1] = msgspec.structs.replace(script.events[-1], weight_version=version)
    script.turn(1, [9], [9], new_chain=True, tip="other")
    script.events[-1] = msgspec.structs.replace(script.events[-1], weight_version="scripted")
    script.finalize()
    spanned, unversioned = derive_records(fold(script.events))
    assert (spanned.min_global_steps, spanned.max_global_steps) == (3, 4)
    assert (unversioned.min_global_steps, unversioned.max_global_steps) == (5, 5)  # the session's global_steps
    assert all(type(r.tags()[k]) is int for r in (spanned, unversioned) for k in ("min_global_steps",
                                                                                   "max_global_steps"))


def test_a_reward_posted_after_the_end_changes_nothing():
    script = SessionScript()
    script.turn(0, [1], [2], new_chain=True)
    script.reward(1.0)
    script.finalize()
    script.reward(5.0, acc=0.0)
    state = fold(script.events)
    assert state.reward is not None and state.reward.reward == 1.0 and state.seq == len(script.events)
    (record,) = derive_records(state)
    assert record.reward == 1.0 and record.rm_scores.tolist() == [1.0]


async def test_a_scorer_scores_the_final_trajectory_when_the_task_posted_no_reward():
    from materializer.records import derive_scored
    from reward.scorer import FunctionScorer, ScoreResult

    seen = []

    async def score(request):
        seen.append(request)
        return ScoreResult(reward=0.75, extra={"judge": "ok"})

    records, decision = await derive_scored(_session(reward=None, acc=1.0), RecordOptions(), FunctionScorer(score))
    (request,) = seen
    assert request.trajectory.key == "u7_1_1" and request.trajectory.reward == 0.0
    assert request.reward_info == RewardInfo(extra={"acc": 1.0}) and request.metadata == {"global_steps": 3}
    assert decision.source == "scorer" and [r.reward for r in records] == [0.75, 0.75]
    assert records[0].reward_extra_info == {"acc": 1.0, "judge": "ok"} and records[0].rm_scores[-1] == 0.75
    posted, _ = await derive_scored(_session(reward=2.0), RecordOptions(), FunctionScorer(score))
    assert len(seen) == 1 and posted[0].reward == 2.0 and posted[0].reward_source == "task"


async def test_rederive_reproduces_the_digests_a_marker_recorded():
    from materializer.records import derive_scored, rederive
    from reward.scorer import FunctionScorer, ScoreResult
    from schemas.records import MaterializedMarker, record_digest

    options = RecordOptions(trajectory_selection="longest", mask_unfinished_episode=True)
    for state, scorer in ((_session(reward=None, finished=False), FunctionScorer(lambda r: ScoreResult(
            reward=0.3, extra={"judge": 1}))), (_session(acc=1.0), None)):
        records, reward = await derive_scored(state, options, scorer)
        marker = MaterializedMarker(session_id=state.session_id, stream_seq=1,
                                    digests={r.key: record_digest(r) for r in records}, reward=reward.reward,
                                    reward_source=reward.source, reward_extra_info=reward.extra,
                                    options=options)
        again = rederive(state, msgspec.json.decode(msgspec.json.encode(marker), type=MaterializedMarker))
        assert {r.key: record_digest(r) for r in again} == marker.digests


def test_records_say_where_each_chain_forked_from_and_parquet_keeps_it(tmp_path):
    script = SessionScript(uid="u7", session_index=1)
    script.turn(0, [10, 11, 12], [20, 21], new_chain=True, fork=ForkPoint(cause="new_conversation"))
    sibling = ForkPoint(cause="sibling", parent=0, message_index=2, token_offset=3)
    script.turn(1, [10, 11, 12], [22], new_chain=True, fork=sibling)
    script.turn(2, [50], [60], new_chain=True, fork=ForkPoint(cause="sub_agent", parent=1, token_offset=0))
    script.finalize()
    root, second, third = derive_records(fold(script.events))
    assert (root.parent_key, root.fork_cause) == ("", "new_conversation")
    assert (second.parent_key, second.fork_message_index, second.fork_token_offset, second.fork_cause) == \
        ("u7_1_0", 2, 3, "sibling")
    assert (third.parent_key, third.fork_cause) == ("u7_1_1", "sub_agent")
    pq.write_table(records_to_table([root, second, third]), tmp_path / "f.parquet")
    rows = pl.read_parquet(tmp_path / "f.parquet").select(
        ["parent_key", "fork_message_index", "fork_token_offset", "fork_cause"]).rows()
    assert rows == [("", 0, 0, "new_conversation"), ("u7_1_0", 2, 3, "sibling"), ("u7_1_1", 0, 0, "sub_agent")]


def test_a_log_without_forks_gives_null_fork_columns_and_the_digests_it_had():
    records = derive_records(_session())
    assert all(r.fork_cause == "" and r.parent_key == "" for r in records)
    table = records_to_table(records)
    assert table.column("fork_cause").null_count == len(records) == table.column("parent_key").null_count
    forked = msgspec.structs.replace(records[0], fork_cause="sibling")
    assert record_digest(forked) != record_digest(records[0])
