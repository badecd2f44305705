"""A user's mistake on the command line is one line on stderr and exit status 2, never a traceback.

Each test runs the CLI as a real process, as ``tests/e2e/test_cli.py`` does, and fails fast: a
port this test holds, a NATS port nothing listens on, paths under ``tmp_path``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from rollbus.cli import build_parser
from rollbus.commands.archive_io import ArchiveWriter
from schemas.archive import ArchiveHeader
from tests.e2e.conftest import ADMIN_TOKEN

ROLLBUS = [sys.executable, "-m", "rollbus.cli"]
EXIT_ERROR = 2
RUNNING_AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def rollbus(*args: str | Path, prefix: Sequence[str] = (), timeout: float = 120,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``env``: variables set on top of this process's."""
    env = {**os.environ, "ROLLBUS_NATS": "", "ROLLBUS_ADMIN_TOKEN": "", **(env or {})}  # the test's own flags only
    return subprocess.run([*prefix, *ROLLBUS, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env)


def refused(result: subprocess.CompletedProcess, *needles: str) -> str:
    """The one line ``result`` printed on stderr, once it is sure to be a refusal that names ``needles``."""
    everything = result.stdout + result.stderr
    assert "Traceback" not in everything, everything
    assert result.returncode == EXIT_ERROR, everything
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"not one line on stderr:\n{result.stderr}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (the kernel's pick, released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# 1. a busy port

def test_up_on_a_port_something_listens_on(tmp_path: Path, busy_port: int):
    line = refused(rollbus("up", "--port", str(busy_port), "--data-dir", tmp_path / "data"),
                   f"127.0.0.1:{busy_port}", "in use", "--port")
    assert line.startswith("rollbus up: ")
    assert not (tmp_path / "data" / "nats").exists(), "the port is checked before anything starts"


# 2. --nats pointing at nothing

NATS_COMMANDS = {
    "up": ["up", "--port", "0"],
    "edge": ["edge", "--port", "0", "--engine", "sglang", "--engine-url", "http://127.0.0.1:9"],
    "projector": ["projector"],
    "materializer": ["materializer"],
    "replay": ["replay", "0123456789abcdef0123456789abcdef"],
    "sessions": ["sessions"],
    "materialize": ["materialize", "--from-log", "--out", "{tmp}/out"],
}


@pytest.mark.parametrize("command", list(NATS_COMMANDS))
def test_nats_url_with_no_server_behind_it(tmp_path: Path, command: str):
    url = f"nats://127.0.0.1:{closed_port()}"
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in NATS_COMMANDS[command]]
    result = rollbus(*argv, "--nats", url, "--data-dir", tmp_path / "data")
    refused(result, f"no NATS server at {url}", "connection refused")
    assert not (tmp_path / "data" / "nats").exists(), "no embedded nats-server was started instead"


def test_a_stale_edge_json_names_its_nats_server(tmp_path: Path):
    """``sessions`` / ``replay`` without --nats take the URL from edge.json: the line says so."""
    data = tmp_path / "data"
    data.mkdir()
    url = f"nats://127.0.0.1:{closed_port()}"
    (data / "edge.json").write_text(json.dumps({"url": "http://127.0.0.1:1", "admin_token": "x", "nats_url": url,
                                                "pid": 1}))
    refused(rollbus("sessions", "--data-dir", data), f"no NATS server at {url}", "edge.json")


# 3. --model naming a missing file

@pytest.mark.parametrize("model", ["missing.gguf", "missing-model-dir"])
def test_up_with_a_model_that_is_not_there(tmp_path: Path, model: str):
    path = tmp_path / model
    refused(rollbus("up", "--port", "0", "--data-dir", tmp_path / "data", "--model", path),
            f"--model {path}", "nothing is downloaded")
    assert not (tmp_path / "data" / "nats").exists(), "the model is checked before anything starts"


def test_up_with_a_model_dir_that_holds_no_model(tmp_path: Path):
    (tmp_path / "empty").mkdir()
    refused(rollbus("up", "--port", "0", "--data-dir", tmp_path / "data", "--model", tmp_path / "empty"),
            f"--model {tmp_path / 'empty'}", "config.json")


def test_demo_with_a_model_that_is_not_there(tmp_path: Path):
    path = tmp_path / "missing.gguf"
    refused(rollbus("demo", "--data-dir", tmp_path / "data", "--model", path), f"--model {path}")


