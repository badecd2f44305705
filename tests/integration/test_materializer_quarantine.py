"""Poison pills against a real nats-server and the real materializer: sessions that cannot be
materialized are quarantined (an event on their log, their marker, a metric, ``rollbus sessions``),
the innocent sessions of their batch reach Parquet once, and nothing is retried forever."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import Counter
from collections.abc import AsyncIterator

from nats.aio.client import Client
from nats.js.client import JetStreamContext

from eventlog.jetstream import JetStreamPort
from eventlog.kv import KvStore
from eventlog.publisher import JetStreamLog
from eventlog.reader import read_session
from materializer.ledger import Markers, PromptLedger
from materializer.parquet import ParquetSink
from materializer.records import derive_records
from materializer.service import Materializer, MaterializerOptions
from observability.registry import Metrics
from reward.scorer import FunctionScorer, ScoreRequest
from rollbus.cli import build_parser
from rollbus.commands.sessions import sessions_main
from schemas.errors import ScorerError
from schemas.events import SessionQuarantined
from schemas.log import LogConfig
from session.fold import fold
from session_projector.service import Projector
from tests.helpers import SessionScript
from tests.integration.projecting import wait_projected
from tests.integration.test_materializer import _drained
from tests.sessions import append, envelopes


def _session(uid: str, index: int, *, rollout_n: int, sampled: tuple[int, ...] = (7, 8),
             reward: float | None = 1.0) -> SessionScript:
    script = SessionScript(session_id=secrets.token_hex(16), uid=uid, session_index=index,
                           metadata={"global_steps": 4, "rollout_n": rollout_n})
    script.turn(0, [1, 2, index % 100], list(sampled), new_chain=True)
    if reward is not None:
        script.reward(reward)
    script.finalize()
    return script


def _unfoldable(uid: str, index: int, *, rollout_n: int) -> SessionScript:
    """A rollback of more tokens than its turn sampled: the projector folds it onto a stored projection
    (which holds no tokens to count: :func:`_append_unfoldable`) and signals it ready; the materializer's
    full fold refuses it."""
    script = SessionScript(session_id=secrets.token_hex(16), uid=uid, session_index=index,
                           metadata={"global_steps": 4, "rollout_n": rollout_n})
    script.turn(0, [1, 2], [5, 6], new_chain=True)
    script.roll_back(0, turn_request_no=1, dropped=9)
    script.turn(0, [7], [8], n_messages=4, tip="t2", prefix="p1")
    script.finalize()
    return script


async def _append_unfoldable(js: JetStreamContext, cfg: LogConfig, log: JetStreamLog, script: SessionScript) -> None:
    """Its first turn, projected (released) before the rollback comes."""
    groups = envelopes(script.events)
    last = 0
    for group in groups[:2]:
        last = (await log.append(script.session_id, group, last)).stream_seq
    await wait_projected(js, cfg, {script.session_id: groups[1][-1].seq})
    for group in groups[2:]:
        last = (await log.append(script.session_id, group, last)).stream_seq


async def _ready_signals(js: JetStreamContext, cfg: LogConfig, count: int, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while (await js.stream_info(cfg.ready_stream)).state.messages < count:
        assert asyncio.get_running_loop().time() < deadline, "the projector did not signal every session"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def materializing(nc: Client, cfg: LogConfig, sink: ParquetSink, metrics: Metrics,
                        **options: object) -> AsyncIterator[Materializer]:
    stop = asyncio.Event()
    materializer = Materializer(JetStreamPort(nc, cfg), sink, metrics=metrics,
                                options=MaterializerOptions(max_delay=0.3, **options))  # type: ignore[arg-type]
    task = asyncio.ensure_future(materializer.run(stop))
    try:
        yield materializer
    finally:
        stop.set()
        await task


@contextlib.asynccontextmanager
async def projecting(nc: Client, cfg: LogConfig) -> AsyncIterator[None]:
    stop = asyncio.Event()
    task = asyncio.ensure_future(Projector(JetStreamPort(nc, cfg)).run(stop))
    try:
        yield
    finally:
        stop.set()
        await task


def _expected_keys(scripts: list[SessionScript]) -> Counter[str]:
    return Counter(r.key for s in scripts for r in derive_records(fold(s.events)))


async def _quarantine_events(js: JetStreamContext, cfg: LogConfig, session_id: str) -> list[SessionQuarantined]:
    return [e for e in (await read_session(js, cfg, session_id)).events if isinstance(e, SessionQuarantined)]


def _sessions_args(*argv: str):
    return build_parser().parse_args(["sessions", *argv, "--nats", "nats://unused"])


async def test_poison_sessions_are_quarantined_and_the_rest_of_their_batch_is_written(nc, js, log_config, tmp_path,
                                                                                     caplog, capsys):
    innocents = [_session("pa", 0, rollout_n=3), _session("pa", 2, rollout_n=3), _session("pb", 0, rollout_n=2)]
    wide_token = _session("pa", 1, rollout_n=3, sampled=(7, 2**31 + 1))  # a token id past int32
    wide_index = _session("pc", 2**31, rollout_n=1)  # a session index past int32
    unfoldable = _unfoldable("pb", 1, rollout_n=2)
    poisons = [wide_token, wide_index, unfoldable]
    scripts = [innocents[0], wide_token, innocents[1], wide_index, unfoldable, innocents[2]]
    log = JetStreamLog(nc, log_config)
    sink, metrics = ParquetSink(tmp_path / "trajectories"), Metrics()
    async with projecting(nc, log_config):
        for script in scripts:
            await (_append_unfoldable(js, log_config, log, script) if script is unfoldable else append(log, script))
        await _ready_signals(js, log_config, len(scripts))
        with caplog.at_level(logging.INFO, logger="materializer"):
            async with materializing(nc, log_config, sink, metrics) as materializer:
                await _drained(js, log_config, len(scripts))
                await asyncio.sleep(2.0)  # a materializer retrying would redeliver by now
                info = await js.consumer_info(log_config.ready_stream, "rollbus-materializer")
                writer = await materializer.writer()
        await wait_projected(js, log_config, {s.session_id: len(s.events) + 1 for s in poisons})

    # the innocents are in Parquet, once, in the one file of their batch; the poisons are not
    assert Counter(sink.read().column("key").to_pylist()) == _expected_keys(innocents)
    assert len(list(sink.directory.glob("*.parquet"))) == 1
    # each poison: one event on its log with its reason, a quarantined marker without records
    reasons = {}
    for script in poisons:
        (event,) = await _quarantine_events(js, log_config, script.session_id)
        assert event.seq == len(script.events) + 1
        reasons[script.session_id] = (event.stage, event.reason)
    assert reasons[wide_token.session_id][0] == "invalid" and "token id out of the int32 range" in \
        reasons[wide_token.session_id][1]
    assert reasons[wide_index.session_id][0] == "invalid" and "session_index=2147483648" in \
        reasons[wide_index.session_id][1]
    assert reasons[unfoldable.session_id][0] == "unreadable" and "does not fold" in reasons[unfoldable.session_id][1]
    markers = await Markers(KvStore(js, log_config.markers_bucket, timeout=5.0)).get_many(
        s.session_id for s in scripts)
    assert {sid: (m.status, m.digests) for sid, m in markers.items() if m.status == "quarantined"} == {
        s.session_id: ("quarantined", {}) for s in poisons}
    # they count as failed sessions: their prompts end
    ledger = await PromptLedger(KvStore(js, log_config.prompts_bucket, timeout=5.0)).bind()
    progress = {uid: p for uid, (p, _) in (await ledger.load(["pa", "pb", "pc"])).items()}
    assert {uid: p.status for uid, p in progress.items()} == {"pa": "finished", "pb": "finished", "pc": "failure"}
    assert not progress["pa"].outcomes["1"].succeeded and not progress["pb"].outcomes["1"].succeeded
    # no retry: every signal acknowledged at its first delivery; one log line each; the metric
    assert (info.num_pending, info.num_ack_pending, info.num_redelivered) == (0, 0, 0)
    assert writer.quarantined == Counter({"invalid": 2, "unreadable": 1})
    lines = [r for r in caplog.records if "quarantined (" in r.getMessage()]
    assert sorted(r.getMessage().split()[1] for r in lines) == sorted(s.session_id for s in poisons)
    assert not any(r.exc_info for r in caplog.records)
    assert metrics.value("rollbus_materializer_quarantined_total", stage="invalid") == 2
    # rollbus sessions shows them quarantined, with the reason
    capsys.readouterr()
    assert await sessions_main(js, log_config, _sessions_args("--status", "quarantined", "--all")) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line[:32] in reasons}
    assert set(rows) == set(reasons) and all(" quarantined " in row for row in rows.values())
    assert "token id out of the int32 range" in rows[wide_token.session_id]
    assert "3 of 3 matching sessions shown; 6 in all (0 open, 3 finalized, 0 aborted, 3 quarantined)" in out

    # a restart that gets every signal again (its consumer gone), two of them after a crash between
    # their event and their marker: nothing is written twice, nothing is quarantined again
    await js.delete_consumer(log_config.ready_stream, "rollbus-materializer")
    kv = await js.key_value(log_config.markers_bucket)
    for script in (wide_token, unfoldable):
        await kv.delete(script.session_id)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="materializer"):
        async with materializing(nc, log_config, sink, metrics) as again:
            await _drained(js, log_config, len(scripts))
            assert (await again.writer()).quarantined == Counter()
    assert Counter(sink.read().column("key").to_pylist()) == _expected_keys(innocents)
    assert len(list(sink.directory.glob("*.parquet"))) == 1
    for script in poisons:
        assert len(await _quarantine_events(js, log_config, script.session_id)) == 1
    markers = await Markers(KvStore(js, log_config.markers_bucket, timeout=5.0)).get_many(
        s.session_id for s in poisons)
    assert {m.status for m in markers.values()} == {"quarantined"} and len(markers) == 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert metrics.value("rollbus_materializer_quarantined_total", stage="invalid") == 2


def _crashing_scorer(crash_on: str, transient: dict[str, int]) -> FunctionScorer:
    """Scores 0.5, but raises a bug's RuntimeError on one uid, and ScorerError on the first calls of others."""

    def score(request: ScoreRequest) -> float:
        if request.uid == crash_on:
            raise RuntimeError("the scorer cannot take this session")
        if transient.get(request.uid, 0) > 0:
            transient[request.uid] -= 1
            raise ScorerError("the reward model is not answering")
        return 0.5

    return FunctionScorer(score)


