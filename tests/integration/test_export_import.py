"""``rollbus export`` / ``rollbus import``: a log exported from the test server and imported into a
fresh nats-server of the test's own replays identically, large pieces and markers included; a
second import stores nothing twice; a session the target holds differently is refused."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from eventlog.publisher import JetStreamLog
from eventlog.reader import iter_messages, last_stream_seq, read_session
from rollbus.cli import build_parser, main
from rollbus.commands.archive_io import IncompleteLog, read_archive
from rollbus.commands.export import _first_seq, export_main
from rollbus.commands.importing import import_main
from rollbus.commands.replay import replay_main
from schemas import blobs
from schemas.archive import ArchivedEnvelope, ArchivedMarker, ArchivedPiece, ArchiveHeader, to_json_line
from schemas.bodies import rebuild
from schemas.errors import UserError
from schemas.log import HDR_BLOBS, HDR_MSG_ID, LogConfig
from session.fold import fold
from stack.nats_server import EmbeddedNats
from stack.provision import connect, provision
from tests.helpers import SessionScript, append_all, envelopes
from tests.integration.test_replay_cli import write_marker

BIG = os.urandom(1536 * 1024)  # a 1.5 MiB request body: over NATS's 1 MiB, so it goes to the object store
TARGET = LogConfig()  # the fresh server's log, under rollbus's own names (the source's are the test's)


def _script(i: int, *, body: bytes = b"{}", finalize: bool = True) -> SessionScript:
    script = SessionScript(session_id=f"{i:032x}", uid=f"p{i}", session_index=0)
    script.turn(0, [1, 2, 3, i], [4, 5, 6], new_chain=True, body=body, logprobs=[-0.1, -0.2, -0.3])
    script.turn(0, [7, i], [8, 9], n_messages=4, tip="t1")
    script.reward(0.5 + i / 100, acc=1.0)
    if finalize:
        script.finalize()
    return script


async def _log_sessions(nc: Client, cfg: LogConfig, scripts: list[SessionScript]) -> None:
    log = JetStreamLog(nc, cfg)
    markers = await nc.jetstream().key_value(cfg.markers_bucket)
    for script in scripts:
        await append_all(log, script.session_id, envelopes(script.events))
        state = fold(script.events)
        if state is not None and state.status == "finalized":
            await write_marker(markers, state)


@pytest.fixture
async def target(tmp_path: Path) -> AsyncIterator[tuple[Client, JetStreamContext]]:
    """A fresh nats-server of this test's own, its log provisioned (empty)."""
    server = await asyncio.to_thread(EmbeddedNats(tmp_path / "target" / "nats", name="import-target").start)
    client = await connect(server.url, name="import-target")
    await provision(client.jetstream(), TARGET)
    yield client, client.jetstream()
    await client.close()
    await asyncio.to_thread(server.stop)


def _args(*argv: str):
    return build_parser().parse_args([*argv, "--nats", "nats://unused"])


async def _replay_json(js: JetStreamContext, cfg: LogConfig, session_id: str, capsys) -> dict:
    capsys.readouterr()
    assert await replay_main(js, cfg, _args("replay", session_id, "--json")) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed.pop("last_stream_seq") > 0  # where it sits: the only thing an import changes
    return replayed


async def _envelopes_of(js: JetStreamContext, cfg: LogConfig, session_id: str) -> int:
    last = await last_stream_seq(js, cfg, cfg.session_filter(session_id))
    return len([seq async for seq, _ in iter_messages(js, cfg, cfg.session_filter(session_id), last)])


async def _messages(js: JetStreamContext, cfg: LogConfig) -> int:
    return (await js.stream_info(cfg.stream)).state.messages


