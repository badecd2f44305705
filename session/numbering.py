"""Numbering a session's events: the one place a sequence number is given.

Every event of a session carries its per-session sequence number (1, 2, 3, ...), and the fold
refuses any other (:class:`schemas.errors.OutOfOrderEvent`). Events are built ``UNNUMBERED``
and numbered here (or built numbered, from :func:`next_seqs`), after the session's last sequence,
by whoever appends them: the edge (its turns, :mod:`session.turn`, and its admin events, from the
state it appends to, under the live session's lock: :meth:`edge.live.LiveSession.commit`) and
the materializer's quarantine event (after the last sequence its log holds: :mod:`materializer.quarantine`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

import msgspec

from schemas.events import Event

UNNUMBERED = 0
"""The ``seq`` of an event not numbered yet (sequence numbers start at 1)."""


def next_seqs(after: int) -> Iterator[int]:
    """The session's next sequence numbers, ``after + 1``, ``after + 2``, ...: for events built numbered (a turn's,
    on every model call: no copy of each to number it)."""
    return itertools.count(after + 1)


def numbered(events: Iterable[Event], after: int) -> tuple[Event, ...]:
    """``events`` as the session's next ones: numbered ``after + 1``, ``after + 2``, ... in order."""
    return tuple(event if event.seq == seq else msgspec.structs.replace(event, seq=seq)
                 for seq, event in enumerate(events, after + 1))
