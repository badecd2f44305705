"""The composition root: builds components from options and runs them in one event loop.

``rollbus up`` runs all of them (plus an embedded nats-server unless ``--nats`` names
one); ``rollbus edge`` / ``projector`` / ``materializer`` run one each. Business logic
lives in the packages; this module only wires them.

A stack with the embedded nats-server owns its data dir: it locks ``<data-dir>/rollbus.lock``
before anything opens the store (a second one on the dir is refused), and a
:class:`~stack.nats_server.NatsSupervisor` restarts the server if it dies.
:meth:`Stack.failing` names what is down, for ``/healthz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from granian._granian import SocketHolder
from granian.constants import HTTPModes, Interfaces
from granian.http import HTTP1Settings
from granian.log import LogLevels
from granian.server.embed import Server as EmbeddedGranian
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from edge.app import create_app
from edge.assemble import build_edge, edge_images
from edge.engines import LOCAL_MODELS, local_model, make_engine
from edge.engines.base import Engine
from edge.engines.vllm import NO_IMAGES
from edge.keeper import SessionKeeper
from edge.ownership import KvLeases
from edge.service import EdgeService
from edge.session_index import KvSessionIndex
from edge.settings import SEND_TIMEOUT_S, EdgeSettings
from edge.tokens.fidelity import load_codec
from edge.tokens.incremental import TemplateMode
from edge.tokens.tokenizer import load_tokenizer
from edge.turns import Clock
from eventlog.jetstream import JetStreamPort
from eventlog.lag import Watched
from materializer.parquet import ParquetSink
from materializer.service import Materializer
from observability.lag import watch_lag
from observability.registry import Metrics, MetricsServer
from reward.scorer import RewardScorer, load_scorer
from schemas.errors import ProvisionError, StartupError, UserError
from session_projector.projections import current_summary, iter_projections
from session_projector.service import Projector
from stack.heap import HeapKeeper
from stack.locks import BaseFileLock, Timeout, lock_holder, pid_lock, release_pid_lock
from stack.nats_server import EmbeddedNats, NatsSupervisor
from stack.options import EDGE, StackOptions
from stack.provision import connect, provision
from stack.user_error import check_writable_dir, one_line
from vision.processor import BUILTIN as PROCESSOR_BUILTIN

if TYPE_CHECKING:
    from materializer.transfer_queue import TransferQueueConnection

log = logging.getLogger(__name__)

DATA_SUBDIRS = ("nats", "trajectories", ".trajectories-staging")  # what the stack writes under --data-dir
LOCK_FILE = "rollbus.lock"  # <data-dir>/rollbus.lock: held by the stack that runs the embedded nats-server


Stage = Callable[[str], AbstractContextManager[object]]
"""What :meth:`Stack.start` reports its stages through: called with what it does as it begins (``"starting
the embedded nats-server (store ...)"``), the stage lasting as long as the context it returns (``rollbus up``
prints them: :class:`rollbus.progress.Stages`)."""
EDGE_ANSWER_TIMEOUT_S = 60.0  # start(): how long the edge may take to answer GET /healthz once it serves


def _quiet(_what: str) -> AbstractContextManager[object]:
    return contextlib.nullcontext()


class DataDirLock:
    """An exclusive lock (:mod:`filelock`, an ``flock`` on Unix) on ``<data-dir>/rollbus.lock``, taken
    before the embedded nats-server opens ``<data-dir>/nats`` and held until it is stopped: one store, one
    server.

    The kernel drops the lock when its process dies, however it dies (the nats-server child does not
    inherit it). The file names the holder's pid, for the refusal; it is never removed (removing a lock
    file races with a process that has just opened it).
    """

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_FILE
        self._lock: BaseFileLock | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`StartupError` naming the process that holds it."""
        where = self.path.parent
        lock = pid_lock(self.path)
        try:
            lock.acquire()
        except Timeout:
            raise StartupError(f"--data-dir {where} is in use by another rollbus (pid {lock_holder(self.path)}); "
                               "stop it first, or pass another --data-dir") from None
        except OSError as exc:
            raise StartupError(f"--data-dir {where}: cannot lock {LOCK_FILE} ({exc.strerror})") from exc
        self._lock = lock

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            release_pid_lock(lock)  # names no holder once free


