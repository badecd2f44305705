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
session never fails a batch. The keys and their types are :class:`schemas.metadata.SessionSettings`
(the edge refuses a session that has one of the wrong type; a log written by anyone may still).
"""

from __future__ import annotations

import logging

import msgspec

from materializer.prompts import PromptProgress, StatusRule
from materializer.records import RecordOptions
from schemas.metadata import SessionSettings, or_default, read_settings
from session.fold import SessionState

log = logging.getLogger(__name__)


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


def session_settings(state: SessionState) -> SessionSettings:
    """The settings of the session's metadata; each invalid one is a warning and left unset (the default)."""
    settings, invalid = read_settings(state.metadata)
    for bad in invalid:
        log.warning("session %s: %s=%r is not %s; using the default", state.session_id, bad.key, bad.value,
                    bad.expected)
    return settings


def read_keys(state: SessionState, *, rollout_n: int, partition: str, options: RecordOptions) -> SessionKeys:
    """The session's keys, with the materializer's defaults for the absent or invalid ones."""
    settings = session_settings(state)
    return SessionKeys(
        rollout_n=or_default(settings.rollout_n, rollout_n),
        global_steps=or_default(settings.global_steps, 0),
        partition=or_default(settings.tq_partition, partition),
        attempt=or_default(settings.attempt, 0),
        rule=or_default(settings.prompt_status_rule, "any_success"),
        options=_with_settings(options, settings),
    )


def record_options(state: SessionState, options: RecordOptions) -> RecordOptions:
    """``options`` with this session's ``trajectory_selection`` and ``mask_unfinished_episode``."""
    return _with_settings(options, session_settings(state))


def _with_settings(options: RecordOptions, settings: SessionSettings) -> RecordOptions:
    selection = or_default(settings.trajectory_selection, options.trajectory_selection)
    mask = or_default(settings.mask_unfinished_episode, options.mask_unfinished_episode)
    if (selection, mask) == (options.trajectory_selection, options.mask_unfinished_episode):
        return options
    return RecordOptions(trajectory_selection=selection, mask_unfinished_episode=mask)
