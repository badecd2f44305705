"""The local sandbox confines for real: CPU, memory, wall clock (the whole process group), no network,
its own directory; the editor stays inside the root; tool calls fail into observations, not exceptions."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from agent_framework.builtin import TASKS, LocalSandbox, SandboxConfig, SandboxPathError, call_tool
from agent_framework.builtin.sandbox import killed_reason
from agent_framework.builtin.tools import build_tools

PY = sys.executable


@pytest_asyncio.fixture
async def sandbox() -> AsyncIterator[LocalSandbox]:
    box = await LocalSandbox.open(SandboxConfig(cpu_s=1, memory_mb=256, wall_s=10))
    yield box
    await box.close()


@pytest.fixture
def listener() -> socket.socket:
    """A TCP port listening on the host's loopback (reachable from this process)."""
    server = socket.create_server(("127.0.0.1", 0))
    socket.create_connection(server.getsockname(), timeout=2).close()  # the host can reach it
    yield server
    server.close()


async def test_a_busy_loop_is_killed_at_its_cpu_limit(sandbox):
    started = time.monotonic()
    result = await sandbox.run([PY, "-c", "while True: pass"])
    assert result.killed_reason == "cpu" and result.exit_code < 0
    assert time.monotonic() - started < 5


async def test_a_busy_loop_under_a_shell_is_killed_at_its_cpu_limit(sandbox):
    result = await sandbox.run(f"{PY} -c 'while True: pass'")
    assert result.killed_reason == "cpu" and result.exit_code == 128 + 24  # the shell reports SIGXCPU


async def test_allocating_a_gibibyte_under_a_256_mib_limit_fails_as_memory(sandbox):
    result = await sandbox.run([PY, "-c", "block = bytearray(1 << 30); print('allocated')"])
    assert result.killed_reason == "memory" and "MemoryError" in result.stderr
    assert "allocated" not in result.stdout
    ok = await sandbox.run([PY, "-c", "block = bytearray(64 << 20); print('allocated')"])
    assert ok.ok and ok.stdout == "allocated\n"  # the limit is what refused, not the interpreter


async def test_the_wall_limit_kills_the_whole_process_group(sandbox):
    started = time.monotonic()
    result = await sandbox.run("sleep 30 & echo $! > child.pid; sleep 30", timeout=1)
    assert result.killed_reason == "wall" and result.exit_code == -9
    assert time.monotonic() - started < 4
    child = int((sandbox.root / "child.pid").read_text())
    await asyncio.sleep(0.1)
    assert not _alive(child), "the background child outlived the wall kill"


async def test_a_background_process_does_not_outlive_its_command(sandbox):
    result = await sandbox.run("sleep 30 & echo $!")
    assert result.ok
    await asyncio.sleep(0.1)
    assert not _alive(int(result.stdout))


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


async def test_no_network_even_to_a_port_listening_on_the_host_loopback(sandbox, listener):
    port = listener.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)\nprint('connected')"
    result = await sandbox.run([PY, "-c", code])
    assert result.exit_code == 1 and "connected" not in result.stdout
    assert "Network is unreachable" in result.stderr or "Connection refused" in result.stderr


async def test_no_dns_and_no_outbound_connections(sandbox):
    dns = await sandbox.run([PY, "-c", "import socket; socket.getaddrinfo('pypi.org', 443)"])
    assert dns.exit_code == 1 and "gaierror" in dns.stderr
    outbound = await sandbox.run([PY, "-c", "import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)"])
    assert outbound.exit_code == 1 and "Network is unreachable" in outbound.stderr


async def test_host_network_only_when_asked_for(listener):
    async with await LocalSandbox.open(SandboxConfig(network="host", wall_s=10)) as box:
        port = listener.getsockname()[1]
        result = await box.run([PY, "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), 3)"])
    assert result.ok


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0, reason="needs root and setpriv")
def test_without_the_capability_to_unshare_opening_fails_clearly_unless_host_network():
    script = ("import asyncio\nfrom agent_framework.builtin import LocalSandbox, SandboxConfig\n"
              "async def main():\n"
              "    try:\n        await LocalSandbox.open(SandboxConfig())\n"
              "    except Exception as exc:\n        print(type(exc).__name__, exc)\n"
              "    async with await LocalSandbox.open(SandboxConfig(network='host')) as box:\n"
              "        print((await box.run('echo host network')).stdout)\n"
              "asyncio.run(main())\n")
    dropped = subprocess.run(["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin", PY, "-c", script],
                             capture_output=True, text=True, timeout=60, check=True, cwd=Path(__file__).parents[2])
    assert dropped.stdout.startswith("SandboxUnavailable cannot start a confined process")
    assert "network='host'" in dropped.stdout and dropped.stdout.endswith("host network\n\n")


async def test_files_land_in_the_root_and_the_root_goes_on_close():
    box = await LocalSandbox.open(SandboxConfig())
    result = await box.run("pwd; echo $HOME; echo $TMPDIR; echo hi > made.txt; "
                           f"{PY} -c 'import tempfile; print(tempfile.gettempdir())'")
    cwd, home, tmpdir, pytemp = result.stdout.split()
    assert cwd == home == str(box.root) and tmpdir == pytemp == str(box.root / ".tmp")
    assert (box.root / "made.txt").read_text() == "hi\n"
    assert await box.read_file("made.txt") == "hi\n"
    await box.write_file("sub/dir/f.txt", "x")
    assert (box.root / "sub/dir/f.txt").read_text() == "x"
    env = await box.run("env")
    assert "OPENAI_API_KEY" not in env.stdout and "ROLLBUS" not in env.stdout  # nothing inherited
    await box.close()
    assert not box.root.exists()


