"""The stack supervises itself: a killed nats-server is restarted on its store, ``/healthz`` says what
is down, the store is locked to one ``rollbus up``, and the server dies with the process that owns it.

Real processes throughout: ``rollbus up`` as a subprocess (as in ``test_cli.py``) in front of the
scripted SGLang engine, its real nats-server child, and ``kill -9``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from edge.tokens.tokenizer import Tokenizer
from rollbus.testing.scripted import ScriptedEngineServer, ScriptedReply
from stack.nats_server import EmbeddedNats, NatsSupervisor
from tests.e2e.test_cli import Up
from tests.e2e.test_cli_mistakes import refused, rollbus
from tests.e2e.test_openai_session import wait_for_parquet

IM_END = 151645
ADMIN = {"Authorization": "Bearer tok"}


def eventually(condition: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """Runs, and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def nats_child(up: Up) -> int:
    """The pid of the nats-server child of a ``rollbus up`` process."""
    children = subprocess.run(["pgrep", "-P", str(up.proc.pid), "nats-server"], capture_output=True, text=True)
    (pid,) = children.stdout.split()
    return int(pid)


def healthz(url: str) -> httpx.Response:
    return httpx.get(f"{url}/healthz", timeout=2)


def healthz_until(url: str, status: int, timeout: float) -> httpx.Response:
    """The first ``/healthz`` answer with ``status``."""
    deadline = time.monotonic() + timeout
    while (answer := healthz(url)).status_code != status:
        assert time.monotonic() < deadline, f"/healthz did not answer {status} within {timeout}s: {answer.text}"
        time.sleep(0.02)
    return answer


def starts(data: Path) -> int:
    """How many nats-servers have started on the store (each logs one line to ``<data>/nats.log``)."""
    return (data / "nats.log").read_text().count("Starting nats-server")


@pytest.fixture
def engine() -> Iterator[ScriptedEngineServer]:
    with ScriptedEngineServer() as server:
        yield server


@pytest.fixture
def up(tmp_path: Path, engine: ScriptedEngineServer) -> Iterator[Up]:
    running = Up(tmp_path / "data", engine.url)
    yield running
    if running.proc.poll() is None:
        running.stop()


def turn(up: Up, engine: ScriptedEngineServer, tokenizer: Tokenizer, session: dict, messages: list[dict],
         text: str) -> str:
    """One OpenAI turn, not retried: what the agent got back."""
    engine.push(ScriptedReply(token_ids=[*tokenizer.encode(text), IM_END]))
    client = OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0, timeout=30)
    answer = client.chat.completions.create(model="m", messages=messages).choices[0].message.content or ""
    messages.append({"role": "assistant", "content": answer})
    return answer


def test_a_killed_nats_server_is_restarted_on_its_store_and_the_stack_recovers(
        up: Up, engine: ScriptedEngineServer, tokenizer: Tokenizer, tmp_path: Path) -> None:
    data = tmp_path / "data"
    nats_url = json.loads((data / "edge.json").read_text())["nats_url"]
    session = httpx.post(f"{up.url}/sessions", json={"uid": "survives"}, headers=ADMIN).json()
    messages = [{"role": "user", "content": "Hello?"}]
    assert turn(up, engine, tokenizer, session, messages, "Hi.") == "Hi."
    first = nats_child(up)

    os.kill(first, signal.SIGKILL)
    template = {"chat_template": {"mode": "prefix-stable"}}  # (builtin:qwen2.5's)
    assert healthz_until(up.url, 503, 5).json() == {"status": "unavailable", "failing": ["nats"], **template}
    assert healthz_until(up.url, 200, 20).json() == {"status": "ok", **template}

    second = nats_child(up)
    assert second != first and not alive(first)
    assert json.loads((data / "edge.json").read_text())["nats_url"] == nats_url  # the same port: clients reconnected
    messages.append({"role": "user", "content": "Still there?"})
    assert turn(up, engine, tokenizer, session, messages, "Yes.") == "Yes."
    summary = httpx.get(f"{up.url}/sessions/{session['session_id']}", headers=ADMIN).json()
    assert summary["status"] == "open" and summary["turns"] == 2, summary  # the first turn survived on the store
    final = httpx.post(f"{up.url}/sessions/{session['session_id']}/finalize", headers=ADMIN).json()
    assert final["trajectories"] == 1, final
    (row,) = wait_for_parquet(data / "trajectories", session["session_id"], timeout=15)  # projector, materializer
    response = tokenizer.decode(list(row["responses"]))
    assert "Hi." in response and "Still there?" in response and "Yes." in response  # the turns before and after
    assert up.stop() == 0
    log = "".join(up.lines)
    assert f"nats-server (pid {first}) on {data / 'nats'} died: killed by SIGKILL" in log
    assert "restarting nats-server on" in log and "restarted on" in log
    assert starts(data) == 2


