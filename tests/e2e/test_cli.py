"""``rollbus up`` as a newcomer runs it: a real process with embedded NATS, stopped with SIGTERM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx

from rollbus.testing.scripted import ScriptedEngineServer
from tests.processes import CliProcess


class Up(CliProcess):
    def __init__(self, data_dir: Path, engine_url: str | None = None, *args: str, engine: str = "sglang") -> None:
        cmd = ["up", "--port", "0", "--data-dir", str(data_dir), "--admin-token", "tok", *args]
        if engine_url is not None:
            cmd += ["--engine", engine, "--engine-url", engine_url]
        super().__init__(cmd)
        # A stack hosting Ray and TransferQueue took over 180 s to start beside the whole suite and two
        # `yes` processes on the 2-core VM (issue 26's loaded runs)
        timeout = 360.0 if "--transfer-queue" in args else 180.0
        self.url, _ = self.started(r"edge:\s+(http://\S+)", r"Ctrl-C", timeout=timeout)


def test_up_restart_keeps_the_log(tmp_path: Path):
    data = tmp_path / "data"
    headers = {"Authorization": "Bearer tok"}
    with ScriptedEngineServer() as engine:
        first = Up(data, engine.url)
        try:
            assert httpx.get(f"{first.url}/healthz").status_code == 200
            created = httpx.post(f"{first.url}/sessions", json={"uid": "keep"}, headers=headers).json()
            assert (data / "edge.json").exists()
        finally:
            assert first.stop() == 0, "".join(first.lines)
        assert "rollbus: stopping" in "".join(first.lines)
        assert not (data / "edge.json").exists()
        nats_pids = subprocess.run(["pgrep", "-f", f"nats-server.*{data}"], capture_output=True, text=True).stdout
        assert nats_pids.strip() == "", "the embedded nats-server outlived rollbus up"

        second = Up(data, engine.url)
        try:
            summary = httpx.get(f"{second.url}/sessions/{created['session_id']}", headers=headers)
            assert summary.status_code == 200, summary.text
            assert summary.json()["uid"] == "keep" and summary.json()["status"] == "open"
            done = httpx.post(f"{second.url}/sessions/{created['session_id']}/finalize", headers=headers)
            assert done.json()["status"] == "finalized"
        finally:
            assert second.stop() == 0


def test_up_says_what_it_waits_for_then_its_banner_once_the_edge_answers(tmp_path: Path):
    data = tmp_path / "data"
    with ScriptedEngineServer() as engine:
        up = Up(data, engine.url)
        try:
            assert httpx.get(f"{up.url}/healthz").status_code == 200  # the banner came once it answers
        finally:
            assert up.stop() == 0
    banner = next(i for i, line in enumerate(up.lines) if line.endswith(" running\n"))
    said = [line.removeprefix("rollbus up: ").rstrip("\n") for line in up.lines[:banner]
            if line.startswith("rollbus up: ") and ": done in " not in line]  # (a slow stage's end, if any)
    assert said == [f"starting the embedded nats-server (store {data / 'nats'})",
                    "provisioning the log's streams and buckets", "starting the projector", "starting the materializer",
                    f"loading the engine (sglang {engine.url})", f"waiting for the edge to answer {up.url}/healthz"]
    assert "rollbus up: waiting" not in "".join(up.lines[banner:])  # nothing said after the banner


def test_console_script_is_installed():
    bindir = os.path.dirname(sys.executable)
    result = subprocess.run([os.path.join(bindir, "rollbus"), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for command in ("up", "edge", "projector", "materializer", "demo"):
        assert command in result.stdout
