"""The typed structs of what the log and the sinks keep (session settings, reward info, record options):
they read what was written before them, and what they write is what was written before them: the same
MessagePack value, keys in the same order (not always the same bytes: ``session_opened`` has more than 15
fields, some absent when UNSET, and msgspec then writes a 16-bit map header for the 15 it writes).

``_V2_ENVELOPE`` was encoded by the code before these structs (schema v2): a ``session_opened`` whose
metadata carries settings and the task's own keys, a ``turn_completed`` with a tool call, and two
``reward_reported`` (a task reward with extra info, and extra info only with ``finished: false``).
"""

from __future__ import annotations

import base64

import msgspec
import pytest
from msgspec import UNSET

from reward.intake import parse_reward_info, reward_info_of
from reward.precedence import decide_reward
from schemas import envelope
from schemas.events import (
    SCHEMA_VERSION,
    AnyEvent,
    RewardInfo,
    RewardReported,
    SessionOpened,
    ToolCall,
    TurnCompleted,
)
from schemas.metadata import EXPECTED, InvalidSetting, SessionSettings, or_default, read_settings
from schemas.records import MaterializedMarker, RecordOptions

_V2_ENVELOPE = base64.b64decode(
    "lI+kdHlwZa5zZXNzaW9uX29wZW5lZKpzZXNzaW9uX2lk2SAwMTIzNDU2Nzg5YWJjZGVmMDEyMzQ1Njc4OWFiY2RlZqNzZXEBpHRp"
    "bWXLP/gAAAAAAAChdgKjdWlkonUxrXNlc3Npb25faW5kZXgCqmFnZW50X25hbWWkY2FsY6htZXRhZGF0YYurZGF0YV9zb3VyY2Wy"
    "cm9sbGJ1cy9hcml0aG1ldGljqnJhd19wcm9tcHSRgqRyb2xlpHVzZXKnY29udGVudKQxKzE/qmFnZW50X25hbWWkY2FsY6lyb2xs"
    "b3V0X24Ep2F0dGVtcHTPGAzaUXscTRWsZ2xvYmFsX3N0ZXBzDKx0cV9wYXJ0aXRpb26ldHJhaW6ycHJvbXB0X3N0YXR1c19ydWxl"
    "q2FueV9zdWNjZXNztHRyYWplY3Rvcnlfc2VsZWN0aW9up2xvbmdlc3S3bWFza191bmZpbmlzaGVkX2VwaXNvZGXDpWluZGV4B6hz"
    "YW1wbGluZ4KrdGVtcGVyYXR1cmXLP/AAAAAAAACqbWF4X3Rva2Vuc0CuYXBpX2tleV9kaWdlc3TZQGFiYWJhYmFiYWJhYmFiYWJh"
    "YmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWK1bWF4X3RyYWplY3RvcnlfbGVuZ3RozRAAqXRv"
    "a2VuaXplcq9idWlsdGluOnF3ZW4yLjWrdG9vbF9mb3JtYXSmaGVybWVzp2VkZ2VfaWSgjqR0eXBlrnR1cm5fY29tcGxldGVkqnNl"
    "c3Npb25faWTZIDAxMjM0NTY3ODlhYmNkZWYwMTIzNDU2Nzg5YWJjZGVmo3NlcQKkdGltZctAAAAAAAAAAKF2AqVjaGFpbgCqcmVx"
    "dWVzdF9ubwGtZmluaXNoX3JlYXNvbqRzdG9wpHRleHSgqXJlYXNvbmluZ8CqdG9vbF9jYWxsc5GDomlkqGNhbGxfMV8wpG5hbWWj"
    "YWRkqWFyZ3VtZW50c7B7ImEiOiAxLCAiYiI6IDF9qnRpcF9kaWdlc3TZQGNkY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNk"
    "Y2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNkY2Sqbl9tZXNzYWdlcwOud2VpZ2h0X3ZlcnNpb27AiKR0eXBlr3Jld2FyZF9y"
    "ZXBvcnRlZKpzZXNzaW9uX2lk2SAwMTIzNDU2Nzg5YWJjZGVmMDEyMzQ1Njc4OWFiY2RlZqNzZXEDpHRpbWXLQAgAAAAAAAChdgKm"
    "cmV3YXJkyz/wAAAAAAAApWV4dHJhg6hmaW5pc2hlZMOjYWNjyz/wAAAAAAAApXRyYWNlgaVzdGVwc5IBAqZzb3VyY2WkdGFza4ik"
    "dHlwZa9yZXdhcmRfcmVwb3J0ZWSqc2Vzc2lvbl9pZNkgMDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWajc2VxBKR0aW1l"
    "y0AMAAAAAAAAoXYCpnJld2FyZMClZXh0cmGCo2FjY8sAAAAAAAAAAKhmaW5pc2hlZMKmc291cmNlpHRhc2s="
)
_SID = "0123456789abcdef0123456789abcdef"
_TASK = {"data_source": "rollbus/arithmetic", "raw_prompt": [{"role": "user", "content": "1+1?"}], "agent_name": "calc"}
_SETTINGS = SessionSettings(rollout_n=4, attempt=1_733_000_000_123_456_789, global_steps=12, tq_partition="train",
                            prompt_status_rule="any_success", trajectory_selection="longest",
                            mask_unfinished_episode=True)


def _events() -> list[AnyEvent]:
    return envelope.decode(_V2_ENVELOPE, SCHEMA_VERSION)


