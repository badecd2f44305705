"""Connecting to NATS and provisioning the log's JetStream assets, idempotently.

:func:`provision` runs on every start of every component, possibly in several processes
at once. It creates what is missing and reconciles what exists:

- ``cfg.stream``, the log (subjects ``cfg.subjects``): file storage, limits retention with
  the :class:`Retention` limits (by default none: the log is the source of truth, and
  nothing is discarded), a duplicate window for ``Nats-Msg-Id`` idempotency, direct gets
  for replay, 1 MiB messages. Its discard policy is ``new``: a log that reaches its max
  bytes refuses new appends (the edge answers 503) rather than deleting the oldest
  sessions without a word; only a max age, set on purpose, deletes what has grown older.
- ``cfg.ready_stream``, "finalized, ready to materialize" signals (``cfg.ready_subjects``):
  file storage, limits retention, the same duplicate window so a repeated signal for
  one session (same ``Nats-Msg-Id``) is stored once. Limits rather than work-queue
  retention: a work queue deletes a signal on its first ack and allows one consumer per
  subject, while limits keep the signals so ``materialize --from-log``, a second
  consumer (an auditor, a dashboard) or a rebuilt materializer can read them again;
  consumers are idempotent by key (the markers bucket) anyway.
- KV buckets ``cfg.projections_bucket``, ``cfg.markers_bucket``, ``cfg.leases_bucket``
  (which edge writes which open session), ``cfg.prompts_bucket`` (the materializer's
  per-prompt progress) and ``cfg.session_index_bucket`` (which session holds a
  ``(uid, session_index)``): file storage, history 1.

An existing stream whose managed settings differ is updated when that is safe (adding
our subjects, the duplicate window, direct gets, the message size, KV history, and the
retention limits when ``provision`` is given a :class:`Retention`: ``rollbus up`` does,
while a component run alone leaves the limits ``up`` set as they are); storage and the
retention policy are never changed (the server refuses the first, and the second could
delete the log), so a mismatch there raises :class:`ProvisionError`.

On a NATS cluster, ``replicas=3`` (``--replicas 3``) keeps every stream and bucket on three
nodes (``ops/nats/``, ``docs/operations.md``); a component given it scales existing ones up too.

Every awaited NATS call is bounded by ``asyncio.wait_for``: a nats-py future can
otherwise wait forever on a connection that is reconnecting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from nats.aio.client import Client
from nats.errors import ConnectionClosedError, ConnectionDrainingError, NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, ObjectStoreConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BadRequestError, NotFoundError, ServiceUnavailableError
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_fixed

from eventlog.publisher import refusal
from schemas.errors import LogUnavailable, ProvisionError
from schemas.log import MAX_PAYLOAD, LogConfig

log = logging.getLogger(__name__)

T = TypeVar("T")

CALL_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
# The client's pings find a dead (half-open) link: no PONG for PING_INTERVAL_S x (MAX_OUTSTANDING_PINGS + 1)
# and it reconnects, 4-6 s after the link died (a PING every 2 s costs nothing worth counting).
PING_INTERVAL_S = 2
MAX_OUTSTANDING_PINGS = 2
ERR_STREAM_NAME_IN_USE = 10058  # "stream name already in use with a different configuration"
ERR_NO_PEERS = 10005  # "no suitable peers for placement": a cluster still forming (or short of nodes for R>1)
# "error creating store for stream": the server could not make the store's files (a full disk, no free file
# descriptors, an unwritable store); it tells its clients only this sentence and logs the cause.
ERR_STORE_FAILED = 10049

# Settings that are compared but never changed in place (the server refuses to change the
# storage type; a retention change could let the server delete the log).
_FIXED = frozenset({"storage", "retention"})
# nats-py's timeouts subclass the builtin TimeoutError; these mean "no JetStream right now".
_UNAVAILABLE = (
    TimeoutError,
    NoRespondersError,
    ServiceUnavailableError,
    ConnectionClosedError,
    ConnectionDrainingError,
)


@dataclass(frozen=True)
class Retention:
    """The log stream's limits; 0 is unlimited. The defaults keep everything: a stream limit that
    deletes training data is a decision for its operator, and JetStream's own store limit (by
    default 75% of the disk's free space when the server starts) already refuses appends before the
    disk fills."""

    max_age_s: float = 0.0  # older envelopes are deleted (sessions lose their beginning: set it on purpose)
    max_bytes: int = 0  # past it, appends are refused (discard new); nothing stored is deleted. JetStream
    # reserves it in its store: more than the store's limit is refused at provision

    def __post_init__(self) -> None:
        if not (self.max_age_s >= 0 and self.max_bytes >= 0):  # also refuses NaN
            raise ValueError(f"retention limits are 0 (unlimited) or positive: {self}")

    def describe(self) -> str:
        age = "unlimited" if not self.max_age_s else duration_text(self.max_age_s)
        size = "unlimited" if not self.max_bytes else bytes_text(self.max_bytes)
        return f"max age {age}, max bytes {size} (when full: new appends refused, nothing deleted)"


def duration_text(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def bytes_text(size: int) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.4g} {unit}"
    return f"{size} B"


@dataclass(frozen=True)
class _Want:
    """The stream to create, and which of its settings provision reconciles on an existing one."""

    config: StreamConfig
    managed: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.config.name or ""


@dataclass(frozen=True)
class _ConnectionEvents:
    """Logs a client's connection trouble instead of nats-py's traceback per failed attempt."""

    nc: Client
    name: str
    refused: asyncio.Future[str]  # why the server refused the first connect for good (credentials, TLS)

    async def error(self, exc: Exception) -> None:
        log.warning("nats (%s): %s", self.name, exc)
        why = refusal(exc)
        if why is not None and not self.nc.is_connected and not self.refused.done():
            self.refused.set_result(why)

    async def disconnected(self) -> None:
        if not self.nc.is_closed:  # nats-py also calls this on a deliberate close
            log.warning("nats (%s): disconnected; reconnecting", self.name)

    async def reconnected(self) -> None:
        url = self.nc.connected_url
        log.info("nats (%s): reconnected to %s", self.name, url.netloc if url else "?")


async def connect(url: str, *, name: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Client:
    """A client that reconnects forever once connected; the first connect is bounded by ``timeout_s``.

    (nats-py retries the *initial* connect forever too when ``max_reconnect_attempts=-1``.)
    ``url`` may list a cluster's nodes, comma-separated: the client fails over among them.
    """
    nc = Client()
    events = _ConnectionEvents(nc, name, asyncio.get_running_loop().create_future())
    connecting = asyncio.ensure_future(_first_connect(nc, url, name, events, timeout_s))
    try:
        await asyncio.wait([connecting, events.refused], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        connecting.cancel()
        raise
    if not connecting.done():  # nats-py would retry a refused connect until the timeout: fail at once
        connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await connecting
        await nc.close()
        raise LogUnavailable(f"{events.refused.result()} at {url}")
    await connecting
    return nc


async def _first_connect(nc: Client, url: str, name: str, events: _ConnectionEvents, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(
            nc.connect(
                [server.strip() for server in url.split(",") if server.strip()],  # a cluster: its nodes' URLs
                name=name,
                connect_timeout=2,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,  # type: ignore[arg-type]  # annotated int, used as float
                ping_interval=PING_INTERVAL_S,
                max_outstanding_pings=MAX_OUTSTANDING_PINGS,
                error_cb=events.error,
                disconnected_cb=events.disconnected,
                reconnected_cb=events.reconnected,
            ),
            timeout_s,
        )
    except TimeoutError as exc:
        await nc.close()
        raise LogUnavailable(f"no NATS server answered at {url} within {timeout_s}s") from exc


async def provision(js: JetStreamContext, cfg: LogConfig, *, timeout_s: float = CALL_TIMEOUT_S,
                    retention: Retention | None = None, replicas: int | None = None) -> None:
    """Create or reconcile the log stream, the ready stream and the KV buckets.

    ``retention``: the log stream's limits, applied to an existing stream too; None: a new stream
    gets the defaults and an existing one keeps its limits. ``replicas``: how many cluster nodes
    keep each stream and bucket (3 on a three-node cluster: one node may die and nothing
    acknowledged is lost), applied to existing ones too; None: new ones get 1, existing ones keep
    theirs (so a component started without it never scales a cluster's log down)."""
    for want in (_log_stream(cfg, retention, replicas), _ready_stream(cfg, replicas)):
        await _ensure_stream(js, want, timeout_s)
    for bucket in (cfg.projections_bucket, cfg.markers_bucket, cfg.leases_bucket, cfg.prompts_bucket,
                   cfg.session_index_bucket):
        await _ensure_bucket(js, bucket, timeout_s, replicas)
    await _ensure_object_store(js, cfg.pieces_bucket, timeout_s, replicas)


def _replicated(managed: tuple[str, ...], replicas: int | None) -> tuple[str, ...]:
    return (*managed, "num_replicas") if replicas is not None else managed


def _log_stream(cfg: LogConfig, retention: Retention | None, replicas: int | None = None) -> _Want:
    # No max_msgs; max_bytes and max_age from the retention (0: none): limits retention without limits
    # discards nothing.
    limits = retention or Retention()
    config = StreamConfig(
        name=cfg.stream,
        subjects=[cfg.subjects],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        duplicate_window=cfg.duplicate_window_s,
        allow_direct=True,
        max_msg_size=MAX_PAYLOAD,
        max_age=limits.max_age_s,
        max_bytes=limits.max_bytes or -1,
        discard=DiscardPolicy.NEW,
        num_replicas=replicas or 1,
    )
    managed = ("storage", "retention", "duplicate_window", "allow_direct", "max_msg_size")
    managed = (*managed, "max_age", "max_bytes", "discard") if retention is not None else managed
    return _Want(config, _replicated(managed, replicas))


def _ready_stream(cfg: LogConfig, replicas: int | None = None) -> _Want:
    config = StreamConfig(
        name=cfg.ready_stream,
        subjects=[cfg.ready_subjects],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        duplicate_window=cfg.duplicate_window_s,
        num_replicas=replicas or 1,
    )
    return _Want(config, _replicated(("storage", "retention", "duplicate_window"), replicas))


async def _ensure_stream(js: JetStreamContext, want: _Want, timeout_s: float) -> None:
    try:
        have = (await _bounded(js.stream_info(want.name), timeout_s)).config
    except NotFoundError:
        try:
            await _placed(lambda: js.add_stream(want.config), timeout_s)
            return
        except APIError as exc:
            if not isinstance(exc, BadRequestError) or exc.err_code != ERR_STREAM_NAME_IN_USE:
                raise _refused(f"stream {want.name}", exc) from exc
        # Another process created it first, perhaps differently: reconcile with theirs.
        have = (await _bounded(js.stream_info(want.name), timeout_s)).config
    await _reconcile(js, have, want, timeout_s)


async def _ensure_bucket(js: JetStreamContext, bucket: str, timeout_s: float, replicas: int | None = None) -> None:
    """Create the bucket; the server treats an identical re-create as a no-op."""
    try:
        await _placed(lambda: js.create_key_value(bucket=bucket, history=1, storage=StorageType.FILE,
                                                  replicas=replicas or 1), timeout_s)
    except APIError as exc:
        if not isinstance(exc, BadRequestError) or exc.err_code != ERR_STREAM_NAME_IN_USE:
            raise _refused(f"KV bucket {bucket}", exc) from exc
        want = _Want(
            StreamConfig(name=f"KV_{bucket}", storage=StorageType.FILE, max_msgs_per_subject=1,
                         num_replicas=replicas or 1),
            _replicated(("storage", "max_msgs_per_subject"), replicas),
        )
        have = (await _bounded(js.stream_info(want.name), timeout_s)).config
        await _reconcile(js, have, want, timeout_s)


async def _ensure_object_store(js: JetStreamContext, bucket: str, timeout_s: float,
                               replicas: int | None = None) -> None:
    """The object store for pieces too large for one message (an identical re-create is a no-op)."""
    config = ObjectStoreConfig(bucket=bucket, storage=StorageType.FILE, replicas=replicas or 1)
    try:
        await _placed(lambda: js.create_object_store(bucket, config=config), timeout_s)
    except APIError as exc:
        if not isinstance(exc, BadRequestError) or exc.err_code != ERR_STREAM_NAME_IN_USE:
            raise _refused(f"object store {bucket}", exc) from exc
        if replicas is not None:
            want = _Want(StreamConfig(name=f"OBJ_{bucket}", num_replicas=replicas), ("num_replicas",))
            have = (await _bounded(js.stream_info(want.name), timeout_s)).config
            await _reconcile(js, have, want, timeout_s)


def _refused(what: str, exc: APIError) -> ProvisionError:
    """A create the server refused (any API error: a 500 too, which nats-py raises as ServerError)."""
    why = " (the NATS server's log says why: a full disk, no free file descriptors, ...)" \
        if exc.err_code == ERR_STORE_FAILED else ""
    return ProvisionError(f"cannot create {what}: {exc.description}{why}")


async def _reconcile(js: JetStreamContext, have: StreamConfig, want: _Want, timeout_s: float) -> None:
    """Bring ``have`` to ``want`` where that is safe; raise where it is not."""
    changes: dict[str, object] = {}
    for field in want.managed:
        have_value, want_value = getattr(have, field), getattr(want.config, field)
        if have_value == want_value:
            continue
        if field in _FIXED:
            raise ProvisionError(
                f"stream {want.name} has {field}={have_value}, rollbus needs {want_value}; "
                "this cannot be changed in place: migrate or delete the stream"
            )
        changes[field] = want_value
    have_subjects = have.subjects or []
    missing = [s for s in want.config.subjects or [] if s not in have_subjects]
    if missing:
        changes["subjects"] = [*have_subjects, *missing]
    if not changes:
        return
    log.warning("updating stream %s: %s", want.name, changes)
    try:
        await _placed(lambda: js.update_stream(have.evolve(**changes)), timeout_s)
    except APIError as exc:  # e.g. a max_bytes over what the JetStream store can reserve (err_code 10047)
        raise ProvisionError(f"cannot update stream {want.name} with {changes}: {exc.description}") from exc


async def _placed(call: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """A create or update whose replicas the cluster must place: "no suitable peers" is retried for up to
    ``timeout_s`` (a cluster that just formed places nothing until every node has reported to its meta
    leader); what is left of it after that is the caller's BadRequestError."""
    retrying = AsyncRetrying(retry=retry_if_exception(lambda exc: isinstance(exc, BadRequestError)
                                                       and exc.err_code == ERR_NO_PEERS),
                             stop=stop_after_delay(timeout_s), wait=wait_fixed(0.25), reraise=True)

    async def bounded() -> T:  # (a coroutine function: tenacity would take a lambda for a plain one)
        return await _bounded(call(), timeout_s)

    return await retrying(bounded)


async def _bounded(call: Awaitable[T], timeout_s: float) -> T:
    """Await one NATS call; a timeout or a dead connection becomes :class:`LogUnavailable`."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except _UNAVAILABLE as exc:
        raise LogUnavailable(f"JetStream did not answer: {exc!r}") from exc
