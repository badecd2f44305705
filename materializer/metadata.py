"""The session metadata the materializer reads: ``SessionOpened.metadata`` (``state.metadata``).

The materializer decides everything from the log alone, so that a restarted materializer
reaches the same results; whoever opens a session (verl's rollout adapter) puts what it
must know into the session's metadata. Every key is optional: absent, the materializer's
own configuration applies.

=========================== ================================ =====================================================
key                         type                             effect
=========================== ================================ =====================================================
``rollout_n``               int >= 1                         sessions the prompt expects (else ``--rollout-n``)
``global_steps``            int                              tags the prompt key and its trajectories (else 0)
``tq_partition``            non-empty str                    TransferQueue partition of the prompt's key and
                                                             trajectories (else ``--tq-partition``)
``attempt``                 int                              the prompt's dispatch attempt (else 0): see
                                                             :mod:`materializer.prompts`
``prompt_status_rule``      ``any_success``/``all_success``  how the terminal status is decided (else
                                                             ``any_success``)
``trajectory_selection``    ``all``/``longest``              this session's :class:`RecordOptions` (else the
``mask_unfinished_episode`` bool                             materializer's); its marker records what was used
=========================== ================================ =====================================================

The prompt-level keys (``rollout_n``, ``global_steps``, ``tq_partition``,
``prompt_status_rule``) are read from the first session of an attempt the materializer
sees and kept in the prompt's progress; the other sessions of that attempt follow it.
A value of the wrong type is logged as a warning and the default used: one badly opened
session never fails a batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from materializer.prompts import STATUS_RULES, PromptProgress, StatusRule
from materializer.records import RecordOptions
from session.fold import SessionState

log = logging.getLogger(__name__)

SELECTIONS: tuple[str, ...] = ("all", "longest")
T = TypeVar("T")


class SessionKeys(msgspec.Struct, frozen=True, kw_only=True):
    """What a session's metadata decides, defaults applied."""

    rollout_n: int
    global_steps: int
    partition: str
    attempt: int
    rule: StatusRule
    options: RecordOptions

    def progress(self, uid: str) -> PromptProgress:
        """The progress of this session's attempt, before any session is counted."""
        return PromptProgress(uid=uid, expected=self.rollout_n, global_steps=self.global_steps, attempt=self.attempt,
                              rule=self.rule, partition=self.partition)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _pick(state: SessionState, key: str, default: T, ok: Callable[[Any], bool], accepted: str) -> T:
    """``metadata[key]`` when present and ``ok``, else ``default`` (with a warning when present)."""
    if key not in state.metadata:
        return default
    value = state.metadata[key]
    if ok(value):
        return value
    log.warning("session %s: %s=%r is not %s; using %r", state.session_id, key, value, accepted, default)
    return default


def read_keys(state: SessionState, *, rollout_n: int, partition: str, options: RecordOptions) -> SessionKeys:
    """The session's keys, with the materializer's defaults for the absent or invalid ones."""
    return SessionKeys(
        rollout_n=_pick(state, "rollout_n", rollout_n, lambda v: _is_int(v) and v >= 1, "a positive integer"),
        global_steps=_pick(state, "global_steps", 0, _is_int, "an integer"),
        partition=_pick(state, "tq_partition", partition, lambda v: isinstance(v, str) and bool(v),
                        "a partition name"),
        attempt=_pick(state, "attempt", 0, _is_int, "an integer"),
        rule=_pick(state, "prompt_status_rule", "any_success", lambda v: v in STATUS_RULES,
                   " or ".join(STATUS_RULES)),
        options=record_options(state, options),
    )


def record_options(state: SessionState, options: RecordOptions) -> RecordOptions:
    """``options`` with this session's ``trajectory_selection`` and ``mask_unfinished_episode``."""
    selection = _pick(state, "trajectory_selection", options.trajectory_selection, lambda v: v in SELECTIONS,
                      " or ".join(SELECTIONS))
    mask = _pick(state, "mask_unfinished_episode", options.mask_unfinished_episode,
                 lambda v: isinstance(v, bool), "a boolean")
    if (selection, mask) == (options.trajectory_selection, options.mask_unfinished_episode):
        return options
    return RecordOptions(trajectory_selection=selection, mask_unfinished_episode=mask)