def test_up_with_a_remote_engine_and_no_url(tmp_path: Path):
    refused(rollbus("up", "--engine", "sglang", "--data-dir", tmp_path / "data"), "--engine-url")


@pytest.mark.parametrize(("flags", "needles"), [
    (["--processor", "builtin:nope"], ["--processor builtin:nope", "builtin:qwen2.5-vl"]),
    (["--processor", "missing-processor-dir"], ["--processor missing-processor-dir", "preprocessor_config.json"]),
    (["--processor", "builtin:qwen2.5-vl", "--engine", "vllm", "--engine-url", "http://127.0.0.1:9"],
     ["--processor", "vllm engine takes no images"]),
    (["--image-max-bytes", "0"], ["--image-max-bytes", "more than 0"]),
    (["--processor", "builtin:qwen2.5-vl"], ["local model tiny-qwen2 takes no images", "tiny-qwen2-vl"]),
])
def test_up_with_a_processor_that_cannot_be(tmp_path: Path, flags: list[str], needles: list[str]):
    refused(rollbus("up", "--port", "0", "--data-dir", tmp_path / "data", *flags), *needles)
    assert not (tmp_path / "data" / "nats").exists(), "the processor is checked before anything starts"


# 4. an unusable --data-dir

def _a_file(tmp_path: Path) -> Path:
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return path


def test_data_dir_under_a_file(tmp_path: Path):
    path = _a_file(tmp_path) / "data"
    refused(rollbus("up", "--port", "0", "--data-dir", path), f"--data-dir {path}", "cannot create")


@pytest.mark.skipif(RUNNING_AS_ROOT, reason="running as root: permission bits do not stop root's writes "
                                            "(test_data_dir_on_a_read_only_file_system covers it)")