def test_an_envelope_written_before_the_typed_structs_decodes_and_encodes_again_as_it_was():
    events = _events()
    assert [type(e) for e in events] == [SessionOpened, TurnCompleted, RewardReported, RewardReported]
    again, before = msgspec.msgpack.decode(envelope.encode(events)), msgspec.msgpack.decode(_V2_ENVELOPE)
    assert again == before and [list(e) for e in again] == [list(e) for e in before]
    assert events[1].tool_calls == (ToolCall(id="call_1_0", name="add", arguments='{"a": 1, "b": 1}'),)


def test_the_settings_of_a_logged_session_are_typed_and_its_task_keys_left_to_the_task():
    opened = _events()[0]
    assert isinstance(opened, SessionOpened)
    assert read_settings(opened.metadata) == (_SETTINGS, ())
    assert read_settings(_TASK) == (SessionSettings(), ())
    assert or_default(SessionSettings().rollout_n, 3) == 3 and or_default(_SETTINGS.rollout_n, 3) == 4


def test_settings_put_into_metadata_write_the_same_event_as_the_map_did():
    settings = _SETTINGS.to_metadata()
    assert list(settings) == ["rollout_n", "attempt", "global_steps", "tq_partition", "prompt_status_rule",
                              "trajectory_selection", "mask_unfinished_episode"]
    assert msgspec.msgpack.encode(_SETTINGS) == msgspec.msgpack.encode(settings)
    assert SessionSettings(global_steps=0).to_metadata() == {"global_steps": 0}  # only what is set
    opened = _events()[0]
    rebuilt = msgspec.structs.replace(opened, metadata={**_TASK, **settings, "index": 7})
    assert envelope.encode([rebuilt]) == envelope.encode([opened])
    assert msgspec.convert(settings, SessionSettings) == _SETTINGS


def test_each_invalid_setting_is_named_with_what_it_must_be_and_the_valid_ones_kept():
    metadata = {"rollout_n": 0, "attempt": None, "global_steps": 2**63, "tq_partition": "", "agent_name": 3,
                "prompt_status_rule": "any", "trajectory_selection": "all", "mask_unfinished_episode": 0}
    settings, invalid = read_settings(metadata)
    assert settings == SessionSettings(trajectory_selection="all")
    assert [(bad.key, bad.value) for bad in invalid] == [
        ("rollout_n", 0), ("attempt", None), ("global_steps", 2**63), ("tq_partition", ""),
        ("prompt_status_rule", "any"), ("mask_unfinished_episode", 0)]
    assert invalid[0] == InvalidSetting(key="rollout_n", value=0, expected=EXPECTED["rollout_n"])
    assert invalid[0].expected == f"an integer from 1 to {2**63 - 1}"


@pytest.mark.parametrize(("key", "value"), [("rollout_n", True), ("global_steps", 1.0), ("attempt", "3"),
                                            ("tq_partition", ["train"]), ("trajectory_selection", "shortest")])
def test_a_setting_of_the_wrong_type_is_never_coerced(key, value):
    settings, invalid = read_settings({key: value})
    assert getattr(settings, key) is UNSET and [bad.key for bad in invalid] == [key]


def test_logged_rewards_read_as_typed_reward_info():
    _, _, task, extra_only = _events()
    assert isinstance(task, RewardReported) and isinstance(extra_only, RewardReported)
    assert reward_info_of(task) == RewardInfo(reward=1.0, finished=True, extra={"acc": 1.0, "trace": {"steps": [1, 2]}})
    assert reward_info_of(extra_only) == RewardInfo(finished=False, extra={"acc": 0.0})
    assert reward_info_of(extra_only).unfinished and not reward_info_of(task).unfinished
    assert reward_info_of(None) == RewardInfo() and not RewardInfo().unfinished
    odd = msgspec.structs.replace(task, extra={"finished": "no", "acc": 1})  # a log not written by the edge
    assert reward_info_of(odd) == RewardInfo(reward=1.0, extra={"acc": 1})
    decided = decide_reward(extra_only, _SID)
    assert (decided.reward, decided.extra, decided.unfinished) == (0.0, {"acc": 0.0}, True)


def test_a_posted_reward_info_is_logged_as_before_and_reads_the_same_typed():
    logged = _events()[2]
    posted = parse_reward_info({"reward": 1, "finished": True, "acc": 1.0, "trace": {"steps": [1, 2]}})
    event = RewardReported(session_id=_SID, seq=3, time=3.0, reward=posted.reward, extra=posted.extra)
    assert envelope.encode([event]) == envelope.encode([logged])
    assert reward_info_of(posted) == reward_info_of(logged)
    info = reward_info_of(posted)
    assert msgspec.json.decode(msgspec.json.encode(info), type=RewardInfo) == info


def test_a_marker_keeps_its_record_options_typed_as_it_stored_them():
    stored = (b'{"session_id":"' + _SID.encode() + b'","stream_seq":9,"digests":{"u1_2_0":"' + b"ef" * 32
              + b'"},"sinks":[],"status":"finalized","uid":"u1","session_index":2,"attempt":0,"parquet_file":null,'
              b'"reward":1.0,"reward_source":"task","reward_extra_info":{"acc":1.0},'
              b'"options":{"mask_unfinished_episode":true,"trajectory_selection":"longest"}}')
    marker = msgspec.json.decode(stored, type=MaterializedMarker)
    assert marker.options == RecordOptions(mask_unfinished_episode=True, trajectory_selection="longest")
    assert msgspec.json.encode(marker) == stored
    older = msgspec.json.decode(b'{"session_id":"s","stream_seq":1,"digests":{},"options":{}}', type=MaterializedMarker)
    oldest = msgspec.json.decode(b'{"session_id":"s","stream_seq":1,"digests":{}}', type=MaterializedMarker)
    assert older.options == oldest.options == RecordOptions()
