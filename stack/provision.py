"""Connecting to NATS and provisioning the log's JetStream assets, idempotently.

:func:`provision` runs on every start of every component, possibly in several processes
at once. It creates what is missing and reconciles what exists:

- ``cfg.stream``, the log (subjects ``cfg.subjects``): file storage, limits retention and
  no limits (nothing is ever discarded: it is the source of truth), a duplicate window
  for ``Nats-Msg-Id`` idempotency, direct gets for replay, 1 MiB messages.
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
our subjects, the duplicate window, direct gets, the message size, KV history); storage
and retention are never changed (the server refuses the first, and the second could
delete the log), so a mismatch there raises :class:`ProvisionError`.

Every awaited NATS call is bounded by ``asyncio.wait_for``: a nats-py future can
otherwise wait forever on a connection that is reconnecting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from nats.aio.client import Client
from nats.errors import ConnectionClosedError, ConnectionDrainingError, NoRespondersError
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from eventlog.publisher import refusal
from schemas.errors import LogUnavailable, RollbusError
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


class ProvisionError(RollbusError):
    """A stream or bucket exists with settings provision may not change."""


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
                url,
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


async def provision(js: JetStreamContext, cfg: LogConfig, *, timeout_s: float = CALL_TIMEOUT_S) -> None:
    """Create or reconcile the log stream, the ready stream and the KV buckets."""
    for want in (_log_stream(cfg), _ready_stream(cfg)):
        await _ensure_stream(js, want, timeout_s)
    for bucket in (cfg.projections_bucket, cfg.markers_bucket, cfg.leases_bucket, cfg.prompts_bucket,
                   cfg.session_index_bucket):
        await _ensure_bucket(js, bucket, timeout_s)
    await _ensure_object_store(js, cfg.pieces_bucket, timeout_s)


def _log_stream(cfg: LogConfig) -> _Want:
    # No max_msgs / max_bytes / max_age: limits retention without limits discards nothing.
    config = StreamConfig(
        name=cfg.stream,
        subjects=[cfg.subjects],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        duplicate_window=cfg.duplicate_window_s,
        allow_direct=True,
        max_msg_size=MAX_PAYLOAD,
    )
    return _Want(config, ("storage", "retention", "duplicate_window", "allow_direct", "max_msg_size"))


def _ready_stream(cfg: LogConfig) -> _Want:
    config = StreamConfig(
        name=cfg.ready_stream,
        subjects=[cfg.ready_subjects],
        storage=StorageType.FILE,
        retention=RetentionPolicy.LIMITS,
        duplicate_window=cfg.duplicate_window_s,
    )
    return _Want(config, ("storage", "retention", "duplicate_window"))


async def _ensure_stream(js: JetStreamContext, want: _Want, timeout_s: float) -> None:
    try:
        have = (await _bounded(js.stream_info(want.name), timeout_s)).config
    except NotFoundError:
        try:
            await _bounded(js.add_stream(want.config), timeout_s)
            return
        except BadRequestError as exc:
            if exc.err_code != ERR_STREAM_NAME_IN_USE:
                raise ProvisionError(f"cannot create stream {want.name}: {exc.description}") from exc
        # Another process created it first, perhaps differently: reconcile with theirs.
        have = (await _bounded(js.stream_info(want.name), timeout_s)).config
    await _reconcile(js, have, want, timeout_s)


async def _ensure_bucket(js: JetStreamContext, bucket: str, timeout_s: float) -> None:
    """Create the bucket; the server treats an identical re-create as a no-op."""
    try:
        await _bounded(js.create_key_value(bucket=bucket, history=1, storage=StorageType.FILE), timeout_s)
    except BadRequestError as exc:
        if exc.err_code != ERR_STREAM_NAME_IN_USE:
            raise ProvisionError(f"cannot create KV bucket {bucket}: {exc.description}") from exc
        want = _Want(
            StreamConfig(name=f"KV_{bucket}", storage=StorageType.FILE, max_msgs_per_subject=1),
            ("storage", "max_msgs_per_subject"),
        )
        have = (await _bounded(js.stream_info(want.name), timeout_s)).config
        await _reconcile(js, have, want, timeout_s)


async def _ensure_object_store(js: JetStreamContext, bucket: str, timeout_s: float) -> None:
    """The object store for pieces too large for one message (an identical re-create is a no-op)."""
    try:
        await _bounded(js.create_object_store(bucket, config=ObjectStoreConfig(bucket=bucket,
                                                                               storage=StorageType.FILE)), timeout_s)
    except BadRequestError as exc:
        if exc.err_code != ERR_STREAM_NAME_IN_USE:
            raise ProvisionError(f"cannot create object store {bucket}: {exc.description}") from exc


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
        await _bounded(js.update_stream(have.evolve(**changes)), timeout_s)
    except BadRequestError as exc:
        raise ProvisionError(f"cannot update stream {want.name} with {changes}: {exc.description}") from exc


async def _bounded(call: Awaitable[T], timeout_s: float) -> T:
    """Await one NATS call; a timeout or a dead connection becomes :class:`LogUnavailable`."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except _UNAVAILABLE as exc:
        raise LogUnavailable(f"JetStream did not answer: {exc!r}") from exc