def test_data_dir_without_write_permission(tmp_path: Path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        refused(rollbus("up", "--port", "0", "--data-dir", locked), f"--data-dir {locked}", "permission denied")
        refused(rollbus("up", "--port", "0", "--data-dir", locked / "data"), "permission denied")
    finally:
        locked.chmod(0o755)


def _read_only_mount(directory: Path) -> list[str]:
    """A command prefix that runs its command with ``directory`` mounted read-only (a private mount
    namespace: root's, else a user namespace's); skips the test where that is not allowed."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) to mount a read-only file system")
    mount = (f'mount --bind "{directory}" "{directory}" && mount -o remount,bind,ro "{directory}" && exec "$@"')
    prefix = [unshare, "-m", *([] if RUNNING_AS_ROOT else ["-r"]), "sh", "-c", mount, "sh"]
    probe = subprocess.run([*prefix, "sh", "-c", f'! touch "{directory}/probe"'], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount {directory} read-only here: {probe.stderr.decode().strip()}")
    return prefix


def _archive(tmp_path: Path) -> Path:
    """A valid (empty) export: its header only."""
    path = tmp_path / "empty.jsonl"
    with ArchiveWriter(path, "jsonl") as write:
        write(ArchiveHeader(stream="rollbus", prefix="rollbus", selection="all", exported_at="2026-01-01T00:00:00"))
    return path


# Every command that opens the log, or starts a stack, on --data-dir (an embedded nats-server on its nats/).
DATA_DIR_COMMANDS: dict[str, list[str | Path]] = {
    "up": ["up", "--port", "0"], "demo": ["demo", "--model", "tiny-qwen2"],
    "materialize": ["materialize", "--from-log", "--out", "{tmp}/out"], "import": ["import", "{tmp}/empty.jsonl"],
    "replay": ["replay", "--verify", "--all"], "sessions": ["sessions"], "export": ["export", "--all", "-o",
                                                                                    "{tmp}/x.jsonl"],
    "view": ["view", "--port", "0"],
}


def _argv(tmp_path: Path, command: str) -> list[str]:
    _archive(tmp_path)
    return [str(arg).replace("{tmp}", str(tmp_path)) for arg in DATA_DIR_COMMANDS[command]]


@pytest.mark.parametrize("command", list(DATA_DIR_COMMANDS))
def test_data_dir_on_a_read_only_file_system(tmp_path: Path, command: str):
    data = tmp_path / "data"
    (data / "nats").mkdir(parents=True)  # a stack's store, to open with an embedded server
    result = rollbus(*_argv(tmp_path, command), "--data-dir", data, prefix=_read_only_mount(data))
    refused(result, f"--data-dir {data}", "read-only file system")


@pytest.mark.parametrize("command", list(DATA_DIR_COMMANDS))
def test_a_data_dir_that_is_a_file(tmp_path: Path, command: str):
    path = _a_file(tmp_path)
    refused(rollbus(*_argv(tmp_path, command), "--data-dir", path), f"--data-dir {path}", "is a file")


def test_materialize_with_an_out_that_is_a_file(tmp_path: Path):
    path = _a_file(tmp_path)
    (tmp_path / "data" / "nats").mkdir(parents=True)
    refused(rollbus("materialize", "--from-log", "--out", path, "--data-dir", tmp_path / "data"),
            f"--out {path}", "is a file")


@pytest.mark.parametrize("command", ["materialize", "replay", "sessions", "export", "view"])
def test_no_log_in_the_data_dir(tmp_path: Path, command: str):
    """Without --nats or a running stack, a --data-dir with no nats/ store is a mistake (materialize used to
    start an empty log and rematerialize nothing); only import creates a store."""
    refused(rollbus(*_argv(tmp_path, command), "--data-dir", tmp_path / "typo"), "no log",
            f"--data-dir {tmp_path / 'typo'}")
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("damage", ["truncated", "not-parquet", "empty"])
def test_import_of_a_damaged_archive(tmp_path: Path, damage: str):
    """A damaged export is refused in one line before any log is opened (no store is created for it)."""
    path = tmp_path / "log.parquet"
    with ArchiveWriter(path, "parquet") as write:
        write(ArchiveHeader(stream="rollbus", prefix="rollbus", selection="all", exported_at="2026-01-01T00:00:00"))
    whole = path.read_bytes()
    path.write_bytes({"truncated": whole[:len(whole) // 2], "not-parquet": b"PAR1" + b"x" * 64, "empty": b""}[damage])
    line = refused(rollbus("import", path, "--data-dir", tmp_path / "data"), str(path))
    assert line.startswith("rollbus import: ")
    assert not (tmp_path / "data").exists()


# 5. rollbus demo and its edge

def test_demo_url_with_no_edge_behind_it():
    url = f"http://127.0.0.1:{closed_port()}"
    refused(rollbus("demo", "--url", url, "--admin-token", "x"), f"no rollbus edge answered at {url}")


def test_demo_with_a_wrong_admin_token(stack):
    refused(rollbus("demo", "--url", stack.url, "--admin-token", "wrong"), stack.url, "refused the admin token")
    refused(rollbus("demo", "--url", stack.url), stack.url, "needs its admin token")


def test_demo_admin_token_applies_to_the_running_stack_too(stack, tmp_path: Path):
    """Without --url the demo finds the stack in <data-dir>/edge.json; an --admin-token given there is
    used (it was silently replaced by edge.json's), so a wrong one is refused."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "edge.json").write_text(json.dumps({"url": stack.url, "admin_token": ADMIN_TOKEN,
                                                "nats_url": stack.nats_url, "pid": os.getpid()}))
    refused(rollbus("demo", "--data-dir", data, "--admin-token", "wrong"), stack.url, "refused the admin token")


def test_demo_model_goes_with_an_embedded_stack_only():
    refused(rollbus("demo", "--url", "http://127.0.0.1:1", "--model", "tiny-qwen2"), "--model", "--url")


# 6. materialize --diff

def test_materialize_diff_against_a_missing_dataset(tmp_path: Path):
    missing = tmp_path / "earlier"
    refused(rollbus("materialize", "--from-log", "--out", tmp_path / "out", "--diff", missing,
                    "--data-dir", tmp_path / "data"), f"--diff {missing}", "no such directory")
    missing.mkdir()
    refused(rollbus("materialize", "--from-log", "--out", tmp_path / "out", "--diff", missing,
                    "--data-dir", tmp_path / "data"), f"--diff {missing}", "no dataset")
    assert not (tmp_path / "data").exists() and not (tmp_path / "out").exists(), "refused before any work"


def test_materialize_help_and_docs_give_the_exit_status_of_a_diff():
    help_text = " ".join(subprocess.run([*ROLLBUS, "materialize", "--help"], capture_output=True, text=True,
                                        timeout=60).stdout.split())
    assert "exit status: 0 when every session was read, whether or not --diff found differences" in help_text
    records = " ".join((Path(__file__).resolve().parents[2] / "docs" / "records.md").read_text().split())
    assert "The exit status is 0 whether or not the diff finds differences" in records


