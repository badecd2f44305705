"""The composition root: builds components from options and runs them in one event loop.

``rollbus up`` runs all of them (plus an embedded nats-server unless ``--nats`` names
one); ``rollbus edge`` / ``projector`` / ``materializer`` run one each. Business logic
lives in the packages; this module only wires them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import uvicorn
from nats.aio.client import Client
from nats.js.client import JetStreamContext

from edge.app import create_app
from edge.codec.fidelity import load_codec
from edge.codec.tokenizer import load_tokenizer
from edge.engines import LOCAL_MODELS, local_model, make_engine
from edge.engines.base import Engine
from edge.http_server import EdgeHttpProtocol
from edge.keeper import SessionKeeper
from edge.live import Registry
from edge.ownership import KvLeases
from edge.publisher import JetStreamLog
from edge.service import EdgeService, KvSessionIndex
from edge.settings import EdgeSettings
from edge.turns import Clock, TurnRunner
from materializer.parquet import ParquetSink
from materializer.service import Materializer, MaterializerOptions
from reward.scorer import RewardScorer, load_scorer
from rollbus.nats_server import EmbeddedNats
from rollbus.provision import connect, provision
from rollbus.tools import UserError, check_writable_dir, one_line
from schemas.log import LogConfig
from session_projector.projections import current_summary, iter_projections
from session_projector.reader import last_stream_seq, load_state
from session_projector.service import Projector

if TYPE_CHECKING:
    from materializer.transfer_queue import TransferQueueConnection

log = logging.getLogger(__name__)

COMPONENTS = ("edge", "projector", "materializer")
DATA_SUBDIRS = ("nats", "trajectories", ".trajectories-staging")  # what the stack writes under --data-dir


class StartupError(UserError):
    """The stack cannot start for a reason the user can fix (a busy port, a missing model, an unwritable
    ``--data-dir``); its message is one line naming the problem and the flag."""


class StackOptions(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("rollbus-data")
    nats_url: str | None = None  # None: start an embedded nats-server in <data_dir>/nats
    engine: str = "local"
    engine_urls: tuple[str, ...] = ()
    model: str | None = None  # the local engine's model: None (tiny-qwen2), "smollm2", or a path
    engine_timeout: float = 300.0  # HTTP engines: seconds to wait for a reply (or the next streamed event)
    health_interval: float = 5.0  # HTTP engines: seconds between /health probes of each server
    tokenizer: str = "builtin:qwen2.5"
    tool_format: str = "hermes"
    admin_token: str = ""
    max_trajectory_length: int = 32768
    components: tuple[str, ...] = COMPONENTS
    log: LogConfig = LogConfig()
    edge_id: str = ""  # "": <hostname>:<port>, so an edge restarted on its port takes its sessions back at once
    lease_ttl: float = 15.0
    idle_timeout: float = 3600.0
    disconnect_grace: float = 10.0
    rollback_rewritten_turns: bool = True
    materializer: MaterializerOptions = MaterializerOptions()


def model_defaults(engine: str, model: str | None, tokenizer: str | None,
                   tool_format: str | None) -> tuple[str, str]:
    """The tokenizer and tool format to use: the given ones, else the local model's, else Qwen2.5's."""
    spec = local_model(model) if engine == "local" else None
    return (tokenizer or (spec.tokenizer if spec else "builtin:qwen2.5"),
            tool_format or (spec.tool_format if spec else "hermes"))


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
    if "edge" not in options.components:
        return
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


def build_engine(options: StackOptions) -> Engine:
    """The engine ``options`` name (slow for a real local model: call it off the event loop)."""
    if options.engine != "local":
        if options.model is not None:
            raise ValueError("--model selects the local engine's model; a remote engine serves its own")
        return make_engine(options.engine, list(options.engine_urls), timeout=options.engine_timeout,
                           health_interval=options.health_interval)
    spec = local_model(options.model)
    if spec is not None and options.tokenizer != spec.tokenizer:
        raise ValueError(f"the local model {spec.name} needs --tokenizer {spec.tokenizer} (got {options.tokenizer})")
    return make_engine("local", model=options.model, decode=load_tokenizer(options.tokenizer).decode)


def build_edge_service(settings: EdgeSettings, js: JetStreamContext, engine: Engine, *,
                       clock: Clock = time.time) -> EdgeService:
    """An :class:`EdgeService` writing to JetStream under leases, taking unknown sessions over from it."""
    cfg = settings.log
    codec, parser = load_codec(settings.tokenizer, settings.tool_format)  # refuses a mismatched pair
    event_log = JetStreamLog(js, cfg, direct=True)
    leases = KvLeases(js, cfg, edge_id=settings.edge_id, url=settings.public_url, ttl=settings.lease_ttl_s,
                      clock=clock)
    registry = Registry(lambda session_id: load_state(js, cfg, session_id), leases=leases,
                        position=lambda session_id: last_stream_seq(js, cfg, cfg.session_filter(session_id)),
                        summaries=lambda session_id: current_summary(js, cfg, session_id), clock=clock)
    turns = TurnRunner(settings=settings, codec=codec, engine=engine, log=event_log, parser=parser, clock=clock)
    return EdgeService(settings=settings, registry=registry, log=event_log, turns=turns, leases=leases, clock=clock,
                       index=KvSessionIndex(js, cfg))


def build_keeper(service: EdgeService, js: JetStreamContext, *, clock: Clock = time.time) -> SessionKeeper:
    """Lease renewal, idle timeout and orphan sweeps for an edge's sessions."""
    settings = service.settings
    return SessionKeeper(service, idle_timeout=settings.idle_timeout_s, leases=service.leases,
                         orphans=lambda: iter_projections(js, settings.log, heads_only=True), clock=clock)


