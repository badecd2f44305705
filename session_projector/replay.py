"""Replay: sessions rebuilt from the log alone, one or all of them, and what their chains hold.

:func:`replay_one` reads one session's log and folds it. :func:`replay_all` reads the whole
stream once, in order, folding every session as its envelopes come (memory: the sessions open
at that point of the log, and the ids of those already yielded), and yields each session when
it closes, then the ones still open at the end. A session whose events do not fold (a corrupt
log) is reported once with its error and skipped from then on.

A closed session's log can go on: the materializer appends ``session_quarantined`` after the
end, and an agent can post a reward after its session was finalized. Such a session was
already yielded, folded up to its close; at the end of the pass it is yielded again, read
whole by :func:`replay_one` (the per-session path), with ``amends=True``: that one stands.
So both paths fold the same events with the same function and cannot disagree.

What a session's chains hold, per turn, is :mod:`session.views` (pure).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import msgspec
from nats.js.client import JetStreamContext

from eventlog.reader import iter_envelopes, last_stream_seq, read_session
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
    amends: bool = False  # replaces what an earlier Replayed of this session said (its log went on after its end)


class ReplayStats(msgspec.Struct, kw_only=True):
    envelopes: int = 0
    events: int = 0
    last_stream_seq: int = 0
    amended: int = 0  # closed sessions whose log went on, read again whole at the end


def replay_events(session_id: str, events: Sequence[AnyEvent], *, check_bodies: bool = False) -> Replayed:
    """One session folded from all of its events (pure): what :func:`replay_all` yields for it."""
    try:
        state = fold(events)
        bad: list[int] = []
        if check_bodies:
            _check_bodies(events, Bodies(), bad)
    except FoldError as exc:
        return Replayed(session_id, None, str(exc))
    return Replayed(session_id, state, bad_bodies=tuple(bad))


async def replay_one(js: JetStreamContext, cfg: LogConfig, session_id: str, *, check_bodies: bool = False,
                     until: int | None = None) -> Replayed:
    """One session from its own log (up to its envelope at stream seq ``until`` when given);
    :class:`SessionNotFound` when it has none."""
    session_log = await read_session(js, cfg, session_id, until=until)
    return replay_events(session_id, session_log.events, check_bodies=check_bodies)


async def replay_all(js: JetStreamContext, cfg: LogConfig, stats: ReplayStats | None = None, *,
                     check_bodies: bool = False) -> AsyncIterator[Replayed]:
    """Every session of the log, folded from the log alone; closed ones as soon as they close, and
    again (``amends``) at the end when their log went on after it (see the module docstring).

    ``check_bodies``: also rebuild every raw request body (:mod:`schemas.bodies`) and check it
    against its recorded digest (this hashes every body: the cost of the bodies themselves)."""
    stats = stats if stats is not None else ReplayStats()
    stats.last_stream_seq = await last_stream_seq(js, cfg, cfg.subjects)
    states: dict[str, SessionState | None] = {}
    rebuilt: dict[str, Bodies] = {}
    bad: dict[str, list[int]] = {}
    broken: set[str] = set()
    ended: set[str] = set()  # yielded when they closed
    amended: dict[str, int] = {}  # of those, the ones with events after their end: their last stream seq
    async for seq, events in iter_envelopes(js, cfg, cfg.subjects, stats.last_stream_seq):
        stats.envelopes += 1
        stats.events += len(events)
        session_id = events[0].session_id
        if session_id in ended:
            amended[session_id] = seq
            continue
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
            ended.add(session_id)
            yield Replayed(session_id, state, bad_bodies=tuple(bad.pop(session_id, ())))
        else:
            states[session_id] = state
    for session_id, state in states.items():
        yield Replayed(session_id, state, bad_bodies=tuple(bad.pop(session_id, ())))
    stats.amended = len(amended)
    for session_id, until in amended.items():  # read whole, as far as this pass read the stream
        again = await replay_one(js, cfg, session_id, check_bodies=check_bodies, until=until)
        yield msgspec.structs.replace(again, amends=True)


def _check_bodies(events: Sequence[AnyEvent], bodies: Bodies, bad: list[int]) -> None:
    for event in events:
        if type(event) is RequestReceived:
            bodies.add(event)
            if not bodies.verify(event.request_no):
                bad.append(event.request_no)