async def test_output_is_bounded_with_a_marker():
    async with await LocalSandbox.open(SandboxConfig(max_output_bytes=1000)) as box:
        result = await box.run([PY, "-c", "print('a' * 100_000 + 'THE END')"])
    assert result.truncated and len(result.stdout) < 1100
    assert "bytes of output omitted" in result.stdout and result.stdout.rstrip().endswith("THE END")


def test_killed_reason_is_read_from_how_the_process_ended():
    assert killed_reason(-9, wall=True, shell=False, stderr=b"", elapsed=1, cpu_s=5) == "wall"
    assert killed_reason(-24, wall=True, shell=False, stderr=b"", elapsed=1, cpu_s=5) == "cpu"  # it beat the timer
    assert killed_reason(-9, wall=False, shell=False, stderr=b"", elapsed=6, cpu_s=5) == "cpu"  # hard limit
    assert killed_reason(-9, wall=False, shell=False, stderr=b"", elapsed=1, cpu_s=5) == "signal"
    assert killed_reason(137, wall=False, shell=False, stderr=b"", elapsed=1, cpu_s=5) is None  # not a shell
    assert killed_reason(1, wall=False, shell=False, stderr=b"std::bad_alloc", elapsed=1, cpu_s=5) == "memory"
    assert killed_reason(0, wall=False, shell=False, stderr=b"", elapsed=1, cpu_s=5) is None


# --- tools --------------------------------------------------------------------------


@pytest.fixture
def tools():
    return build_tools(["shell", "python", "str_replace_editor", "submit"])


async def test_the_editor_refuses_dotdot_absolute_and_symlink_escapes(sandbox, tools, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("top secret")
    (sandbox.root / "link").symlink_to(tmp_path)
    (sandbox.root / "file_link").symlink_to(outside)
    for path in ["../secret.txt", f"../{sandbox.root.name}/../x", str(outside), "link/secret.txt", "file_link"]:
        for args in [{"command": "view", "path": path},
                     {"command": "create", "path": path, "file_text": "pwned"},
                     {"command": "str_replace", "path": path, "old_str": "top", "new_str": "pwned"}]:
            outcome = await call_tool(tools, sandbox, "str_replace_editor", args)
            assert outcome.error and "outside the sandbox root" in outcome.observation, (path, outcome)
    assert outside.read_text() == "top secret"
    assert not (tmp_path / "x").exists()
    with pytest.raises(SandboxPathError):
        await sandbox.write_file("link/new.txt", "x")


async def test_the_editor_creates_views_replaces_and_inserts_inside_the_root(sandbox, tools):
    async def edit(**args) -> str:
        outcome = await call_tool(tools, sandbox, "str_replace_editor", args)
        assert not outcome.error, outcome.observation
        return outcome.observation

    await edit(command="create", path="pkg/m.py", file_text="a = 1\nb = 2\n")
    await edit(command="str_replace", path="pkg/m.py", old_str="b = 2", new_str="b = 3")
    await edit(command="insert", path="pkg/m.py", insert_line=0, new_str="# top")
    assert (sandbox.root / "pkg/m.py").read_text() == "# top\na = 1\nb = 3\n"
    assert await edit(command="view", path="pkg/m.py", view_range=[2, 3]) == "     2\ta = 1\n     3\tb = 3"
    assert await edit(command="view", path=".") == ".tmp/\npkg/"
    twice = await call_tool(tools, sandbox, "str_replace_editor",
                            {"command": "str_replace", "path": "pkg/m.py", "old_str": "=", "new_str": ":"})
    assert twice.error and "occurs 2 times" in twice.observation


async def test_bad_tool_calls_become_error_observations(sandbox, tools):
    cases = [("nope", "{}", "unknown tool 'nope'"), ("shell", "{not json", "not valid JSON"),
             ("shell", "[1]", "must be a JSON object"), ("shell", "{}", "missing required argument(s): command"),
             ("shell", '{"command": 3}', "must be of type string"), ("python", '{"code": "1", "x": 2}', "unknown"),
             ("str_replace_editor", '{"command": "delete", "path": "a"}', "must be one of"),
             ("str_replace_editor", '{"command": "view", "path": "missing.txt"}', "FileNotFoundError")]
    for name, arguments, message in cases:
        outcome = await call_tool(tools, sandbox, name, arguments)
        assert outcome.error and message in outcome.observation, (name, arguments, outcome.observation)


async def test_tool_observations_and_the_submitted_answer(sandbox, tools):
    python = await call_tool(tools, sandbox, "python", '{"code": "print(6 * 7)"}')
    assert python.observation == "42" and python.answer is None
    failing = await call_tool(tools, sandbox, "shell", {"command": "echo out; echo err >&2; exit 3"})
    assert failing.observation == "out\n[stderr]\nerr\n[exit code 3]" and not failing.error
    runaway = await call_tool(tools, sandbox, "python", {"code": "while True: pass"})
    assert "CPU time limit exceeded" in runaway.observation
    submitted = await call_tool(tools, sandbox, "submit", {"answer": "42"})
    assert submitted.answer == "42"


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool 'grep'; known tools: python, shell, str_replace_editor"):
        build_tools(["grep"])
    with pytest.raises(ValueError, match="known tasks: arithmetic, python_function"):
        TASKS.get("chess")
    with pytest.raises(ValueError, match="already registered"):
        TASKS.register("arithmetic")(type("Other", (), {}))