async def test_a_session_with_large_pieces_exports_and_imports_into_a_fresh_server_identically(
        nc, js, log_config, target, tmp_path, capsys):
    big, small = _script(1, body=BIG), _script(2)
    await _log_sessions(nc, log_config, [small, big])
    path = tmp_path / "big.jsonl"
    assert await export_main(js, log_config, _args("export", big.session_id, "-o", str(path))) == 0
    out, err = capsys.readouterr()
    stored = await _envelopes_of(js, log_config, big.session_id)  # (the publisher may split a turn's envelope)
    assert f"exported 1 sessions ({stored} envelopes, 1 pieces, 1 markers) to {path}" in out
    assert "export:\n" in err and "  pieces" in err  # the summary table, plain off a terminal

    records = list(read_archive(path))
    assert isinstance(records[0], ArchiveHeader) and records[0].selection == f"session {big.session_id}"
    pieces = [r for r in records if isinstance(r, ArchivedPiece)]
    kept = [r for r in records if isinstance(r, ArchivedEnvelope) and HDR_BLOBS in r.headers]
    assert [p.data for p in pieces] == [BIG] and len(kept) == 1
    assert records.index(pieces[0]) == records.index(kept[0]) - 1  # a piece comes before its envelope
    assert {r.session_id for r in records[1:]} == {big.session_id}  # nothing of the other session
    assert isinstance(records[-1], ArchivedMarker)

    target_nc, target_js = target
    assert await import_main(target_nc, TARGET, _args("import", str(path))) == 0
    assert "imported 1 sessions" in capsys.readouterr().out
    assert await _replay_json(target_js, TARGET, big.session_id, capsys) == \
        await _replay_json(js, log_config, big.session_id, capsys)
    imported = await read_session(target_js, TARGET, big.session_id)
    assert rebuild(imported.events).body(1) == BIG  # the raw request, byte for byte, from the object store
    assert await replay_main(target_js, TARGET, _args("replay", "--verify", big.session_id)) == 0
    assert "1 records in its marker, 2 request bodies): 0 differences" in capsys.readouterr().out

    held = await _messages(target_js, TARGET)
    assert await import_main(target_nc, TARGET, _args("import", str(path))) == 0  # again: nothing stored twice
    assert f"0 envelopes appended, {held} already held, 0 markers; 0 refused" in capsys.readouterr().out
    assert await _messages(target_js, TARGET) == held


async def test_all_since_exports_every_session_active_since_whole_as_parquet(nc, js, log_config, target, tmp_path,
                                                                            capsys):
    early, old, late = _script(10), _script(11, finalize=False), _script(12)
    log = JetStreamLog(nc, log_config)
    first = envelopes(old.events)
    old_last = await append_all(log, old.session_id, first[:2])  # it starts before the cut ...
    await _log_sessions(nc, log_config, [early])
    await asyncio.sleep(0.2)
    cut = dt.datetime.now(dt.UTC)
    await asyncio.sleep(0.2)
    old.finalize()
    await append_all(log, old.session_id, envelopes(old.events)[2:], after=old_last)  # ... and ends after it
    await _log_sessions(nc, log_config, [late])
    await write_marker(await js.key_value(log_config.markers_bucket), fold(old.events))

    path = tmp_path / "since.parquet"
    assert await export_main(js, log_config, _args("export", "--all", "--since", cut.isoformat(), "-o",
                                                   str(path))) == 0
    out, err = capsys.readouterr()
    assert "exported 2 sessions" in out
    records = list(read_archive(path))
    exported = await _envelopes_of(js, log_config, old.session_id) + await _envelopes_of(js, log_config,
                                                                                          late.session_id)
    assert [r.session_id for r in records if isinstance(r, ArchivedEnvelope)] == \
        [old.session_id] * await _envelopes_of(js, log_config, old.session_id) + \
        [late.session_id] * await _envelopes_of(js, log_config, late.session_id)
    # the progress counts what was exported (it said "N/N envelopes" for the log range read, early's included)
    last_line = [line for line in err.splitlines() if line.startswith("export: ")][-1]
    read = await last_stream_seq(js, log_config, log_config.subjects) - await _first_seq(js, log_config,
                                                                                      old.session_id) + 1
    assert last_line.startswith(f"export: {exported} envelopes (") and f"log {read}/{read} read" in last_line
    assert read > exported  # (early's envelopes lie in the range)

    target_nc, target_js = target
    assert await import_main(target_nc, TARGET, _args("import", str(path))) == 0
    for script in (old, late):
        assert await _replay_json(target_js, TARGET, script.session_id, capsys) == \
            await _replay_json(js, log_config, script.session_id, capsys)
    assert await replay_main(target_js, TARGET, _args("replay", "--verify", "--all")) == 0
    assert "verified 2 finalized sessions (2 records in their markers)" in capsys.readouterr().out


