"""A session's images in a real nats-server: ``rollbus replay --verify`` fetches each back from the object store and
checks its digest (a missing or altered image is named), and export/import carries the images with the envelopes."""

from __future__ import annotations

import hashlib
import json
import os

from eventlog.jetstream import JetStreamPort
from eventlog.pieces import open_pieces
from eventlog.publisher import JetStreamLog
from rollbus.commands.archive_io import read_archive
from rollbus.commands.export import export_main
from rollbus.commands.importing import import_main
from rollbus.commands.replay import replay_main
from schemas import blobs
from schemas.archive import ArchivedEnvelope, ArchivedPiece
from schemas.events import ImageRef
from session.fold import fold
from tests.helpers import SessionScript, append_all, envelopes
from tests.integration.test_export_import import TARGET, _args, target  # noqa: F401 (a fixture)
from tests.integration.test_replay_cli import write_marker

START, PAD, END = 151652, 151655, 151653
SCREEN, CHART = os.urandom(3000), os.urandom(2000)


def _ref(data: bytes, offset: int, tokens: int) -> ImageRef:
    return ImageRef(digest=hashlib.sha256(data).hexdigest(), media_type="image/png", width=56, height=28 * tokens,
                    offset=offset, tokens=tokens)


def _script(i: int) -> SessionScript:
    """Two images in the prompt; the first one sent again (the same bytes) with the next turn's context."""
    script = SessionScript(session_id=f"{i:032x}", uid=f"img{i}", processor="builtin:qwen2.5-vl")
    prompt = [1, START, *[PAD] * 4, END, 2, START, *[PAD] * 2, END, 3]
    script.turn(0, prompt, [4, 5], new_chain=True, images=[_ref(SCREEN, 2, 4), _ref(CHART, 9, 2)])
    script.turn(0, [6, START, *[PAD] * 4, END], [7], images=[_ref(SCREEN, 2, 4)], n_messages=4, tip="t1")
    script.reward(1.0)
    script.finalize()
    return script


async def _logged(nc, js, cfg, script: SessionScript) -> None:
    store = await open_pieces(js, cfg)
    assert store is not None
    for data in (SCREEN, CHART):  # as the edge stores them: before the events that reference them
        await store.put(script.session_id, hashlib.sha256(data).digest(), data)
    await append_all(JetStreamLog(nc, cfg), script.session_id, envelopes(script.events))
    await write_marker(await js.key_value(cfg.markers_bucket), fold(script.events))


async def test_verify_fetches_every_image_and_names_a_missing_or_altered_one(nc, js, log_config, capsys):
    script = _script(1)
    await _logged(nc, js, log_config, script)
    port = JetStreamPort(nc, log_config)
    assert await port.image(script.session_id, hashlib.sha256(CHART).hexdigest()) == CHART
    assert await port.image(script.session_id, "00" * 32) is None
    assert await replay_main(js, log_config, _args("replay", "--verify", script.session_id)) == 0
    assert "0 differences" in capsys.readouterr().out
    screen = hashlib.sha256(SCREEN).hexdigest()
    assert await replay_main(js, log_config, _args("replay", script.session_id)) == 0
    shown = capsys.readouterr().out
    assert f"  image at token 2 (4 tokens): image/png 56x112 sha256 {screen[:16]}" in shown
    assert "  image at token 17 (4 tokens)" in shown  # the resent one: after the prompt (13) and the reply (2)
    assert await replay_main(js, log_config, _args("replay", script.session_id, "--json")) == 0
    (chain,) = json.loads(capsys.readouterr().out)["chains"]
    assert [(i["digest"], i["offset"]) for i in chain["images"]] == [(screen, 2), (hashlib.sha256(CHART).hexdigest(),
                                                                                  9), (screen, 17)]

    store = await open_pieces(js, log_config)
    chart = hashlib.sha256(CHART).hexdigest()
    await store.put(script.session_id, bytes.fromhex(screen), b"not the screenshot")
    await store._store.delete(blobs.object_name(script.session_id, bytes.fromhex(chart)))
    assert await replay_main(js, log_config, _args("replay", "--verify", script.session_id)) == 1
    out = capsys.readouterr().out
    assert f"DIFF {script.session_id} image_altered {screen} image/png 56x112: the stored 18 bytes" in out
    assert f"DIFF {script.session_id} image_missing {chart} image/png 56x56: not in the log's object store" in out
    assert await replay_main(js, log_config, _args("replay", "--verify", "--all")) == 1
    assert "image_missing" in capsys.readouterr().out


async def test_export_carries_each_image_once_and_an_import_restores_them(nc, js, log_config, target,  # noqa: F811
                                                                          tmp_path, capsys):
    script = _script(2)
    await _logged(nc, js, log_config, script)
    path = tmp_path / "images.jsonl"
    assert await export_main(js, log_config, _args("export", script.session_id, "-o", str(path))) == 0
    assert "2 pieces" in capsys.readouterr().out
    records = list(read_archive(path))
    pieces = [r for r in records if isinstance(r, ArchivedPiece)]
    assert sorted(p.data for p in pieces) == sorted([SCREEN, CHART])  # the resent image once
    first = next(i for i, r in enumerate(records) if isinstance(r, ArchivedEnvelope) and b"images" in r.data)
    assert all(records.index(p) < first for p in pieces)  # before the first envelope that references them

    target_nc, target_js = target
    assert await import_main(target_nc, TARGET, _args("import", str(path))) == 0
    capsys.readouterr()
    assert await replay_main(target_js, TARGET, _args("replay", "--verify", script.session_id)) == 0
    assert "0 differences" in capsys.readouterr().out
    assert await JetStreamPort(target_nc, TARGET).image(script.session_id, hashlib.sha256(SCREEN).hexdigest()) \
        == SCREEN