# 7. --help describes every flag

def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", list(_subcommands()))
def test_every_flag_has_help(command: str):
    parser = _subcommands()[command]
    bare = [action.option_strings or [action.dest] for action in parser._actions
            if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()]
    assert bare == [], f"rollbus {command}: flags without help: {bare}"


def test_demo_help_describes_every_flag():
    shown = " ".join(subprocess.run([*ROLLBUS, "demo", "--help"], capture_output=True, text=True,
                                    timeout=60).stdout.split())
    for action in _subcommands()["demo"]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.option_strings[0] in shown and action.help
        opening = " ".join(action.help.split()[:4])
        assert opening in shown, f"--help does not describe {action.option_strings[0]}: no {opening!r}"
    assert "exit status:" in shown


# and the rest of the rule: bad flag values

def test_a_bad_flag_value_is_one_line():
    refused(rollbus("up", "--port", "eighty"), "--port", "not an integer: 'eighty'", "--help")
    refused(rollbus("sessions", "--log-level", "loud"), "--log-level loud")
    refused(rollbus("demo", "--sessions", "0"), "--sessions", "at least 1")


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--max-trajectory-length", "0", "must be at least 2, not 0"),
    ("--port", "70000", "must be at most 65535"),
    ("--lease-ttl", "0", "must be more than 0"),
    ("--engine-timeout", "-5", "must be more than 0"),
    ("--engine-deadline", "0", "must be more than 0"),
    ("--health-interval", "nan", "not a finite number"),
    ("--idle-timeout", "-1", "must be at least 0"),
    ("--batch-size", "0", "must be at least 1"),
    ("--rollout-n", "-2", "must be at least 1"),
    ("--batch-delay", "inf", "not a finite number"),
    ("--ack-wait", "0", "must be more than 0"),
    ("--body-min-rate", "0", "must be more than 0"),
    ("--body-min-rate", "fast", "not a size"),
    ("--send-timeout", "0", "must be more than 0"),
])
def test_a_nonsensical_setting_is_refused_before_anything_starts(tmp_path: Path, flag: str, value: str,
                                                                 says: str):
    data_dir = tmp_path / "data"
    refused(rollbus("up", flag, value, "--data-dir", data_dir, "--port", "0") if flag != "--port"
            else rollbus("up", flag, value, "--data-dir", data_dir), flag, says)
    assert not data_dir.exists()  # nothing was started, not even the log's store


# 8. a parser that is not there, or an sglang that does not import

@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--tool-format", "sglang:nope", "sglang has no tool-call parser 'nope'; it has ["),
    ("--tool-format", "kimi_k2", "unknown tool format 'kimi_k2'; expected one of"),
    ("--reasoning-format", "sglang:nope", "sglang has no reasoning parser 'nope'; it has ["),
    ("--reasoning-format", "qwen3", "unknown reasoning format 'qwen3'; expected one of ['think'] or sglang:NAME"),
])
def test_a_parser_that_is_not_there(tmp_path: Path, flag: str, value: str, says: str):
    data_dir = tmp_path / "data"
    refused(rollbus("up", flag, value, "--data-dir", data_dir, "--port", "0"), "cannot start the edge", says)
    assert not data_dir.exists()


@pytest.mark.parametrize("flag", ["--tool-format", "--reasoning-format"])
def test_an_sglang_that_does_not_import_is_named(tmp_path: Path, flag: str):
    """Not an ImportError: a CUDA build of torchvision makes ``import sglang`` raise a RuntimeError."""
    shadow = tmp_path / "shadow" / "sglang"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    path = os.pathsep.join(p for p in (str(shadow.parent), os.environ.get("PYTHONPATH", "")) if p)
    data_dir = tmp_path / "data"
    result = rollbus("up", flag, "sglang:qwen3" if flag == "--reasoning-format" else "sglang:hermes",
                     "--data-dir", data_dir, "--port", "0", env={"PYTHONPATH": path})
    refused(result, f"{flag} sglang:", "sglang does not import (RuntimeError: operator torchvision::nms does not "
            "exist); install the sglang extra")
    assert not data_dir.exists()