async def test_a_batch_that_fails_whole_is_narrowed_down_to_the_one_session(nc, js, log_config, tmp_path, caplog):
    """A failure no validation foresees (here a scorer bug on one session) fails the batch as a whole:
    the batch is written in halves, the session whose write fails alone is quarantined (``write``);
    a transient failure (the scorer not answering) is retried, never quarantined."""
    scripts = [_session(f"q{i}", 0, rollout_n=1, reward=None) for i in range(6)]
    log = JetStreamLog(nc, log_config)
    sink, metrics = ParquetSink(tmp_path / "trajectories"), Metrics()
    scorer = _crashing_scorer("q3", {"q5": 3})  # fails in the batch, its half and its quarter
    async with projecting(nc, log_config):
        for script in scripts:
            await append(log, script)
        await _ready_signals(js, log_config, len(scripts))
        with caplog.at_level(logging.WARNING, logger="materializer"):
            stop = asyncio.Event()
            materializer = Materializer(JetStreamPort(nc, log_config), sink, scorer=scorer, metrics=metrics,
                                        options=MaterializerOptions(max_delay=0.3))
            task = asyncio.ensure_future(materializer.run(stop))
            try:
                await _drained(js, log_config, len(scripts))
            finally:
                stop.set()
                await task
    innocents = [s for s in scripts if s.session_id != scripts[3].session_id]
    keys = Counter(sink.read().column("key").to_pylist())
    assert keys == Counter(f"q{i}_0_0" for i in (0, 1, 2, 4, 5))
    assert set(sink.read().column("reward").to_pylist()) == {0.5}
    (event,) = await _quarantine_events(js, log_config, scripts[3].session_id)
    assert event.stage == "write" and "RuntimeError: the scorer cannot take this session" in event.reason
    markers = await Markers(KvStore(js, log_config.markers_bucket, timeout=5.0)).get_many(
        s.session_id for s in scripts)
    assert [markers[s.session_id].status for s in scripts] == ["finalized"] * 3 + ["quarantined", "finalized",
                                                                                    "finalized"]
    assert [await _quarantine_events(js, log_config, s.session_id) for s in innocents] == [[]] * len(innocents)
    assert (await materializer.writer()).quarantined == Counter({"write": 1})
    assert "writing it in halves" in caplog.text and "the reward model is not answering; will retry" in caplog.text
    assert metrics.value("rollbus_materializer_quarantined_total", stage="write") == 1