async def test_interleaved_sessions_are_imported_side_by_side_each_in_its_order(nc, js, log_config, target, tmp_path,
                                                                              capsys):
    scripts = [_script(100 + i) for i in range(40)]
    log = JetStreamLog(nc, log_config)
    groups = {s.session_id: envelopes(s.events) for s in scripts}
    last = dict.fromkeys(groups, 0)
    for turn in range(max(len(g) for g in groups.values())):  # round robin: the sessions' envelopes interleave
        for session_id, session_groups in groups.items():
            if turn < len(session_groups):
                last[session_id] = await append_all(log, session_id, [session_groups[turn]], after=last[session_id])
    markers = await js.key_value(log_config.markers_bucket)
    for script in scripts:
        await write_marker(markers, fold(script.events))
    path = tmp_path / "interleaved.jsonl"
    assert await export_main(js, log_config, _args("export", "--all", "-o", str(path))) == 0
    target_nc, target_js = target
    assert await import_main(target_nc, TARGET, _args("import", str(path)), width=8) == 0
    capsys.readouterr()
    assert await replay_main(target_js, TARGET, _args("replay", "--verify", "--all")) == 0
    assert "verified 40 finalized sessions (40 records in their markers)" in capsys.readouterr().out
    for script in scripts[::7]:
        assert await _replay_json(target_js, TARGET, script.session_id, capsys) == \
            await _replay_json(js, log_config, script.session_id, capsys)


async def test_a_session_the_target_holds_differently_is_refused_and_the_others_are_imported(
        nc, js, log_config, target, tmp_path, capsys):
    await _log_sessions(nc, log_config, [_script(20), _script(21)])
    path = tmp_path / "all.jsonl"
    assert await export_main(js, log_config, _args("export", "--all", "-o", str(path))) == 0
    target_nc, target_js = target
    other = SessionScript(session_id=f"{20:032x}", uid="someone-else")  # the same id, another session
    await append_all(JetStreamLog(target_js._nc, TARGET), other.session_id, envelopes(other.events))
    capsys.readouterr()

    assert await import_main(target_nc, TARGET, _args("import", str(path))) == 2
    out, err = capsys.readouterr()
    refusals = [line for line in err.splitlines() if "refused (409)" in line]
    assert refusals == [f"rollbus import: session {20:032x} refused (409): the log holds a different event at its "
                        f"envelope 1 (another payload under the same Nats-Msg-Id {20:032x}:1); nothing more of it "
                        "was imported"]
    assert "imported 1 sessions" in out and "; 1 refused" in out
    assert (await read_session(target_js, TARGET, f"{20:032x}")).events == other.events  # left as it was
    assert await replay_main(target_js, TARGET, _args("replay", "--verify", f"{21:032x}")) == 0


async def test_a_crafted_archive_is_refused_and_stream_control_headers_are_not_republished(
        nc, js, log_config, target, tmp_path, capsys):
    script = _script(40)
    await _log_sessions(nc, log_config, [script])
    path = tmp_path / "one.jsonl"
    assert await export_main(js, log_config, _args("export", script.session_id, "-o", str(path))) == 0
    header, first, *rest = read_archive(path)
    assert isinstance(first, ArchivedEnvelope)
    target_nc, target_js = target

    def crafted(*records) -> str:
        crafted_path = tmp_path / f"crafted{len(list(tmp_path.iterdir()))}.jsonl"
        crafted_path.write_bytes(b"".join(to_json_line(r) for r in (header, *records)))
        return str(crafted_path)

    for bad, why in [(msgspec.structs.replace(first, data=b"\x93garbage"), "does not decode"),
                     (msgspec.structs.replace(first, subject="elsewhere.x"), "not a log subject"),
                     (msgspec.structs.replace(first, session_id="../../etc"), "not subject-safe")]:
        with pytest.raises(UserError, match=why):
            await import_main(target_nc, TARGET, _args("import", crafted(bad)))
    assert await _messages(target_js, TARGET) == 0  # nothing of them was stored

    rollup = msgspec.structs.replace(first, headers={**first.headers, "Nats-Rollup": "all", "X-Extra": "1"})
    assert await import_main(target_nc, TARGET, _args("import", crafted(rollup, *rest))) == 0
    stored = await target_js.get_msg(TARGET.stream, 1)
    assert "Nats-Rollup" not in (stored.headers or {}) and "X-Extra" not in (stored.headers or {})
    assert (stored.headers or {})[HDR_MSG_ID] == first.headers[HDR_MSG_ID]


