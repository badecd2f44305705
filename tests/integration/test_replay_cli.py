"""``rollbus replay`` (one session, ``--json``, ``--verify``, ``--verify --all``) and ``rollbus
sessions``, over a log of a few hundred sessions in a real nats-server, with markers written
the way the materializer writes them."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest

from eventlog.jetstream import JetStreamPort
from eventlog.publisher import JetStreamLog
from materializer.records import derive_records
from rollbus.cli import build_parser
from rollbus.commands.replay import replay_main
from rollbus.commands.sessions import sessions_main
from schemas.records import MaterializedMarker, record_digest
from session.fold import fold
from session_projector.service import Projector
from tests.helpers import SessionScript, append_all, envelopes
from tests.integration.projecting import running, wait_projected

SESSIONS = 300


def _script(i: int) -> SessionScript:
    script = SessionScript(session_id=f"{i:032x}", uid=f"p{i // 4}", session_index=i % 4)
    script.turn(0, [1, 2, 3, i % 50], [4, 5, i % 7], new_chain=True, logprobs=[-0.1, -0.2, -0.3])
    for turn in range(1, 1 + i % 4):
        script.turn(0, [6, turn], [7, 8, i % 11], n_messages=2 + 2 * turn, tip=f"t{turn}")
    if i % 5 == 0:
        script.turn(1, [9, 9], [10], new_chain=True)
        script.close(1, request_no=script.requests)
    script.reward(i / SESSIONS, acc=float(i % 2))
    if i % 10 == 7:
        script.abort("runner failed")
    elif i % 10 != 3:  # i % 10 == 3: left open
        script.finalize()
    return script


@pytest.fixture
async def logged(nc, js, log_config):
    """Hundreds of sessions in the log, and a marker for every finalized one."""
    scripts = [_script(i) for i in range(SESSIONS)]
    log = JetStreamLog(nc, log_config)
    for script in scripts:
        await append_all(log, script.session_id, envelopes(script.events))
    markers = await js.key_value(log_config.markers_bucket)
    for script in scripts:
        state = fold(script.events)
        if state.status == "finalized":
            await write_marker(markers, state)
    return scripts


async def write_marker(kv, state, records=None) -> None:
    records = derive_records(state) if records is None else records
    marker = MaterializedMarker(session_id=state.session_id, stream_seq=1,
                                digests={r.key: record_digest(r) for r in records}, sinks=("parquet",))
    await kv.put(state.session_id, msgspec.json.encode(marker))


def args(*argv: str):
    return build_parser().parse_args(["replay", *argv, "--nats", "nats://unused"])


async def test_verify_all_over_hundreds_of_sessions_finds_nothing_then_every_corruption(js, log_config, logged,
                                                                                       capsys):
    assert await replay_main(js, log_config, args("--verify", "--all")) == 0
    out, err = capsys.readouterr()
    finalized = sum(1 for s in logged if fold(s.events).status == "finalized")
    assert f"verified {finalized} finalized sessions" in out and out.rstrip().endswith("0 differences")
    assert "DIFF" not in out and err.startswith("verify: ")

    markers = await js.key_value(log_config.markers_bucket)
    corrupt, missing, extra, orphan = (fold(logged[i].events) for i in (0, 1, 2, 3))
    (first, *rest) = derive_records(corrupt)
    responses = first.responses.copy()
    responses[0] += 1  # one token changed in what was "materialized"
    await write_marker(markers, corrupt, [msgspec.structs.replace(first, responses=responses), *rest])
    await markers.delete(missing.session_id)
    records = derive_records(extra)
    await write_marker(markers, extra, [*records, msgspec.structs.replace(records[0], key="bogus_0_9")])
    await write_marker(markers, orphan)  # an open session has nothing materialized
    ghost = msgspec.structs.replace(corrupt, session_id="e" * 32)
    await write_marker(markers, ghost)  # a marker for a session the log does not have

    assert await replay_main(js, log_config, args("--verify", "--all")) == 1
    out, _ = capsys.readouterr()
    diffs = sorted(line.split()[1:4] for line in out.splitlines() if line.startswith("DIFF"))
    assert diffs == sorted([[corrupt.session_id, "digest_mismatch", first.key],
                            [missing.session_id, "missing_marker", "-"],
                            [extra.session_id, "extra_key", "bogus_0_9"],
                            [orphan.session_id, "extra_key", derive_records(orphan)[0].key],
                            [ghost.session_id, "orphan_marker", "-"]])
    assert out.rstrip().endswith("5 differences")

    assert await replay_main(js, log_config, args("--verify", corrupt.session_id)) == 1
    assert await replay_main(js, log_config, args("--verify", logged[10].session_id)) == 0
    assert await replay_main(js, log_config, args("--verify", "--all", "--json")) == 1
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["finalized"] == finalized and len(report["differences"]) == 5


async def test_replay_shows_the_chains_and_json_carries_every_token(js, log_config, logged, capsys):
    script = logged[5]  # two chains, the second closed; finalized
    state = fold(script.events)
    assert await replay_main(js, log_config, args(script.session_id)) == 0
    table = capsys.readouterr().out
    assert f"session {script.session_id}" in table and "finalized" in table
    assert "chain 0  ended with the session (finalized)" in table  # not "open": the session is finalized
    assert "chain 1  closed (max_trajectory_length)" in table
    turns = [line.rsplit("  ", 1)[1] for line in table.splitlines() if line.startswith("chain ")]
    assert turns == [f"{len(c.turns)} turn{'' if len(c.turns) == 1 else 's'}" for c in state.chains]
    assert "1 turn" in turns  # (chain 1 has one)
    assert "mask (response): 1x3 0x2 1x3" in table
    assert "records (as the materializer derives them):" in table and "p1_1_0" in table

    assert await replay_main(js, log_config, args(script.session_id, "--json")) == 0
    body = json.loads(capsys.readouterr().out)
    chain = body["chains"][0]
    (record, _) = derive_records(state)
    assert chain["prompt_ids"] == record.prompts.tolist()
    assert chain["response_ids"] == record.responses.tolist()
    assert chain["response_mask"] == record.response_mask.tolist()
    np.testing.assert_allclose(chain["rollout_log_probs"], record.rollout_log_probs)
    assert body["records"][0]["digest"] == record_digest(record)
    assert body["session"]["turns"] == state.turns and body["events"] == len(script.events)


async def test_replay_of_an_unknown_session_is_an_error(js, log_config, logged, capsys):
    assert await replay_main(js, log_config, args("f" * 32)) == 2
    assert "no session" in capsys.readouterr().err


async def test_sessions_lists_and_filters_the_projections(nc, js, log_config, logged, capsys):
    async with running(Projector(JetStreamPort(nc, log_config))):
        await wait_projected(js, log_config, {s.session_id: len(s.events) for s in logged}, timeout=60)
    sessions = lambda *argv: build_parser().parse_args(["sessions", *argv, "--nats", "nats://unused"])  # noqa: E731
    assert await sessions_main(js, log_config, sessions("--status", "open", "--all")) == 0
    out = capsys.readouterr().out
    assert f"{SESSIONS // 10} of {SESSIONS // 10} matching sessions shown" in out
    assert logged[3].session_id in out and logged[4].session_id not in out

    assert await sessions_main(js, log_config, sessions("--uid", "p1", "--json")) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [s["session_id"] for s in listed] == [logged[i].session_id for i in range(4, 8)]
    assert listed[1]["trajectories"] == 2 and listed[3]["status"] == "aborted"
    assert listed[3]["close_reason"] == "runner failed"

    assert await sessions_main(js, log_config, sessions("--limit", "5")) == 0
    out = capsys.readouterr().out
    assert f"5 of {SESSIONS} matching sessions shown" in out


async def test_request_bodies_are_printed_byte_exact_and_a_forged_one_is_found(nc, js, log_config, capsysbinary):
    """Bodies stored as parts against earlier ones come back byte for byte (``--request N``); a
    request whose parts do not rebuild the body it was recorded with is a ``request_body`` difference."""
    from schemas.bodies import parts_against

    bodies = [b'{"messages":[{"role":"user","content":"' + b"x" * 500 + b'"}' + b',{"role":"tool"}' * n +
              b'],"model":"m","tools":[' + b"t" * 300 + b"]}" for n in range(4)]
    script = SessionScript(session_id="ab" * 16)
    for n, body in enumerate(bodies):
        script.turn(0, [1, n], [2], new_chain=n == 0, body=body, tip=f"t{n}", n_messages=2 + 2 * n)
    for n in range(1, len(bodies)):  # each request stored against the one before it, as the edge does
        index = next(i for i, e in enumerate(script.events) if getattr(e, "request_no", 0) == n + 1)
        event = script.events[index]
        parts = parts_against(bodies[n], n, bodies[n - 1])
        assert any(p.request_no for p in parts)  # references, not a copy
        script.events[index] = msgspec.structs.replace(event, parts=parts)
    forged = next(i for i, e in enumerate(script.events) if getattr(e, "request_no", 0) == 3)
    script.events[forged] = msgspec.structs.replace(script.events[forged], body_digest="0" * 64)
    script.finalize()
    await append_all(JetStreamLog(nc, log_config), script.session_id, envelopes(script.events))

    for n, body in enumerate(bodies, 1):
        assert await replay_main(js, log_config, args(script.session_id, "--request", str(n))) == 0
        assert capsysbinary.readouterr().out == body
    assert await replay_main(js, log_config, args(script.session_id, "--request", "9")) == 2
    assert b"has no request 9" in capsysbinary.readouterr().err
    assert await replay_main(js, log_config, args("--verify", script.session_id)) == 1
    out = capsysbinary.readouterr().out.decode()
    assert f"DIFF {script.session_id} request_body 3" in out and "4 request bodies" in out


async def test_sessions_lists_newest_first_as_the_viewer_does(nc, js, log_config, capsys):
    """The latest --limit sessions, newest first (it listed the oldest first, the viewer the newest)."""
    opened = {f"{0xa0 + i:032x}": at for i, at in enumerate([100.0, 300.0, 200.0, 400.0])}
    log, counts = JetStreamLog(nc, log_config), {}
    for session_id, at in opened.items():
        script = SessionScript(session_id=session_id, uid="ordered", session_index=0)
        script.turn(0, [1, 2], [3], new_chain=True)
        events = [msgspec.structs.replace(e, time=e.time + at) for e in script.events]
        await append_all(log, session_id, envelopes(events))
        counts[session_id] = len(events)
    async with running(Projector(JetStreamPort(nc, log_config))):
        await wait_projected(js, log_config, counts, timeout=60)
    newest = sorted(opened, key=opened.__getitem__, reverse=True)
    sessions = lambda *argv: build_parser().parse_args(["sessions", *argv, "--nats", "nats://unused"])  # noqa: E731
    assert await sessions_main(js, log_config, sessions("--json")) == 0
    assert [s["session_id"] for s in json.loads(capsys.readouterr().out)] == newest
    assert await sessions_main(js, log_config, sessions("--limit", "2")) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()[2:4]] == newest[:2]
    assert "2 of 4 matching sessions shown" in out
