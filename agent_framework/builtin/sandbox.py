"""Where tools run: the :class:`Sandbox` protocol and the ``local`` sandbox that confines for real.

A sandbox has a root directory; ``run`` executes a command there and reports how it
ended as an :class:`ExecResult`; ``read_file`` / ``write_file`` / ``list_dir`` take paths
relative to the root and refuse any that escape it (``..``, absolute paths elsewhere,
symlinks pointing out), raising :class:`SandboxPathError`.

The ``local`` sandbox (:class:`LocalSandbox`) runs each command as a child process:

- its own temporary directory as cwd, ``HOME`` and ``TMPDIR`` (``<root>/.tmp``), removed
  on :meth:`~LocalSandbox.close`; the environment is rebuilt, not inherited (no keys leak);
- ``RLIMIT_CPU`` (SIGXCPU at ``cpu_s``, SIGKILL a second later), ``RLIMIT_AS``
  (``memory_mb``), ``RLIMIT_FSIZE`` (``file_size_mb``), no core dumps;
- a wall-clock limit after which its whole process group is killed (``start_new_session``
  and ``os.killpg(SIGKILL)``); the group is killed after every command anyway, so nothing
  it started in the background outlives the call;
- stdout and stderr captured up to ``max_output_bytes`` each (the head and the tail kept,
  a marker in between);
- no network: every command runs in a new, empty network namespace
  (``unshare(CLONE_NEWNET)`` through libc in the child, before exec), where even the
  loopback is down. That takes root (CAP_SYS_ADMIN); without it, opening the sandbox
  fails with :class:`SandboxUnavailable` unless ``network="host"`` was configured.
  (The child's setup is a ``preexec_fn``, which CPython warns can deadlock in a threaded
  program when it takes a lock; this one only calls ``unshare`` and ``setrlimit``.)

Why a command died is ``killed_reason``: ``"wall"`` (our timer), ``"cpu"`` (SIGXCPU, or
SIGKILL once the CPU limit's hard second passed), ``"memory"`` (a failed allocation
reported on stderr: Python's ``MemoryError``, ``Cannot allocate memory``, ``bad_alloc``),
``"file_size"`` (SIGXFSZ), ``"signal"`` (any other signal).

Not confined: the rest of the filesystem stays readable (and writable where the user may
write), and a process that leaves its session (``setsid``) escapes the group kill.

Errors: ``SandboxError`` -> ``SandboxUnavailable`` (cannot confine as configured),
``SandboxPathError`` (a path outside the root).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Literal, Protocol

import msgspec

from agent_framework.builtin.registry import Registry
from schemas.errors import SandboxError, SandboxPathError, SandboxUnavailable

KilledReason = Literal["cpu", "memory", "wall", "file_size", "signal"]
CLONE_NEWNET = 0x40000000
# BLAS pools reserve address space per thread: one thread keeps ``import numpy`` inside RLIMIT_AS
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_MEMORY_MARKERS = re.compile(rb"MemoryError|Cannot allocate memory|bad_alloc|out of memory", re.IGNORECASE)


class SandboxConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: str = "local"
    cpu_s: int = 10  # CPU seconds per command
    memory_mb: int = 1024  # address space per process
    wall_s: float = 30.0  # wall clock per command (``run(timeout=)`` overrides)
    file_size_mb: int = 64  # largest file a command may write
    max_output_bytes: int = 65536  # of stdout and of stderr, each
    network: Literal["none", "host"] = "none"  # "host" only when asked for: never silently
    python: str = ""  # the interpreter the python tool runs; "": this process's own


class ExecResult(msgspec.Struct, frozen=True, kw_only=True):
    exit_code: int  # negative: killed by that signal
    stdout: str
    stderr: str
    killed_reason: KilledReason | None = None
    duration_s: float = 0.0
    truncated: bool = False  # some output was left out

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None


class Sandbox(Protocol):
    python: str

    async def run(self, command: str | Sequence[str], *, stdin: str | bytes | None = None,
                  timeout: float | None = None) -> ExecResult: ...

    async def write_file(self, path: str, content: str) -> None: ...

    async def read_file(self, path: str) -> str: ...

    async def list_dir(self, path: str) -> list[str]: ...

    async def close(self) -> None: ...


SandboxFactory = Callable[[SandboxConfig], Awaitable[Sandbox]]
SANDBOXES: Registry[SandboxFactory] = Registry("sandbox")
register_sandbox = SANDBOXES.register


def inside(root: Path, path: str) -> Path:
    """``path`` (relative to ``root``, or absolute under it) resolved, symlinks followed; refused outside."""
    if not path or "\x00" in path:
        raise SandboxPathError(f"invalid path {path!r}")
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root):
        raise SandboxPathError(f"path {path!r} is outside the sandbox root")
    return resolved


class _Capture:
    """At most ``limit`` bytes of a stream: its head and its tail; the rest counted, not kept."""

    def __init__(self, limit: int) -> None:
        self._half = max(1, limit // 2)
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    async def drain(self, stream: asyncio.StreamReader | None) -> None:
        while stream is not None and (chunk := await stream.read(65536)):
            self.total += len(chunk)
            room = self._half - len(self._head)
            self._head += chunk[:room]
            self._tail += chunk[max(room, 0):]
            del self._tail[:-self._half]

    @property
    def truncated(self) -> bool:
        return self.total > len(self._head) + len(self._tail)

    def raw(self) -> bytes:
        return bytes(self._head + self._tail)

    def text(self) -> str:
        if not self.truncated:
            return self.raw().decode(errors="replace")
        omitted = self.total - len(self._head) - len(self._tail)
        return (self._head.decode(errors="replace") + f"\n[... {omitted} bytes of output omitted ...]\n"
                + self._tail.decode(errors="replace"))


def _load_unshare() -> Callable[[int], int]:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.unshare  # resolved here, in the parent: the child only calls it


def _confine(config: SandboxConfig) -> Callable[[], None]:
    """The child's setup between fork and exec: a new network namespace, then the limits."""
    unshare = _load_unshare() if config.network == "none" else None
    mib = 1024 * 1024
    limits = [(resource.RLIMIT_CPU, (config.cpu_s, config.cpu_s + 1)),
              (resource.RLIMIT_AS, (config.memory_mb * mib,) * 2),
              (resource.RLIMIT_FSIZE, (config.file_size_mb * mib,) * 2),
              (resource.RLIMIT_CORE, (0, 0))]

    def child() -> None:
        if unshare is not None and unshare(CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
        for which, value in limits:
            resource.setrlimit(which, value)

    return child


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _signal_of(code: int, shell: bool) -> int | None:
    """The signal that ended the command (a shell reports its child's as 128 + n)."""
    if code < 0:
        return -code
    return code - 128 if shell and 128 < code < 128 + 65 else None


def killed_reason(code: int, *, wall: bool, shell: bool, stderr: bytes, elapsed: float,
                  cpu_s: int) -> KilledReason | None:
    sig = _signal_of(code, shell)
    if wall and code == -signal.SIGKILL:  # our kill at the deadline (not an exit that beat it)
        return "wall"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and elapsed >= cpu_s):
        return "cpu"
    if sig == signal.SIGXFSZ:
        return "file_size"
    if code != 0 and _MEMORY_MARKERS.search(stderr):
        return "memory"
    return "signal" if sig is not None else None