async def test_a_missing_piece_refuses_the_export_and_an_import_that_lacks_it(nc, js, log_config, target, tmp_path):
    """A piece the log lost: the export says which and leaves no file; an import of its envelope without the piece
    (neither in the file nor in the target's object store) is refused: nothing from that envelope on is stored."""
    big = _script(50, body=BIG)
    await _log_sessions(nc, log_config, [big])
    whole = tmp_path / "whole.jsonl"
    assert await export_main(js, log_config, _args("export", big.session_id, "-o", str(whole))) == 0
    header, *records = read_archive(whole)
    piece = next(r for r in records if isinstance(r, ArchivedPiece))
    await (await js.object_store(log_config.pieces_bucket)).delete(blobs.object_name(big.session_id, piece.digest))

    path = tmp_path / "lost.jsonl"
    with pytest.raises(IncompleteLog, match=f"piece {blobs.object_name(big.session_id, piece.digest)} is missing"):
        await export_main(js, log_config, _args("export", big.session_id, "-o", str(path)))
    assert list(tmp_path.glob("lost.jsonl*")) == []

    without = tmp_path / "without.jsonl"
    without.write_bytes(b"".join(to_json_line(r) for r in (header, *records) if not isinstance(r, ArchivedPiece)))
    target_nc, target_js = target
    with pytest.raises(UserError, match=r"does not decode \(piece \S+ is in neither the file nor the log\)"):
        await import_main(target_nc, TARGET, _args("import", str(without)))
    archived = [r for r in records if isinstance(r, ArchivedEnvelope)]
    before = next(i for i, r in enumerate(archived) if HDR_BLOBS in r.headers)
    assert await _messages(target_js, TARGET) == before


def test_the_command_line_round_trip_through_an_embedded_store(tmp_path: Path, capsys) -> None:
    """`rollbus export` from a server, `rollbus import --data-dir` into a new store, then that store replays."""
    source = EmbeddedNats(tmp_path / "source" / "nats", name="export-source").start()
    try:
        async def fill() -> None:
            client = await connect(source.url, name="fill")
            await provision(client.jetstream(), TARGET)
            await _log_sessions(client, TARGET, [_script(30, body=BIG), _script(31)])
            await client.close()

        asyncio.run(fill())
        path = tmp_path / "log.jsonl"
        assert main(["export", "--all", "-o", str(path), "--nats", source.url]) == 0
        out, err = capsys.readouterr()
        assert "exported 2 sessions" in out and "\nexport: " in f"\n{err}"  # plain progress lines off a terminal
        assert main(["export", "--all", "-o", str(path), "--nats", source.url]) == 2
        assert capsys.readouterr().err == f"rollbus export: -o {path} exists; choose a new file\n"
    finally:
        source.stop()
    data = tmp_path / "fresh"
    for attempt in (1, 2):
        assert main(["import", str(path), "--data-dir", str(data)]) == 0
        assert ("0 envelopes appended" in capsys.readouterr().out) == (attempt == 2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "envelope"}\n')
    assert main(["import", str(bad), "--data-dir", str(data)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not an archive record" in err, err

    # replay, sessions and export open the imported store with an embedded server too (no --nats, no stack)
    assert main(["replay", "--verify", "--all", "--data-dir", str(data)]) == 0
    assert "verified 2 finalized sessions (2 records in their markers)" in capsys.readouterr().out
    assert main(["replay", f"{30:032x}", "--data-dir", str(data)]) == 0
    assert f"session {30:032x}" in capsys.readouterr().out
    assert main(["sessions", "--data-dir", str(data)]) == 0
    capsys.readouterr()
    again = tmp_path / "again.jsonl"
    assert main(["export", "--all", "-o", str(again), "--data-dir", str(data)]) == 0
    assert "exported 2 sessions" in capsys.readouterr().out
    with EmbeddedNats(data / "nats", name="check") as server:
        async def check() -> None:
            client = await connect(server.url, name="check")
            js = client.jetstream()
            session = await read_session(js, TARGET, f"{30:032x}")
            assert rebuild(session.events).body(1) == BIG
            subject, last = TARGET.session_filter(f"{30:032x}"), session.last_stream_seq
            headers = [msg.headers or {} async for _, msg in iter_messages(js, TARGET, subject, last)]
            assert [h[HDR_MSG_ID] for h in headers][:2] == [f"{30:032x}:1", f"{30:032x}:2"]
            markers = await js.key_value(TARGET.markers_bucket)
            assert msgspec.json.decode((await markers.get(f"{31:032x}")).value)["session_id"] == f"{31:032x}"
            await client.close()

        asyncio.run(check())
