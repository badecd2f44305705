"""Replay: sessions rebuilt from the log alone, one or all of them, and what their chains hold.

:func:`replay_all` reads the whole stream once, in order, folding every session as its
envelopes come (memory: the sessions open at that point of the log), and yields each
session when it closes, then the ones still open at the end. A session whose events do
not fold (a corrupt log) is reported once with its error and skipped from then on.

What a session's chains hold, per turn, is :mod:`session.views` (pure).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from nats.js.client import JetStreamContext

from eventlog.reader import iter_envelopes, last_stream_seq
from schemas.bodies import Bodies
from schemas.errors import FoldError
from schemas.events import AnyEvent, RequestReceived
from schemas.log import LogConfig
from session.fold import SessionState, fold


class Replayed(msgspec.Struct, frozen=True):
    session_id: str
    state: SessionState | None  # None: the session's events do not fold (see error)
    error: str | None = None
    bad_bodies: tuple[int, ...] = ()  # requests whose body, rebuilt from the log, does not have its digest


class ReplayStats(msgspec.Struct, kw_only=True):
    envelopes: int = 0
    events: int = 0
    last_stream_seq: int = 0


async def replay_all(js: JetStreamContext, cfg: LogConfig, stats: ReplayStats | None = None, *,
                     check_bodies: bool = False) -> AsyncIterator[Replayed]:
    """Every session of the log, folded from the log alone; closed ones as soon as they close.

    ``check_bodies``: also rebuild every raw request body (:mod:`schemas.bodies`) and check it
    against its recorded digest (this hashes every body: the cost of the bodies themselves)."""
    stats = stats if stats is not None else ReplayStats()
    stats.last_stream_seq = await last_stream_seq(js, cfg, cfg.subjects)
    states: dict[str, SessionState | None] = {}
    rebuilt: dict[str, Bodies] = {}
    bad: dict[str, list[int]] = {}
    broken: set[str] = set()
    async for _, events in iter_envelopes(js, cfg, cfg.subjects, stats.last_stream_seq):
        stats.envelopes += 1
        stats.events += len(events)
        session_id = events[0].session_id
        if session_id in broken:
            continue
        try:
            state = fold(events, states.get(session_id))
            if check_bodies:
                _check_bodies(events, rebuilt.setdefault(session_id, Bodies()), bad.setdefault(session_id, []))
        except FoldError as exc:
            broken.add(session_id)
            states.pop(session_id, None)
            rebuilt.pop(session_id, None)
            bad.pop(session_id, None)
            yield Replayed(session_id, None, str(exc))
            continue
        if state is not None and state.status != "open":
            states.pop(session_id, None)
            rebuilt.pop(session_id, None)
            yield Replayed(session_id, state, bad_bodies=tuple(bad.pop(session_id, ())))
        else:
            states[session_id] = state
    for session_id, state in states.items():
        yield Replayed(session_id, state, bad_bodies=tuple(bad.pop(session_id, ())))


def _check_bodies(events: list[AnyEvent], bodies: Bodies, bad: list[int]) -> None:
    for event in events:
        if type(event) is RequestReceived:
            bodies.add(event)
            if not bodies.verify(event.request_no):
                bad.append(event.request_no)