async def test_rematerialization_tries_quarantined_sessions_again_and_skips_what_still_fails(nc, js, log_config,
                                                                                           tmp_path, caplog):
    """``rollbus materialize --from-log`` is the explicit retry: a session quarantined for its write
    (valid records) is written now; one the sinks still cannot hold is skipped, counted, logged once."""
    from materializer.rematerialize import Rematerializer

    retried, innocent = _session("ra", 0, rollout_n=2), _session("ra", 1, rollout_n=2)
    wide_index = _session("rb", 2**31, rollout_n=1)
    retried.events.append(SessionQuarantined(session_id=retried.session_id, seq=len(retried.events) + 1, time=1.0,
                                             stage="write", reason="its write failed: RuntimeError: a bug"))
    log = JetStreamLog(nc, log_config)
    for script in (retried, wide_index, innocent):
        await append(log, script)
    sink = ParquetSink(tmp_path / "again")
    with caplog.at_level(logging.ERROR, logger="materializer"):
        progress = await Rematerializer(sink, sessions_per_file=8).run(js, log_config)
    assert Counter(sink.read().column("key").to_pylist()) == _expected_keys([retried, innocent])
    assert (progress.sessions, progress.errors, progress.files) == (2, 1, 1)
    (line,) = [r.getMessage() for r in caplog.records]
    assert wide_index.session_id in line and "session_index=2147483648" in line
