"""The log's retention limits (applied at provision, shown by ``rollbus up``) and ``--fsync always``."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from nats.js.api import DiscardPolicy
from nats.js.errors import APIError

from rollbus.cli import _announce, main
from schemas.errors import ProvisionError
from schemas.log import LogConfig
from stack.nats_server import EmbeddedNats
from stack.provision import Retention, connect, provision
from stack.runtime import Stack, StackOptions

DAY = 86400.0


async def test_limits_are_applied_to_a_new_stream_updated_on_an_existing_one_and_kept_by_other_components(
        js, log_config, caplog):
    await provision(js, log_config, retention=Retention(max_age_s=30 * DAY, max_bytes=256 << 20))
    config = (await js.stream_info(log_config.stream)).config
    assert (config.max_age, config.max_bytes, config.discard) == (30 * DAY, 256 << 20, DiscardPolicy.NEW)

    with caplog.at_level(logging.WARNING, logger="stack.provision"):
        await provision(js, log_config, retention=Retention(max_age_s=90 * DAY))  # max bytes back to unlimited
    config = (await js.stream_info(log_config.stream)).config
    assert (config.max_age, config.max_bytes) == (90 * DAY, -1)
    assert any(f"updating stream {log_config.stream}" in r.message and "max_age" in r.message
               for r in caplog.records)

    await provision(js, log_config)  # a component run alone: the limits `rollbus up` set stay
    config = (await js.stream_info(log_config.stream)).config
    assert (config.max_age, config.max_bytes) == (90 * DAY, -1)

    await provision(js, log_config, retention=Retention())  # explicit defaults: nothing is ever deleted
    config = (await js.stream_info(log_config.stream)).config
    assert (config.max_age, config.max_bytes, config.discard) == (0.0, -1, DiscardPolicy.NEW)


async def test_a_log_at_its_max_bytes_refuses_new_appends_and_deletes_nothing(js, log_config):
    await provision(js, log_config, retention=Retention(max_bytes=2 << 20))
    subject = log_config.subject("ab" * 16, "request")
    stored = 0
    with pytest.raises(APIError) as refused:
        for _ in range(100):
            await js.publish(subject, b"x" * (200 << 10), stream=log_config.stream)
            stored += 1
    assert "maximum bytes" in refused.value.description.lower()
    state = (await js.stream_info(log_config.stream)).state
    assert 5 <= stored < 100 and state.messages == stored and state.first_seq == 1  # the oldest is still there


async def test_a_max_bytes_the_store_cannot_reserve_is_a_provision_error(js, log_config):
    with pytest.raises(ProvisionError, match="insufficient storage"):
        await provision(js, log_config, retention=Retention(max_bytes=1 << 60))


def test_nonsense_limits_and_fsync_with_an_external_server_are_refused_in_one_line(capsys, tmp_path: Path):
    for argv, message in [
        (["--retention-max-age", "5m"], "rollbus up: --retention-max-age must be 0 (unlimited) or at least the "
                                        "duplicate window, 600s\n"),
        (["--retention-max-bytes", "1000"], "rollbus up: --retention-max-bytes must be 0 (unlimited) or at least "
                                            "1048576 (one envelope)\n"),
        (["--fsync", "always", "--nats", "nats://127.0.0.1:1"], "rollbus up: --fsync always sets the embedded "
         "nats-server's sync_interval; for the server at --nats, put jetstream { sync_interval: always } in its "
         "configuration\n"),
    ]:
        assert main(["up", "--data-dir", str(tmp_path), "--port", "0", *argv]) == 2
        assert capsys.readouterr().err == message
    for argv in (["--retention-max-age=-3d"], ["--retention-max-age", "1y"], ["--retention-max-bytes", "5PB"]):
        with pytest.raises(SystemExit) as exited:
            main(["up", "--data-dir", str(tmp_path), *argv])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and len(err.splitlines()) == 1 and "not a" in err, err


def test_fsync_always_is_the_servers_sync_interval_and_default_leaves_it(tmp_path: Path):
    with EmbeddedNats(tmp_path / "always" / "nats", fsync="always") as server:
        assert server.jetstream_config()["sync_always"] is True
        assert "sync_interval: always" in server.config_path.read_text()
    with EmbeddedNats(tmp_path / "default" / "nats") as server:
        config = server.jetstream_config()
        assert not config.get("sync_always") and config["sync_interval"] == 120 * 10**9  # 2 minutes, in ns
    with pytest.raises(ValueError):
        EmbeddedNats(tmp_path / "x", fsync="sometimes")  # type: ignore[arg-type]


async def test_rollbus_up_applies_its_limits_and_fsync_and_prints_them(tmp_path: Path, capsys):
    options = StackOptions(data_dir=tmp_path / "data", components=("projector",), log=LogConfig(),
                           retention=Retention(max_age_s=30 * DAY, max_bytes=512 << 20), fsync="always")
    stack = Stack(options)
    await stack.start()
    try:
        assert stack.nats is not None
        assert (await asyncio.to_thread(stack.nats.jetstream_config))["sync_always"] is True
        client = await connect(stack.nats_url, name="check")
        config = (await client.jetstream().stream_info(options.log.stream)).config
        await client.close()
        assert (config.max_age, config.max_bytes) == (30 * DAY, 512 << 20)
        _announce(stack)
    finally:
        await stack.stop()
    out = capsys.readouterr().out
    assert "  log limits:   max age 30d, max bytes 512 MiB (when full: new appends refused, nothing deleted); " \
           "JetStream store limit " in out
    assert "  fsync:        always (sync_interval: always: every write is on disk before it is acknowledged)" in out
