"""The session metadata keys the materializer reads: values, defaults, and bad values (a warning, the default)."""

from __future__ import annotations

import logging

import pytest

from materializer.metadata import read_keys, record_options
from materializer.prompts import PromptProgress
from materializer.records import RecordOptions
from session.fold import fold
from tests.helpers import SessionScript

GLOBAL = RecordOptions(trajectory_selection="all", mask_unfinished_episode=False)


def _state(**metadata):
    script = SessionScript(uid="u", metadata=metadata)
    script.finalize()
    return fold(script.events)


def _keys(**metadata):
    return read_keys(_state(**metadata), rollout_n=3, partition="train", options=GLOBAL)


def test_absent_keys_are_the_materializer_s_configuration():
    keys = _keys()
    assert (keys.rollout_n, keys.global_steps, keys.partition, keys.attempt, keys.rule) == (3, 0, "train", 0,
                                                                                           "any_success")
    assert keys.options is GLOBAL


def test_present_keys_decide_the_prompt_and_the_session_s_options():
    keys = _keys(rollout_n=4, global_steps=12, tq_partition="val", attempt=1_733_000_000_123_456_789,
                 prompt_status_rule="all_success", trajectory_selection="longest", mask_unfinished_episode=True)
    assert keys.progress("u") == PromptProgress(uid="u", expected=4, global_steps=12, attempt=1_733_000_000_123_456_789,
                                                rule="all_success", partition="val")
    assert keys.options == RecordOptions(trajectory_selection="longest", mask_unfinished_episode=True)


@pytest.mark.parametrize(("key", "value"), [
    ("rollout_n", 0), ("rollout_n", "4"), ("rollout_n", True), ("global_steps", 1.5), ("tq_partition", ""),
    ("tq_partition", 7), ("attempt", "12"), ("attempt", False), ("prompt_status_rule", "majority"),
    ("trajectory_selection", "shortest"), ("trajectory_selection", ["all"]), ("mask_unfinished_episode", "yes"),
])
def test_a_bad_value_is_a_warning_and_the_default(key, value, caplog):
    with caplog.at_level(logging.WARNING, logger="materializer.metadata"):
        assert _keys(**{key: value}) == _keys()
    assert f"{key}={value!r} is not" in caplog.text


def test_record_options_override_only_what_the_session_names():
    masked = RecordOptions(mask_unfinished_episode=True)
    assert record_options(_state(trajectory_selection="longest"), masked) == RecordOptions(
        trajectory_selection="longest", mask_unfinished_episode=True)
    assert record_options(_state(mask_unfinished_episode=False), masked) == RecordOptions()
