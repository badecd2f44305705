"""The projector against a real nats-server: projections equal the fold of the log, survive a
projector restart in the middle of sessions, are rebuilt when lost, and skip redeliveries."""

from __future__ import annotations

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext

from eventlog.jetstream import JetStreamPort
from eventlog.kv import KvStore
from eventlog.publisher import JetStreamLog
from schemas.log import LogConfig, ReadySignal
from session.fold import fold
from session.summary import summarize
from session_projector.projections import ProjectionStore, current_summary, read_projection
from session_projector.service import Projector
from tests.helpers import SessionScript, append_all, envelopes
from tests.integration.projecting import running, wait_drained, wait_projected


def _script(index: int, turns: int, end: str | None) -> SessionScript:
    script = SessionScript(session_id=f"{index:032x}", uid=f"u{index}")
    script.turn(0, [1, 2, 3], [4, 5], new_chain=True)
    for turn in range(1, turns):
        script.turn(0, [6], [7, 8, 9], n_messages=2 + 2 * turn, tip=f"t{turn}")
    if index % 3 == 0:
        script.turn(1, [1, 2], [9], new_chain=True)
    script.reward(float(index))
    if end == "finalized":
        script.finalize()
    elif end == "aborted":
        script.abort("agent crashed")
    return script


SCRIPTS = [_script(i, 2 + i % 4, (None, "finalized", "aborted")[i % 3]) for i in range(9)]


async def _write(nc: Client, cfg: LogConfig, scripts: list[SessionScript], upto: float = 1.0,
                 after: dict[str, int] | None = None, start: float = 0.0) -> dict[str, int]:
    """Append the fraction [start, upto) of each session's envelopes; returns stream positions."""
    log = JetStreamLog(nc, cfg)
    positions = dict(after or {})
    for script in scripts:
        groups = envelopes(script.events)
        part = groups[int(len(groups) * start): int(len(groups) * upto)]
        positions[script.session_id] = await append_all(log, script.session_id, part,
                                                        positions.get(script.session_id, 0))
    return positions


async def _ready(js: JetStreamContext, cfg: LogConfig) -> list[str]:
    info = await js.stream_info(cfg.ready_stream)
    sub = await js.subscribe(cfg.ready_subjects, ordered_consumer=True, stream=cfg.ready_stream)
    out = [msgspec.json.decode((await sub.next_msg(5)).data, type=ReadySignal).session_id
           for _ in range(info.state.messages)]
    await sub.unsubscribe()
    return out


async def test_projections_equal_the_fold_and_hold_no_tokens(nc, js, log_config):
    await _write(nc, log_config, SCRIPTS)
    async with running(Projector(JetStreamPort(nc, log_config))):
        await wait_projected(js, log_config, {s.session_id: len(s.events) for s in SCRIPTS})
    for script in SCRIPTS:
        projection = await read_projection(js, log_config, script.session_id)
        assert projection is not None
        assert summarize(projection.state) == summarize(fold(script.events))
        assert all(c.prompt_ids == b"" and c.segments == () for c in projection.state.chains)
        assert projection.status == projection.state.status
    ended = sorted(s.session_id for s in SCRIPTS
                   if s.events[-1].__class__.__name__ in ("SessionFinalized", "SessionAborted"))
    assert sorted(await _ready(js, log_config)) == ended  # a ready signal for every ended session


async def test_a_restarted_projector_continues_sessions_it_saw_half_of(nc, js, log_config):
    positions = await _write(nc, log_config, SCRIPTS, upto=0.5)
    half = {s.session_id: sum(len(g) for g in envelopes(s.events)[: len(envelopes(s.events)) // 2])
            for s in SCRIPTS}
    async with running(Projector(JetStreamPort(nc, log_config))):
        await wait_projected(js, log_config, half)
    await _write(nc, log_config, SCRIPTS, start=0.5, after=positions)
    async with running(Projector(JetStreamPort(nc, log_config))) as second:
        await wait_projected(js, log_config, {s.session_id: len(s.events) for s in SCRIPTS})
    assert second.rebuilt == 0  # it went on from the stored projections, without replaying
    for script in SCRIPTS:
        projection = await read_projection(js, log_config, script.session_id)
        assert projection is not None and summarize(projection.state) == summarize(fold(script.events))


async def test_a_lost_projection_is_rebuilt_from_the_log(nc, js, log_config):
    script = SCRIPTS[4]
    positions = await _write(nc, log_config, [script], upto=0.5)
    async with running(Projector(JetStreamPort(nc, log_config))):
        await wait_projected(js, log_config, {script.session_id: sum(len(g) for g in envelopes(script.events)[
            : len(envelopes(script.events)) // 2])})
    kv = await js.key_value(log_config.projections_bucket)
    await kv.delete(script.session_id)
    await _write(nc, log_config, [script], start=0.5, after=positions)
    async with running(Projector(JetStreamPort(nc, log_config))) as projector:
        await wait_projected(js, log_config, {script.session_id: len(script.events)})
    assert projector.rebuilt == 1
    projection = await read_projection(js, log_config, script.session_id)
    assert projection is not None and summarize(projection.state) == summarize(fold(script.events))


async def test_redelivered_envelopes_are_skipped(nc, js, log_config):
    await _write(nc, log_config, SCRIPTS[:3])
    async with running(Projector(JetStreamPort(nc, log_config))):
        await wait_projected(js, log_config, {s.session_id: len(s.events) for s in SCRIPTS[:3]})
    kv = await js.key_value(log_config.projections_bucket)
    revisions = {s.session_id: (await kv.get(s.session_id)).revision for s in SCRIPTS[:3]}
    # A second consumer reads the whole log again: every envelope is a redelivery to the projections.
    async with running(Projector(JetStreamPort(nc, log_config), durable="again")) as again:
        await wait_drained(js, log_config.stream, "again")
    assert again.rebuilt == 0
    assert {s.session_id: (await kv.get(s.session_id)).revision for s in SCRIPTS[:3]} == revisions


async def test_current_summary_folds_the_tail_the_projector_has_not_seen(nc, js, log_config):
    script = SCRIPTS[1]
    positions = await _write(nc, log_config, [script], upto=0.5)
    assert await current_summary(js, log_config, script.session_id) is None  # nothing projected yet
    async with running(Projector(JetStreamPort(nc, log_config))):
        await wait_projected(js, log_config, {script.session_id: sum(len(g) for g in envelopes(script.events)[
            : len(envelopes(script.events)) // 2])})
    await _write(nc, log_config, [script], start=0.5, after=positions)
    assert await current_summary(js, log_config, script.session_id) == summarize(fold(script.events))


async def test_concurrent_writers_are_refused_by_revision(nc, js, log_config):
    await _write(nc, log_config, SCRIPTS[:1])
    async with running(Projector(JetStreamPort(nc, log_config))):
        await wait_projected(js, log_config, {SCRIPTS[0].session_id: len(SCRIPTS[0].events)})
    one, other = (ProjectionStore(KvStore(js, log_config.projections_bucket)) for _ in range(2))
    projection, revision = await one.get(SCRIPTS[0].session_id)
    assert projection is not None
    await other.put(projection, revision)
    from schemas.errors import Conflict

    with pytest.raises(Conflict):
        await one.put(projection, revision)