class _Child(asyncio.subprocess.SubprocessStreamProtocol):
    """The child's pipes as streams, and ``exited`` as soon as it exits.

    (``Process.wait()`` on Python 3.11 also waits for the pipes to close, which a background
    grandchild holding them open would delay until the wall limit.)
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=65536, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


class LocalSandbox:
    """Child processes in a temporary directory, under rlimits, a wall clock and no network."""

    def __init__(self, config: SandboxConfig, root: Path) -> None:
        self.config = config
        self.root = root
        self.python = config.python or sys.executable
        self._groups: set[int] = set()
        self._closed = False
        self._confine = _confine(config)

    @classmethod
    async def open(cls, config: SandboxConfig) -> LocalSandbox:
        """A fresh root; fails with :class:`SandboxUnavailable` when it cannot confine as configured."""
        sandbox = cls(config, await asyncio.to_thread(_make_root))
        try:
            await sandbox.run(["true"])
        except BaseException:
            await sandbox.close()
            raise
        return sandbox

    def _env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.root),
                "TMPDIR": str(self.root / ".tmp"), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
                "PYTHONDONTWRITEBYTECODE": "1", **_ONE_THREAD}

    async def _spawn(self, argv: list[str], stdin: bool) -> tuple[asyncio.SubprocessTransport, _Child]:
        if self._closed:
            raise SandboxError("the sandbox is closed")
        loop, pipe = asyncio.get_running_loop(), subprocess.PIPE
        try:
            return await loop.subprocess_exec(
                lambda: _Child(loop), *argv, cwd=self.root, env=self._env(),
                stdin=pipe if stdin else subprocess.DEVNULL, stdout=pipe, stderr=pipe, start_new_session=True,
                preexec_fn=self._confine)
        except subprocess.SubprocessError as exc:  # the child's setup raised: no namespace, or a limit refused
            raise SandboxUnavailable(
                "cannot start a confined process (a new network namespace needs root / CAP_SYS_ADMIN); "
                "configure the sandbox with network='host' to run with the host's network explicitly") from exc

    async def run(self, command: str | Sequence[str], *, stdin: str | bytes | None = None,
                  timeout: float | None = None) -> ExecResult:
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        wall_s = self.config.wall_s if timeout is None else timeout
        start = time.monotonic()
        transport, child = await self._spawn(argv, stdin is not None)
        pgid = transport.get_pid()
        self._groups.add(pgid)
        out, err = _Capture(self.config.max_output_bytes), _Capture(self.config.max_output_bytes)
        pumps = [asyncio.create_task(out.drain(child.stdout)), asyncio.create_task(err.drain(child.stderr)),
                 asyncio.create_task(_feed(child.stdin, stdin))]
        try:
            wall = not await _done_within(child.exited, wall_s)
        finally:
            _killpg(pgid)  # the wall limit, or whatever it left running in the background
            self._groups.discard(pgid)
            await _done_within(child.exited, 5.0)
            await _settle(pumps)
            transport.close()
        code = transport.get_returncode()
        code = -signal.SIGKILL if code is None else code
        elapsed = time.monotonic() - start
        reason = killed_reason(code, wall=wall, shell=isinstance(command, str), stderr=err.raw(), elapsed=elapsed,
                               cpu_s=self.config.cpu_s)
        return ExecResult(exit_code=code, stdout=out.text(), stderr=err.text(), killed_reason=reason,
                          duration_s=elapsed, truncated=out.truncated or err.truncated)

    async def write_file(self, path: str, content: str) -> None:
        await asyncio.to_thread(_write, inside(self.root, path), content)

    async def read_file(self, path: str) -> str:
        return await asyncio.to_thread(inside(self.root, path).read_text, errors="replace")

    async def list_dir(self, path: str = ".") -> list[str]:
        return await asyncio.to_thread(_listing, inside(self.root, path))

    async def close(self) -> None:
        """Kill what still runs and remove the root; idempotent."""
        self._closed = True
        for pgid in list(self._groups):
            _killpg(pgid)
        await asyncio.to_thread(shutil.rmtree, self.root, True)

    async def __aenter__(self) -> LocalSandbox:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


def _make_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="rollbus-sandbox-")).resolve()
    (root / ".tmp").mkdir()
    return root


def _write(target: Path, content: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content)


def _listing(directory: Path) -> list[str]:
    return sorted(f"{p.name}/" if p.is_dir() else p.name for p in directory.iterdir())


async def _done_within(future: asyncio.Future[None], seconds: float) -> bool:
    try:
        await asyncio.wait_for(asyncio.shield(future), seconds)
    except TimeoutError:
        return False
    return True


async def _feed(writer: asyncio.StreamWriter | None, data: str | bytes | None) -> None:
    if data is None or writer is None:
        return
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        writer.write(data.encode() if isinstance(data, str) else data)
        await writer.drain()
        writer.close()


async def _settle(pumps: list[asyncio.Task[None]], grace_s: float = 1.0) -> None:
    """Let the pipes drain; a process that escaped the group may hold them open: stop reading then."""
    _, pending = await asyncio.wait(pumps, timeout=grace_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pumps, return_exceptions=True)


@register_sandbox("local")
async def open_local(config: SandboxConfig) -> Sandbox:
    return await LocalSandbox.open(config)