def model_defaults(engine: str, model: str | None, tokenizer: str | None,
                   tool_format: str | None) -> tuple[str, str]:
    """The tokenizer and tool format to use: the given ones, else the local model's, else Qwen2.5's."""
    spec = local_model(model) if engine == "local" else None
    return (tokenizer or (spec.tokenizer if spec else EDGE.tokenizer),
            tool_format or (spec.tool_format if spec else EDGE.tool_format))


def model_processor(engine: str, model: str | None, processor: str | None) -> str:
    """The image processor to use: the given one, else the local model's (``tiny-qwen2-vl``'s), else none."""
    if processor is not None:
        return processor
    spec = local_model(model) if engine == "local" else None
    return spec.processor or "" if spec is not None else ""


def engine_summary(options: StackOptions) -> str:
    """One line naming the engine: ``local smollm2 (...)`` or ``sglang http://a:30000 http://b:30000``."""
    if options.engine != "local":
        return " ".join([options.engine, *options.engine_urls])
    spec = local_model(options.model)
    return f"local {spec.name} ({spec.summary})" if spec else f"local {options.model}"


def check_model(model: str | None) -> None:
    """Refuse a ``--model`` that names no built-in model and no local model directory or ``.gguf`` file."""
    if model is None or model in LOCAL_MODELS:
        return
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise StartupError(f"--model {model}: no such GGUF file (nothing is downloaded)")
        return
    if not path.exists():
        raise StartupError(f"--model {model}: no such model directory or .gguf file, and not one of "
                           f"{', '.join(LOCAL_MODELS)} (nothing is downloaded)")
    if not (path / "config.json").is_file():
        raise StartupError(f"--model {model}: not a saved model directory (it has no config.json)")


def check_options(options: StackOptions) -> None:
    """Refuse, before anything starts, an engine selection that cannot work (no model is loaded here)."""
    if options.fsync != "default" and options.nats_url:
        raise StartupError(f"--fsync {options.fsync} sets the embedded nats-server's sync_interval; for the server "
                           "at --nats, put jetstream { sync_interval: always } in its configuration")
    if "edge" not in options.components:
        return
    if options.processor:
        check_processor(options.processor, options.engine, options.model)
    if options.engine != "local":
        if options.model is not None:
            raise StartupError("--model selects the local engine's model; a remote engine serves its own")
        if not options.engine_urls:
            raise StartupError(f"--engine {options.engine} needs at least one --engine-url URL")
        return
    if options.engine_urls:
        raise StartupError("--engine-url goes with --engine sglang or vllm; the local engine runs in-process")
    check_model(options.model)
    spec = local_model(options.model)
    if spec is not None and options.tokenizer != spec.tokenizer:
        raise StartupError(f"the local model {spec.name} needs --tokenizer {spec.tokenizer} "
                           f"(got {options.tokenizer})")


def check_processor(spec: str, engine: str, model: str | None = None) -> None:
    """Refuse, before anything starts, a ``--processor`` that names no processor (it is loaded with the edge), an
    engine that takes no images, or a local model whose images need another processor (or that takes none)."""
    if engine == "vllm":
        raise StartupError(f"--processor: {NO_IMAGES}")
    if spec.startswith("builtin:") and spec != PROCESSOR_BUILTIN:
        raise StartupError(f"--processor {spec}: no such builtin (the builtin is {PROCESSOR_BUILTIN}, or give a local "
                           "Hugging Face processor directory)")
    if not spec.startswith("builtin:") and not (Path(spec) / "preprocessor_config.json").is_file():
        raise StartupError(f"--processor {spec}: not a Hugging Face processor directory (no preprocessor_config.json)")
    local = local_model(model) if engine == "local" else None
    if local is not None and local.processor is None:
        raise StartupError(f"--processor {spec}: the local model {local.name} takes no images (--model tiny-qwen2-vl "
                           "does)")
    if local is not None and local.processor != spec:
        raise StartupError(f"the local model {local.name} needs --processor {local.processor} (got {spec})")


