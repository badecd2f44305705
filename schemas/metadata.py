"""The keys of ``session_opened`` metadata that rollbus itself reads, as one typed struct.

A session's ``metadata`` (``POST /sessions {"metadata": {...}}``) is the opener's and is
logged as given, a free-form map: the task's own fields (``data_source``, ``raw_prompt``,
...) travel with the records. Some keys are settings the materializer decides with (see
``docs/events.md``, *session_opened metadata*): :class:`SessionSettings` types those, each
optional (``UNSET``: absent, the reader's default applies). The log's bytes are the map, never
the struct: a struct encodes as the same map, so :meth:`SessionSettings.to_metadata` is how an
opener puts them in.

:func:`read_settings` reads them from a metadata map: the valid ones, and each invalid one with
what it should have been. The edge refuses a session with an invalid one (400, naming
``metadata.<key>``); the materializer, reading a log written by anyone, warns and uses its
default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from schemas.values import INT64_MAX, INT64_MIN

StatusRule = Literal["any_success", "all_success"]
STATUS_RULES: tuple[StatusRule, ...] = ("any_success", "all_success")
TrajectorySelection = Literal["all", "longest"]
SELECTIONS: tuple[TrajectorySelection, ...] = ("all", "longest")

Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
PositiveInt64 = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]
Name = Annotated[str, msgspec.Meta(min_length=1)]
T = TypeVar("T")


class SessionSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The settings a session's metadata carries; every one optional (``UNSET``: absent)."""

    rollout_n: PositiveInt64 | UnsetType = UNSET  # sessions the prompt expects
    attempt: Int64 | UnsetType = UNSET  # the prompt's dispatch attempt
    global_steps: Int64 | UnsetType = UNSET  # the trainer's step: tags the prompt and its trajectories
    tq_partition: Name | UnsetType = UNSET  # TransferQueue partition of the prompt and its trajectories
    prompt_status_rule: StatusRule | UnsetType = UNSET  # how the prompt's terminal status is decided
    trajectory_selection: TrajectorySelection | UnsetType = UNSET  # this session's record options
    mask_unfinished_episode: bool | UnsetType = UNSET
    # the edge: a request that re-sends the model's replies other than sampled (reasoning dropped, tool calls
    # as text) continues their chain with its logged tokens instead of forking (edge.forks; off when absent)
    continue_reserialized_turns: bool | UnsetType = UNSET

    def to_metadata(self) -> dict[str, object]:
        """The keys that are set, as they go into a session's metadata (in field order)."""
        out: dict[str, object] = msgspec.to_builtins(self)
        return out


SETTING_KEYS: tuple[str, ...] = SessionSettings.__struct_fields__

# What each key must be, in words (a refusal and a warning say it).
EXPECTED: dict[str, str] = {
    "rollout_n": f"an integer from 1 to {INT64_MAX}",
    "attempt": "a 64-bit integer",
    "global_steps": "a 64-bit integer",
    "tq_partition": "a non-empty string",
    "prompt_status_rule": " or ".join(f"'{rule}'" for rule in STATUS_RULES),
    "trajectory_selection": " or ".join(f"'{selection}'" for selection in SELECTIONS),
    "mask_unfinished_episode": "a boolean",
    "continue_reserialized_turns": "a boolean",
}


class InvalidSetting(msgspec.Struct, frozen=True, kw_only=True):
    """A metadata key that names a setting with a value it cannot have."""

    key: str
    value: object
    expected: str  # what it must be, in words (:data:`EXPECTED`)


def read_settings(metadata: Mapping[str, object]) -> tuple[SessionSettings, tuple[InvalidSetting, ...]]:
    """The settings in ``metadata`` (other keys are the task's and ignored), and the invalid ones
    (left ``UNSET`` in the settings), in :data:`SETTING_KEYS` order."""
    present = {key: metadata[key] for key in SETTING_KEYS if key in metadata}
    try:
        return msgspec.convert(present, SessionSettings), ()
    except msgspec.ValidationError:
        pass  # at least one is invalid: find which, key by key
    valid: dict[str, object] = {}
    invalid: list[InvalidSetting] = []
    for key, value in present.items():
        try:
            msgspec.convert({key: value}, SessionSettings)
        except msgspec.ValidationError:
            invalid.append(InvalidSetting(key=key, value=value, expected=EXPECTED[key]))
        else:
            valid[key] = value
    return msgspec.convert(valid, SessionSettings), tuple(invalid)


def or_default(value: T | UnsetType, default: T) -> T:
    """A setting's value, or ``default`` when it is ``UNSET``."""
    return default if isinstance(value, UnsetType) else value


class RecordOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How a session's chains become records (:mod:`materializer.records`); a marker keeps the ones used. Here,
    apart from the records' Parquet schema, so that what only reads options (the CLI's flags) imports no pyarrow."""

    mask_unfinished_episode: bool = False  # zero the masks when reward_info says finished=false
    trajectory_selection: TrajectorySelection = "all"