def default_edge_id(port: int) -> str:
    return f"{socket.gethostname()}:{port}"


# Nothing in rollbus reads the client address, so uvicorn's proxy-headers middleware is off
# (a layer on every request), as is its ``server`` header.
UVICORN_LEAN: dict[str, Any] = {"proxy_headers": False, "server_header": False}


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the stack owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """A non-blocking TCP socket bound to ``host:port`` (listening unless ``listen=False``).

    Raises :class:`StartupError` when the address cannot be had: the port is in use, needs
    privileges, or is out of range; the host is unknown or not this machine's.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
        sock.listen(2048)
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
                 scorer: RewardScorer | None = None) -> None:
        """``engine``: use this one instead of building ``options.engine`` (e.g. a :class:`VerlEngine`);
        ``scorer``: the materializer's reward scorer instead of ``--reward-scorer`` (e.g. verl's reward loop)."""
        self.options = options
        self._given_engine = engine
        self._given_scorer = scorer
        self.stop_event = asyncio.Event()
        self.nats: EmbeddedNats | None = None
        self.nc: Client | None = None
        self.url = ""  # the edge's base URL once bound
        self._tasks: list[asyncio.Task[None]] = []
        self._server: _Server | None = None
        self._engine: Engine | None = None
        self._service: EdgeService | None = None
        self._tq_connection: TransferQueueConnection | None = None  # with --transfer-queue
        self._sock: socket.socket | None = None  # the edge's address, held from the start of start()
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

    async def start(self) -> None:
        """Start the components; a mistake in the options (:class:`StartupError`) is found before anything runs:
        an unusable ``data_dir``, then the edge's address (bound first, listening once the edge serves)."""
        options = self.options
        check_writable_dir(options.data_dir, flag="--data-dir", subdirs=DATA_SUBDIRS)
        if "edge" in options.components:
            self._sock = bind(options.host, options.port, listen=False)
        if options.nats_url is None:
            self.nats = await asyncio.to_thread(EmbeddedNats(options.data_dir / "nats", name="rollbus").start)
        self.nc = await connect(self.nats_url, name="rollbus-" + "-".join(options.components))
        js = self.nc.jetstream()
        await provision(js, options.log)
        if "projector" in options.components:
            self._spawn(Projector(js, options.log).run(self.stop_event), "projector")
        if "materializer" in options.components:
            self._spawn((await self._materializer(js)).run(self.stop_event), "materializer")
        if "edge" in options.components:
            await self._start_edge(js)
        self._ready = True

    async def _materializer(self, js: JetStreamContext) -> Materializer:
        mo = self.options.materializer
        sink = ParquetSink(self.options.data_dir / "trajectories", padding=mo.padding)
        tq = None
        if mo.transfer_queue:  # imported here: it loads torch, Ray and TransferQueue
            from materializer.transfer_queue import TransferQueueConnection, TransferQueueSink

            connection = TransferQueueConnection(mo.ray_address, storage_units=mo.tq_storage_units)
            await asyncio.to_thread(connection.open)
            self._tq_connection = connection
            tq = TransferQueueSink(mo.tq_partition)
        scorer = self._given_scorer or (load_scorer(mo.reward_scorer) if mo.reward_scorer else None)
        return Materializer(js, self.options.log, sink, options=mo, tq=tq, scorer=scorer)

    async def _start_edge(self, js: JetStreamContext) -> None:
        options = self.options
        try:
            self._engine = self._given_engine or await asyncio.to_thread(build_engine, options)
        except (ValueError, OSError) as exc:  # the engine's options, or a model that does not load
            raise StartupError(f"cannot start the {options.engine} engine: {one_line(str(exc))}") from exc
        sock = self._sock or bind(options.host, options.port, listen=False)
        start_listening(sock, options.host, options.port)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        settings = EdgeSettings(public_url=self.url, admin_token=options.admin_token, tokenizer=options.tokenizer,
                                tool_format=options.tool_format, max_trajectory_length=options.max_trajectory_length,
                                log=options.log, edge_id=options.edge_id or default_edge_id(port),
                                lease_ttl_s=options.lease_ttl, idle_timeout_s=options.idle_timeout,
                                disconnect_grace_s=options.disconnect_grace,
                                rollback_rewritten_turns=options.rollback_rewritten_turns)
        service = self._service = build_edge_service(settings, js, self._engine)
        self._spawn(build_keeper(service, js).run(self.stop_event), "keeper")
        app = create_app(service, ready=self.ready)
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, loop="none",
                                http=EdgeHttpProtocol, **UVICORN_LEAN)
        self._server = _Server(config)
        self._spawn(self._server.serve(sockets=[sock]), "edge")
        while not self._server.started:  # noqa: ASYNC110 - uvicorn offers no started event
            await asyncio.sleep(0.01)

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
            self._server.should_exit = True
        elif self._sock is not None:  # start() failed before the edge served on it
            self._sock.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._service is not None:
            with contextlib.suppress(Exception):  # leases lapse anyway
                await asyncio.wait_for(self._service.registry.close(), 5)
            await self._service.close_log()
        if self._engine is not None:
            await self._engine.aclose()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.drain(), 5)
        if self.nats is not None:
            await asyncio.to_thread(self.nats.stop)
        if self._tq_connection is not None:
            await asyncio.to_thread(self._tq_connection.close)
