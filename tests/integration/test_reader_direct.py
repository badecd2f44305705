"""Reading sessions by direct gets (:mod:`eventlog.reader`) on a real nats-server: whole sessions over many
batches, from a stream sequence on, thousands at once with no consumer on the server, and a read that
cannot reach the end it was promised fails as unavailable instead of returning part of a session."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from eventlog.publisher import JetStreamLog
from eventlog.reader import _DirectReader, iter_messages, last_stream_seq, load_state, read_session
from schemas.errors import LogUnavailable
from schemas.log import HDR_MSG_ID, HDR_SEQ
from session.fold import fold
from tests.helpers import SessionScript
from tests.sessions import append, envelopes


def _long_session(turns: int) -> SessionScript:
    script = SessionScript(session_id=secrets.token_hex(16))
    for turn in range(turns):
        script.turn(0, [1, 2, turn % 50] if turn == 0 else [turn % 50], [7, 8, 9], new_chain=turn == 0,
                    n_messages=2 + 2 * turn, tip=f"t{turn}")
    script.finalize()
    return script


async def test_a_session_longer_than_a_batch_reads_back_whole_and_from_any_position(nc, js, log_config):
    script = _long_session(turns=_DirectReader.BATCH + 40)  # an envelope per turn: two batches and more
    other = _long_session(turns=3)
    log = JetStreamLog(nc, log_config)
    await append(log, other)
    await append(log, script)
    await append(log, _long_session(turns=2))  # after it in the stream: not read
    session_log = await read_session(js, log_config, script.session_id)
    assert session_log.events == script.events
    state, last = await load_state(js, log_config, script.session_id)
    assert state == fold(script.events)
    assert last == await last_stream_seq(js, log_config, log_config.session_filter(script.session_id))

    read = [(seq, msg) async for seq, msg in iter_messages(js, log_config, log_config.session_filter(script.session_id),
                                                           last)]
    assert len(read) == len(envelopes(script.events))
    assert [seq for seq, _ in read] == sorted(seq for seq, _ in read)
    middle = read[len(read) // 2][0]
    tail = [seq async for seq, _ in iter_messages(js, log_config, log_config.session_filter(script.session_id), last,
                                                  start=middle)]
    assert tail == [seq for seq, _ in read if seq >= middle]
    _, first = read[0]
    assert first.subject.startswith(f"{log_config.prefix}.{script.session_id}.")
    assert HDR_MSG_ID in first.headers and HDR_SEQ in first.headers  # the message's own headers ...
    assert not any(name.startswith("Nats-Sequence") or name == "Nats-Time-Stamp" for name in first.headers)  # only
    assert first.time_ns > 0 and first.timestamp.year >= 2026


async def test_two_thousand_sessions_read_at_once_hold_no_consumer(nc, js, log_config):
    scripts = [SessionScript(session_id=secrets.token_hex(16), uid=f"u{i}") for i in range(2000)]
    for i, script in enumerate(scripts):
        script.turn(0, [1, 2, i % 100], [7, 8], new_chain=True)
        script.finalize()
    log = JetStreamLog(nc, log_config)
    for start in range(0, len(scripts), 200):
        await asyncio.gather(*(append(log, s) for s in scripts[start:start + 200]))
    before = (await js.stream_info(log_config.stream)).state.consumer_count
    peak = before

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, (await js.stream_info(log_config.stream)).state.consumer_count)
            await asyncio.sleep(0.01)

    watcher = asyncio.ensure_future(watch())
    try:
        logs = await asyncio.gather(*(read_session(js, log_config, s.session_id) for s in scripts))
    finally:
        watcher.cancel()
    assert [session_log.events for session_log in logs] == [s.events for s in scripts]
    assert peak == before == 0


async def test_a_read_short_of_its_promised_end_is_unavailable_not_partial(nc, js, log_config):
    script = _long_session(turns=3)
    last = await append(JetStreamLog(nc, log_config), script)
    reader = iter_messages(js, log_config, log_config.session_filter(script.session_id), last + 5, timeout=0.5)
    seen = []
    with pytest.raises(LogUnavailable, match="the log ends at stream seq"):
        async for seq, _ in reader:
            seen.append(seq)
    assert seen[-1] == last
