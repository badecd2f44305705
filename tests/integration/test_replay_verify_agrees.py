"""``rollbus replay --verify --all`` judges every session as ``rollbus replay --verify SID`` does, including
sessions whose log goes on after their end: a quarantine the materializer appends, a reward an agent posts
after its session was finalized. A real nats-server, the real projector and materializer."""

from __future__ import annotations

import json
import secrets

from eventlog.publisher import JetStreamLog
from materializer.parquet import ParquetSink
from observability.registry import Metrics
from rollbus.cli import build_parser
from rollbus.commands.replay import replay_main
from tests.helpers import SessionScript
from tests.integration.test_materializer import _drained
from tests.integration.test_materializer_quarantine import (
    _append_unfoldable,
    _quarantine_events,
    _ready_signals,
    _session,
    _unfoldable,
    materializing,
    projecting,
)
from tests.sessions import append


def _args(*argv: str):
    return build_parser().parse_args(["replay", *argv, "--nats", "nats://unused"])


async def _verdict_of_each(js, cfg, session_ids: list[str], capsys) -> dict[str, tuple[int, list]]:
    """``--verify SID --json`` of each session: (exit status, its differences)."""
    out = {}
    for sid in session_ids:
        status = await replay_main(js, cfg, _args("--verify", sid, "--json"))
        out[sid] = (status, json.loads(capsys.readouterr().out.splitlines()[-1])["differences"])
    return out


async def _verdict_of_all(js, cfg, capsys) -> tuple[int, dict]:
    status = await replay_main(js, cfg, _args("--verify", "--all", "--json"))
    return status, json.loads(capsys.readouterr().out.splitlines()[-1])


def _late_reward(script: SessionScript, reward: float) -> list:
    script.reward(reward)
    return [script.events[-1]]


async def test_verify_all_agrees_with_verify_sid_on_quarantined_sessions_and_late_rewards(nc, js, log_config, tmp_path,
                                                                                          capsys) -> None:
    log = JetStreamLog(nc, log_config)
    clean = [_session("pa", i, rollout_n=4) for i in range(4)]
    late = [_session("pb", 0, rollout_n=2, reward=None), _session("pb", 1, rollout_n=2)]
    poison = _session("pc", 0, rollout_n=1, sampled=(7, 2**31 + 1))  # a token id past int32: quarantined
    unfoldable = _unfoldable("pd", 0, rollout_n=1)  # quarantined, and unreadable to both paths
    still_open = SessionScript(session_id=secrets.token_hex(16), uid="pe")
    still_open.turn(0, [1, 2], [3], new_chain=True)
    ended = [*clean[:2], *late, poison, unfoldable]
    last: dict[str, int] = {}
    async with projecting(nc, log_config):
        for script in ended:
            if script is unfoldable:
                await _append_unfoldable(js, log_config, log, script)
            else:
                last[script.session_id] = await append(log, script)
        await _ready_signals(js, log_config, len(ended))
        async with materializing(nc, log_config, ParquetSink(tmp_path / "trajectories"), Metrics()):
            await _drained(js, log_config, len(ended))
        # after their end (and their records): rewards for the late ones, then more sessions behind them
        for script, reward in zip(late, (0.5, 0.25), strict=True):
            await log.append(script.session_id, _late_reward(script, reward), last[script.session_id])
        await append(log, still_open)
        for script in clean[2:]:
            await append(log, script)
        await _ready_signals(js, log_config, len(ended) + 2)
        async with materializing(nc, log_config, ParquetSink(tmp_path / "trajectories"), Metrics()):
            await _drained(js, log_config, len(ended) + 2)
    for script in (poison, unfoldable):
        assert len(await _quarantine_events(js, log_config, script.session_id)) == 1

    scripts = [*ended, still_open, *clean[2:]]
    each = await _verdict_of_each(js, log_config, [s.session_id for s in scripts], capsys)
    status, report = await _verdict_of_all(js, log_config, capsys)
    by_session: dict[str, list] = {s.session_id: [] for s in scripts}
    for difference in report["differences"]:
        by_session[difference["session_id"]].append(difference)
    assert by_session == {sid: differences for sid, (_, differences) in each.items()}
    # what they agree on: the quarantined session is quarantined (with its reason), the unfoldable one
    # unreadable, and every other session clean, the late rewards' included
    kinds = {sid: [d["kind"] for d in differences] for sid, differences in by_session.items()}
    assert kinds == {s.session_id: {poison: ["quarantined"], unfoldable: ["unreadable"]}.get(s, []) for s in scripts}
    assert "token id out of the int32 range" in by_session[poison.session_id][0]["detail"]
    assert [each[s.session_id][0] for s in scripts] == [1 if kinds[s.session_id] else 0 for s in scripts]
    assert status == 1 and (report["finalized"], report["open"], report["unreadable"]) == (7, 1, 1)
    assert report["sessions"] == len(scripts)
