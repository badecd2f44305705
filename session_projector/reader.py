"""Reading sessions back from the log (replay, recovery, materialization).

A session's events are read with an ordered consumer filtered on its subjects, from the
start up to the last message that existed when the read began (found first with a
direct "last message by subject" lookup, which also tells whether the session exists).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from schemas import envelope
from schemas.errors import LogUnavailable, SessionNotFound
from schemas.events import SCHEMA_VERSION, AnyEvent
from schemas.log import HDR_SCHEMA, LogConfig, check_session_id
from session_projector.fold import SessionState, fold


class SessionLog(msgspec.Struct, frozen=True, kw_only=True):
    events: list[AnyEvent]
    last_stream_seq: int  # where the session's last envelope sits in the stream


def decode_message(data: bytes, headers: dict[str, str] | None) -> list[AnyEvent]:
    version = int((headers or {}).get(HDR_SCHEMA, SCHEMA_VERSION))
    return envelope.decode(data, version)


async def last_stream_seq(js: JetStreamContext, cfg: LogConfig, subject_filter: str, timeout: float = 5.0) -> int:
    """Stream sequence of the last message matching the filter; 0 when there is none."""
    try:
        msg = await asyncio.wait_for(js.get_last_msg(cfg.stream, subject_filter), timeout)
    except NotFoundError:
        return 0
    except (TimeoutError, NatsTimeoutError) as exc:
        raise LogUnavailable("JetStream did not answer a last-message lookup") from exc
    return int(msg.seq or 0)


async def iter_envelopes(
    js: JetStreamContext, cfg: LogConfig, subject_filter: str, until: int, timeout: float = 5.0, *, start: int = 1
) -> AsyncIterator[tuple[int, list[AnyEvent]]]:
    """(stream seq, events) of every message matching the filter, from stream seq ``start`` to ``until``."""
    if until <= 0 or start > until:
        return
    config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start) if start > 1 \
        else ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    try:
        sub = await asyncio.wait_for(
            js.subscribe(subject_filter, ordered_consumer=True, stream=cfg.stream, config=config), timeout)
    except (TimeoutError, NatsTimeoutError) as exc:
        raise LogUnavailable(f"could not open a reader on {subject_filter}") from exc
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=timeout)
            except NatsTimeoutError as exc:
                raise LogUnavailable(f"reading {subject_filter} stalled") from exc
            seq = msg.metadata.sequence.stream
            yield seq, decode_message(msg.data, msg.headers)
            if seq >= until:
                return
    finally:
        await sub.unsubscribe()


async def read_session(js: JetStreamContext, cfg: LogConfig, session_id: str, *, until: int | None = None
                       ) -> SessionLog:
    """Every event of a session, in order (up to stream seq ``until`` when given).

    Raises :class:`SessionNotFound` when it has none.
    """
    check_session_id(session_id)
    subject_filter = cfg.session_filter(session_id)
    last = until if until is not None else await last_stream_seq(js, cfg, subject_filter)
    if last == 0:
        raise SessionNotFound(f"no session {session_id!r}", param="session_id")
    events: list[AnyEvent] = []
    async for _, batch in iter_envelopes(js, cfg, subject_filter, last):
        events.extend(batch)
    return SessionLog(events=events, last_stream_seq=last)


async def load_state(js: JetStreamContext, cfg: LogConfig, session_id: str, *, until: int | None = None
                     ) -> tuple[SessionState, int]:
    """A session rebuilt from the log alone, and the stream sequence it was read up to."""
    session_log = await read_session(js, cfg, session_id, until=until)
    state = fold(session_log.events)
    if state is None:  # pragma: no cover - read_session never returns an empty log
        raise SessionNotFound(f"no session {session_id!r}")
    return state, session_log.last_stream_seq