def build_engine(options: StackOptions) -> Engine:
    """The engine ``options`` name (slow for a real local model: call it off the event loop)."""
    if options.engine != "local":
        if options.model is not None:
            raise ValueError("--model selects the local engine's model; a remote engine serves its own")
        return make_engine(options.engine, list(options.engine_urls), timeout=options.engine_timeout,
                           deadline=options.engine_deadline,
                           health_interval=options.health_interval)
    spec = local_model(options.model)
    if spec is not None and options.tokenizer != spec.tokenizer:
        raise ValueError(f"the local model {spec.name} needs --tokenizer {spec.tokenizer} (got {options.tokenizer})")
    tokenizer = load_tokenizer(options.tokenizer)
    return make_engine("local", model=options.model, decode=tokenizer.decode, tokenizer=tokenizer)


def build_edge_service(settings: EdgeSettings, nc: Client, engine: Engine, *,
                       clock: Clock = time.time, metrics: Metrics | None = None) -> EdgeService:
    """An :class:`EdgeService` writing to JetStream (through ``nc``) under leases, taking unknown sessions over
    from it; its appends and engine calls timed in ``metrics`` (a registry of its own if None)."""
    cfg = settings.log
    codec = load_codec(settings.tokenizer, settings.tool_format)  # refuses a mismatched pair, before NATS
    try:
        images = edge_images(settings, codec[0].tokenizer)
    except (UserError, ValueError, OSError) as exc:  # the processor does not load, or does not fit the tokenizer
        text = one_line(exc.message if isinstance(exc, UserError) else str(exc))
        raise StartupError(text if text.startswith("--processor") else f"--processor {settings.processor}: {text}"
                           ) from exc
    js = nc.jetstream()
    leases = KvLeases.on(js, cfg, edge_id=settings.edge_id, url=settings.public_url, ttl=settings.lease_ttl_s,
                      clock=clock)
    return build_edge(settings, JetStreamPort(nc, cfg), engine, codec=codec, clock=clock, images=images,
                      metrics=metrics if metrics is not None else Metrics(), leases=leases,
                      index=KvSessionIndex.on(js, cfg),
                      summaries=lambda session_id: current_summary(js, cfg, session_id))


def build_keeper(service: EdgeService, js: JetStreamContext, *, clock: Clock = time.time) -> SessionKeeper:
    """Lease renewal, idle timeout and orphan sweeps for an edge's sessions."""
    settings = service.settings
    return SessionKeeper(service, idle_timeout=settings.idle_timeout_s, leases=service.leases,
                         orphans=lambda: iter_projections(js, settings.log, heads_only=True), clock=clock)


def default_edge_id(port: int) -> str:
    return f"{socket.gethostname()}:{port}"


HEADER_READ_TIMEOUT_S = 10.0  # a connection that sends no whole request head for this long is closed
MAX_CONNECTIONS = 8192  # client connections served at once (granian's ``backpressure``, which counts connections,
# idle ones too, not requests); more wait in the listen backlog
LISTEN_BACKLOG = 2048
# granian's logging left to the application's: ``incremental`` keeps its default dictConfig from closing
# every handler already configured; its warnings ("embedded server is experimental") are not shown.
_GRANIAN_LOGGING: dict[str, Any] = {"version": 1, "incremental": True, "formatters": {}, "handlers": {},
                                    "loggers": {}}