def test_rollbus_up_killed_takes_its_nats_server_with_it(up: Up, engine: ScriptedEngineServer,
                                                         tmp_path: Path) -> None:
    data = tmp_path / "data"
    session = httpx.post(f"{up.url}/sessions", json={"uid": "orphan"}, headers=ADMIN).json()
    server = nats_child(up)
    up.proc.kill()
    up.proc.wait(10)
    eventually(lambda: not alive(server), 10, what="exit of the nats-server once its rollbus up was killed")

    again = Up(data, engine.url)  # takes the store over: the lock died with the first
    try:
        summary = httpx.get(f"{again.url}/sessions/{session['session_id']}", headers=ADMIN)
        assert summary.status_code == 200 and summary.json()["uid"] == "orphan", summary.text
    finally:
        assert again.stop() == 0
    assert starts(data) == 2


ORPHAN_OWNER = """
import sys, time
from stack.nats_server import EmbeddedNats
server = EmbeddedNats(sys.argv[1], name="rollbus").start()  # without die_with_parent, as before
print(server.pid, flush=True)
time.sleep(120)
"""


def test_rollbus_up_stops_a_server_orphaned_on_its_store_before_it_opens_the_store(
        engine: ScriptedEngineServer, tmp_path: Path) -> None:
    data = tmp_path / "data"
    owner = subprocess.Popen([sys.executable, "-c", ORPHAN_OWNER, str(data / "nats")], stdout=subprocess.PIPE,
                             text=True)
    assert owner.stdout is not None
    orphan = int(owner.stdout.readline())
    owner.kill()  # the owner dies; its server runs on, alone on the store
    owner.wait(10)
    assert alive(orphan)
    try:
        up = Up(data, engine.url)
    finally:
        if alive(orphan):
            os.kill(orphan, signal.SIGKILL)
    try:
        assert not alive(orphan)
        assert healthz(up.url).status_code == 200
    finally:
        assert up.stop() == 0
    assert f"stopping nats-server pid {orphan} left running on {data / 'nats'}" in "".join(up.lines)
    log = (data / "nats.log").read_text()
    assert log.index("Server Exiting") < log.rindex("Starting nats-server"), "the orphan stopped first"


def test_a_second_rollbus_up_on_the_same_data_dir_is_refused(up: Up, tmp_path: Path) -> None:
    data = tmp_path / "data"
    server = nats_child(up)
    line = refused(rollbus("up", "--port", "0", "--data-dir", data, timeout=120),
                   f"--data-dir {data} is in use", f"pid {up.proc.pid}")
    assert line.startswith("rollbus up: ")
    assert healthz(up.url).status_code == 200
    assert nats_child(up) == server and alive(server)
    assert starts(data) == 1, "the second rollbus up opened the store"


def test_the_supervisor_gives_up_after_repeated_fast_failures(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    supervisor = NatsSupervisor(EmbeddedNats(tmp_path / "store", die_with_parent=True), backoff_s=0.05,
                                max_failures=2)
    supervisor.start()
    try:
        url = supervisor.url
        for restart in (1, 2):
            os.kill(supervisor.server.pid, signal.SIGKILL)
            eventually(lambda n=restart: supervisor.healthy and supervisor.restarts == n, 10, what=f"restart {restart}")
            assert supervisor.url == url and supervisor.server.running
        os.kill(supervisor.server.pid, signal.SIGKILL)
        eventually(lambda: supervisor.state == "failed", 10, what="giving up")
        time.sleep(0.3)
        assert not supervisor.server.running and supervisor.restarts == 2 and not supervisor.healthy
    finally:
        supervisor.stop()
    assert supervisor.state == "failed"
    assert caplog.text.count("restarting nats-server on") == 2
    assert "failed 3 times in a row; giving up" in caplog.text


def test_the_supervised_server_outlives_the_thread_that_started_it(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG fires when the *thread* that forked the server exits: the supervisor forks from a
    thread of its own, so a caller's worker thread (``asyncio.to_thread``) may come and go."""
    supervisor = NatsSupervisor(EmbeddedNats(tmp_path / "a", die_with_parent=True))
    unsupervised = EmbeddedNats(tmp_path / "b", die_with_parent=True)

    def start() -> None:
        supervisor.start()
        unsupervised.start()

    worker = threading.Thread(target=start)
    worker.start()
    worker.join()
    try:
        eventually(lambda: unsupervised.poll() is not None, 5, what="exit of the server the finished thread forked")
        assert 'Trapped "terminated" signal' in unsupervised.log_path.read_text()  # SIGTERM: a clean exit
        time.sleep(0.3)
        assert supervisor.healthy and supervisor.server.running and supervisor.restarts == 0
    finally:
        supervisor.stop()
        unsupervised.stop()
    assert supervisor.state == "stopped" and not alive(supervisor.server.pid)