class EdgeServer(EmbeddedGranian):
    """The edge's HTTP server: granian, embedded. Its Rust runtime (HTTP/1.1 parsing, connections, timeouts)
    runs on a thread of its own; the ASGI app runs on the calling event loop, beside the stack's other
    components. It does not touch signals (the stack owns SIGINT/SIGTERM); :meth:`stop` ends it gracefully
    (idle connections close, requests in flight finish), and :meth:`serve` returns once they have.

    It serves ``sock``, a listening socket from :func:`bind`, and takes it over (closes it when it stops):
    the stack holds its address from the start, and a second server on the port is refused, where granian's
    own socket (``SO_REUSEPORT`` on Linux) would share the port with it silently.

    Against clients that misbehave: a connection that has not sent a whole request head within
    ``header_read_timeout`` seconds (half a request, or idle between requests) is closed; a head over
    granian's buffer (~400 KiB) is answered 431; a response sent before the request body was read closes the
    connection after it.
    """

    def __init__(self, app: Any, sock: socket.socket, *, header_read_timeout: float = HEADER_READ_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        host, port = sock.getsockname()[:2]
        super().__init__(app, address=host, port=port, interface=Interfaces.ASGINL, http=HTTPModes.http1,
                         websockets=False, backlog=LISTEN_BACKLOG, backpressure=max_connections,
                         http1_settings=HTTP1Settings(header_read_timeout=round(header_read_timeout * 1000)),
                         log_level=LogLevels.error, log_dictconfig=_GRANIAN_LOGGING)
        self._sock: socket.socket | None = sock

    def _init_shared_socket(self) -> None:
        # granian's hook for its listener: the socket given, as granian shares one between workers (by fd)
        sock, self._sock = self._sock, None
        if sock is None:
            raise RuntimeError("an EdgeServer serves once")
        self._ssp = None
        self._shd = SocketHolder(sock.detach(), False, LISTEN_BACKLOG)


def bind(host: str, port: int, *, listen: bool = True, send_timeout: float = SEND_TIMEOUT_S) -> socket.socket:
    """A non-blocking TCP socket bound to ``host:port`` (listening unless ``listen=False``), with TCP_NODELAY
    and, on Linux, ``TCP_USER_TIMEOUT`` of ``send_timeout`` seconds.

    ``TCP_USER_TIMEOUT`` is what bounds a client that stops reading its reply: granian has no write
    timeout, and its ``send`` waits (once its buffers, ~2.8 MB, are full) for as long as the client's
    receive window stays closed, which a client that is alive but reads nothing keeps it forever. With it
    the kernel closes a connection whose reply could not be sent (a closed window) or was not acknowledged
    (a client gone without a word) for that long; granian then drops the rest of the reply. A client that
    reads, however slowly, is not affected; the turn itself never waits for the client (see
    :mod:`edge.streaming`).

    Raises :class:`StartupError` when the address cannot be had: the port is in use, needs
    privileges, or is out of range; the host is unknown or not this machine's.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # no Nagle: an SSE frame is sent at once, not held while the previous one waits for the client's
        # delayed ACK; set on the listening socket, it is inherited by every connection accepted on it
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):  # Linux; inherited by every accepted connection too
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, min(max(1, round(send_timeout * 1000)),
                                                                              2**31 - 1))  # ms, an int
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {_bind_problem(exc)}") from exc
    sock.setblocking(False)
    if listen:
        start_listening(sock, host, port)
    return sock


def start_listening(sock: socket.socket, host: str, port: int) -> None:
    """``listen()`` on a socket from :func:`bind` (another process may have taken the port since)."""
    try:
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {_bind_problem(exc)}") from exc


def _bind_problem(exc: OSError | OverflowError) -> str:
    if isinstance(exc, OverflowError):
        return "--port must be 0-65535"
    if exc.errno == errno.EADDRINUSE:
        return "the port is in use (by another rollbus up?); pass another --port, or --port 0 for any free one"
    if exc.errno == errno.EACCES:
        return "permission denied (ports below 1024 need privileges); pass another --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "--host is not an address of this machine"
    if isinstance(exc, socket.gaierror):
        return "unknown --host"
    return one_line(exc.strerror or str(exc)).lower()


class Stack:
    """The selected components, started in order and stopped in reverse."""

    def __init__(self, options: StackOptions, *, engine: Engine | None = None,
                 scorer: RewardScorer | None = None, stage: Stage = _quiet) -> None:
        """``engine``: use this one instead of building ``options.engine`` (e.g. a :class:`VerlEngine`);
        ``scorer``: the materializer's reward scorer instead of ``--reward-scorer`` (e.g. verl's reward loop);
        ``stage``: told each stage of :meth:`start` (nothing by default)."""
        self.options = options
        self._stage = stage
        self._given_engine = engine
        self._given_scorer = scorer
        self.stop_event = asyncio.Event()
        self.metrics = Metrics()  # the edge's /metrics, the projector's and materializer's too
        self.metrics_server: MetricsServer | None = None  # a consumer run alone: its own /metrics
        self.nats: EmbeddedNats | None = None
        self.nats_supervisor: NatsSupervisor | None = None  # restarts self.nats when it dies
        self.nc: Client | None = None
        self.url = ""  # the edge's base URL once bound
        self._tasks: list[asyncio.Task[None]] = []
        self._server: EdgeServer | None = None
        self._engine: Engine | None = None
        self._service: EdgeService | None = None
        self._tq_connection: TransferQueueConnection | None = None  # with --transfer-queue
        self._sock: socket.socket | None = None  # the edge's address, held from the start of start()
        self._lock: DataDirLock | None = None  # with the embedded nats-server: the data dir is ours
        self._ready = False

    @property
    def nats_url(self) -> str:
        if self.options.nats_url:
            return self.options.nats_url
        if self.nats is None:
            raise RuntimeError("nats is not started")
        return self.nats.url

    def ready(self) -> bool:
        return self._ready

    @property
    def template_mode(self) -> TemplateMode | None:
        """How the edge encodes its chat template's chains, and why (None without an edge)."""
        return self._service.template_mode if self._service is not None else None

    def failing(self) -> list[str]:
        """The parts that are down now, for ``/healthz``; cheap (no I/O): the supervisor's state, the
        client's connection, the components' tasks."""
        down = []
        if (self.nats_supervisor is not None and not self.nats_supervisor.healthy) or (
                self.nc is not None and not self.nc.is_connected):
            down.append("nats")
        return down + [task.get_name() for task in self._tasks if task.done()]

    async def start(self) -> None:
        """Start the components; a mistake in the options (:class:`StartupError`) is found before anything runs:
        an unusable ``data_dir``, a data dir another stack holds, then the edge's address (bound first,
        listening once the edge serves). With an edge, it returns once the edge answers ``GET /healthz``. Each
        stage it waits on is told to ``stage`` as it begins."""
        options = self.options
        check_writable_dir(options.data_dir, flag="--data-dir", subdirs=DATA_SUBDIRS)
        if options.nats_url is None:  # the store is ours: lock it before anything opens it
            lock = DataDirLock(options.data_dir)
            lock.acquire()
            self._lock = lock
        if "edge" in options.components:
            self._sock = bind(options.host, options.port, listen=False, send_timeout=options.send_timeout)
        elif options.metrics_port is not None:  # a consumer alone: prometheus-client's server for its /metrics
            try:
                self.metrics_server = self.metrics.serve(options.metrics_host, options.metrics_port)
            except OSError as exc:
                raise StartupError(f"--metrics-port {options.metrics_port}: cannot listen on {options.metrics_host} "
                                   f"({one_line(exc.strerror or str(exc)).lower()}); pass another --metrics-port, "
                                   "or 0 for any free one") from exc
        if options.nats_url is None:
            # die_with_parent: the supervisor forks the server from its own thread, which outlives it
            self.nats = EmbeddedNats(options.data_dir / "nats", name="rollbus", die_with_parent=True,
                                     fsync=options.fsync)
            with self._stage(f"starting the embedded nats-server (store {options.data_dir / 'nats'})"):
                self.nats_supervisor = await asyncio.to_thread(NatsSupervisor(self.nats).start)
        with self._stage(f"connecting to NATS at {self.nats_url}") if options.nats_url else contextlib.nullcontext():
            self.nc = await connect(self.nats_url, name="rollbus-" + "-".join(options.components))
        js = self.nc.jetstream()
        with self._stage("provisioning the log's streams and buckets"):
            await self._provision(js)
        watched: list[Watched] = []
        if "projector" in options.components:
            with self._stage("starting the projector"):
                projector = Projector(JetStreamPort(self.nc, options.log), metrics=self.metrics)
                watched.append(projector.watched)
                self._spawn(projector.run(self.stop_event), "projector")
        if "materializer" in options.components:
            with self._stage("starting the materializer"):
                materializer = await self._materializer(self.nc)
                watched.append(materializer.watched)
                self._spawn(materializer.run(self.stop_event), "materializer")
        if watched:
            self._spawn(watch_lag(self.metrics, js, watched, self.stop_event, interval=options.lag_interval), "lag")
        if "edge" in options.components:
            await self._start_edge(self.nc, js)
        if (keeper := HeapKeeper.for_process()) is not None:  # what big requests freed goes back to the system
            self._spawn(keeper.run(self.stop_event), "heap")
        self._ready = True
        if self._server is not None:
            with self._stage(f"waiting for the edge to answer {self.url}/healthz"):
                await self._edge_answers()

    async def _provision(self, js: JetStreamContext) -> None:
        try:
            await provision(js, self.options.log, retention=self.options.retention, replicas=self.options.replicas)
        except ProvisionError as exc:  # the embedded server logged why it could not create a store: say it
            cause = self.nats.store_failure() if self.nats is not None else None
            if cause is None:
                raise
            raise ProvisionError(f"{exc.message}; nats-server: {cause}") from exc

    async def _edge_answers(self, timeout: float = EDGE_ANSWER_TIMEOUT_S) -> None:
        """Return once the edge answers ``GET /healthz`` with 200 (it serves, everything is ready); raise
        :class:`StartupError` if it has not within ``timeout`` seconds, or the stack is stopping."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last = "no answer"
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0), trust_env=False) as client:  # no proxy
            while not self.stop_event.is_set():
                try:
                    response = await client.get(f"{self.url}/healthz")
                    if response.status_code == 200:
                        return
                    last = f"{response.status_code} {one_line(response.text)[:200]}"
                except httpx.HTTPError as exc:
                    last = repr(exc)
                if loop.time() > deadline:
                    raise StartupError(f"the edge at {self.url} did not answer GET /healthz with 200 within "
                                       f"{timeout:.0f}s (last: {last})")
                await asyncio.sleep(0.02)
        raise StartupError(f"stopped while waiting for the edge at {self.url} to answer (last: {last})")

    async def _materializer(self, nc: Client) -> Materializer:
        mo = self.options.materializer
        sink = ParquetSink(self.options.data_dir / "trajectories", padding=mo.padding)
        tq = None
        if mo.transfer_queue:  # imported here: it loads torch, Ray and TransferQueue
            from materializer.transfer_queue import TransferQueueConnection, TransferQueueSink

            connection = TransferQueueConnection(mo.ray_address, storage_units=mo.tq_storage_units)
            where = f"joining Ray at {mo.ray_address}" if mo.ray_address else "hosted by this process"
            with self._stage(f"starting TransferQueue and Ray ({where})"):
                await asyncio.to_thread(connection.open)
            self._tq_connection = connection
            tq = TransferQueueSink(mo.tq_partition)
        scorer = self._given_scorer or (load_scorer(mo.reward_scorer) if mo.reward_scorer else None)
        return Materializer(JetStreamPort(nc, self.options.log), sink, options=mo, tq=tq, scorer=scorer,
                            metrics=self.metrics)

    async def _start_edge(self, nc: Client, js: JetStreamContext) -> None:
        options = self.options
        try:
            if self._given_engine is not None:
                self._engine = self._given_engine
            else:
                with self._stage(f"loading the engine ({engine_summary(options)})"):
                    self._engine = await asyncio.to_thread(build_engine, options)
        except (ValueError, OSError) as exc:  # the engine's options, or a model that does not load
            raise StartupError(f"cannot start the {options.engine} engine: {one_line(str(exc))}") from exc
        sock = self._sock or bind(options.host, options.port, listen=False, send_timeout=options.send_timeout)
        start_listening(sock, options.host, options.port)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        settings = options.edge_settings(public_url=self.url, edge_id=default_edge_id(port))
        service = self._service = build_edge_service(settings, nc, self._engine, metrics=self.metrics)
        self._spawn(build_keeper(service, js).run(self.stop_event), "keeper")
        app = create_app(service, ready=self.ready, failing=self.failing, stopping=self.stop_event.is_set,
                         metrics=self.metrics)
        self._server = EdgeServer(app, sock)  # the socket listens: clients wait in its backlog until served
        self._spawn(self._server.serve(), "edge")

    def _spawn(self, coro: object, name: str) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        task.set_name(name)
        task.add_done_callback(self._on_exit)
        self._tasks.append(task)

    def _on_exit(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and not self.stop_event.is_set():
            log.error("component %s failed: %r; stopping", task.get_name(), task.exception())
            self.stop_event.set()

    async def run_until_stopped(self) -> None:
        await self.stop_event.wait()

    async def stop(self) -> None:
        self._ready = False
        self.stop_event.set()
        if self._server is not None:
            self._server.stop()
        elif self._sock is not None:  # start() failed before the edge served on it
            self._sock.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.stop)
        if self._service is not None:
            with contextlib.suppress(Exception):  # leases lapse anyway
                await asyncio.wait_for(self._service.registry.close(), 5)
            await self._service.close_log()
        if self._engine is not None:
            await self._engine.aclose()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), 5)
        if self.nats_supervisor is not None:
            await asyncio.to_thread(self.nats_supervisor.stop)
        if self._tq_connection is not None:
            await asyncio.to_thread(self._tq_connection.close)
        if self._lock is not None:
            self._lock.release()
