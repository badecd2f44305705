"""Session projections: one compact record per session in the projections KV bucket.

A :class:`Projection` is a session's fold state with its buffers released
(:func:`session.fold.release_buffers`: no tokens, no reply texts) and the log
position it was folded up to. The projector service writes them; the edge's
``GET /sessions/{id}`` and ``rollbus sessions`` read them, so neither replays the log.

* Writes are compare-and-set on the key's KV revision (:meth:`ProjectionStore.put`), so
  two projector processes never overwrite each other's progress.
* A projection records the last per-session ``seq`` it applied (``state.seq``): a
  redelivered envelope is recognized and skipped, and the fold goes on from the stored
  state for the next one, whatever the projector saw before its last restart.
* :func:`current_summary` reads a projection and folds the log's tail past its
  ``stream_seq`` on top, so a reader gets the session as the log has it even while the
  projector lags.

Values are MessagePack. :class:`ProjectionHead` decodes only the leading fields (status,
times, position) when a caller scans the whole bucket.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import msgspec
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from eventlog.reader import UNAVAILABLE, iter_envelopes, last_stream_seq
from schemas.errors import Conflict, FoldError, LogUnavailable
from schemas.log import LogConfig, check_session_id
from session.fold import SessionState, fold, release_buffers
from session.summary import SessionSummary, summarize

T = TypeVar("T")
_KV_OPERATION = "KV-Operation"


class ProjectionHead(msgspec.Struct, frozen=True, kw_only=True):
    """The leading fields of a projection: enough to list and filter sessions."""

    session_id: str
    status: str
    uid: str
    opened_at: float
    updated_at: float
    stream_seq: int  # log position of the last envelope folded in


class Projection(ProjectionHead, frozen=True, kw_only=True):
    state: SessionState  # released: counters and statuses, no buffers


def project(state: SessionState, stream_seq: int) -> Projection:
    released = release_buffers(state)
    return Projection(session_id=state.session_id, status=state.status, uid=state.uid, opened_at=state.opened_at,
                      updated_at=state.updated_at, stream_seq=stream_seq, state=released)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Projection)


def encode(projection: Projection) -> bytes:
    return _encoder.encode(projection)


def decode(data: bytes) -> Projection:
    """A stored projection; :class:`FoldError` when it does not decode (the log can rebuild it)."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise FoldError(f"a stored projection does not decode: {exc}") from exc


async def _bounded(call: Awaitable[T], timeout: float, what: str) -> T:
    try:
        return await asyncio.wait_for(call, timeout)
    except UNAVAILABLE as exc:
        raise LogUnavailable(f"JetStream did not answer ({what})") from exc


async def bucket(js: JetStreamContext, name: str, timeout: float = 5.0) -> KeyValue:
    """A bound KV bucket (provisioned beforehand by :func:`stack.provision.provision`)."""
    try:
        return await _bounded(js.key_value(name), timeout, f"bind {name}")
    except NotFoundError as exc:
        raise LogUnavailable(f"KV bucket {name} does not exist; run provisioning first") from exc


class ProjectionStore:
    """Projections by session id, compare-and-set on revision, with a small cache of recent ones."""

    def __init__(self, js: JetStreamContext, cfg: LogConfig, *, cache: int = 1024, timeout: float = 5.0) -> None:
        self._js = js
        self._cfg = cfg
        self._timeout = timeout
        self._kv: KeyValue | None = None
        self._cache: OrderedDict[str, tuple[Projection, int]] = OrderedDict()
        self._cache_size = cache

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await bucket(self._js, self._cfg.projections_bucket, self._timeout)
        return self._kv

    async def get(self, session_id: str) -> tuple[Projection | None, int]:
        """The projection and its revision (0: there is none yet)."""
        cached = self._cache.get(session_id)
        if cached is not None:
            self._cache.move_to_end(session_id)
            return cached
        kv = await self._bucket()
        try:
            entry = await _bounded(kv.get(session_id), self._timeout, f"get projection {session_id}")
        except KeyNotFoundError:
            return None, 0
        return decode(entry.value or b""), int(entry.revision or 0)

    async def put(self, projection: Projection, revision: int) -> int:
        """Write if the stored revision is still ``revision``; raises :class:`Conflict` otherwise."""
        kv = await self._bucket()
        key = projection.session_id
        try:
            call = kv.update(key, encode(projection), last=revision) if revision else kv.create(key, encode(projection))
            new = await _bounded(call, self._timeout, f"write projection {key}")
        except KeyWrongLastSequenceError as exc:
            self.forget(key)
            raise Conflict(f"projection {key} was written concurrently") from exc
        if projection.status == "open":
            self._remember(key, projection, new)
        else:
            self.forget(key)  # nothing more will be folded into a closed session
        return new

    def forget(self, session_id: str) -> None:
        self._cache.pop(session_id, None)

    def _remember(self, key: str, projection: Projection, revision: int) -> None:
        self._cache[key] = (projection, revision)
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)


async def read_projection(js: JetStreamContext, cfg: LogConfig, session_id: str,
                          timeout: float = 5.0) -> Projection | None:
    projection, _ = await ProjectionStore(js, cfg, cache=0, timeout=timeout).get(check_session_id(session_id))
    return projection


async def current_summary(js: JetStreamContext, cfg: LogConfig, session_id: str) -> SessionSummary | None:
    """The session's summary from its projection plus the log past it; ``None`` without a projection."""
    projection = await read_projection(js, cfg, session_id)
    if projection is None:
        return None
    state: SessionState | None = projection.state
    subject_filter = cfg.session_filter(session_id)
    last = await last_stream_seq(js, cfg, subject_filter)
    async for _, events in iter_envelopes(js, cfg, subject_filter, last, start=projection.stream_seq + 1):
        state = fold(events, state)
    assert state is not None  # a projection's state is never None
    return summarize(state)


async def iter_bucket(js: JetStreamContext, name: str, timeout: float = 5.0) -> AsyncIterator[tuple[str, bytes]]:
    """(key, value) of every live key of a KV bucket, read in one pass (last value per key)."""
    stream = f"KV_{name}"
    try:
        info = await _bounded(js.stream_info(stream), timeout, f"info {stream}")
    except NotFoundError:
        return
    if not info.state.messages:
        return
    prefix = f"$KV.{name}."
    config = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
    sub = await _bounded(js.subscribe(prefix + ">", ordered_consumer=True, stream=stream, config=config),
                         timeout, f"read {stream}")
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=timeout)
            except NatsTimeoutError as exc:
                raise LogUnavailable(f"reading bucket {name} stalled") from exc
            if (msg.headers or {}).get(_KV_OPERATION) not in ("DEL", "PURGE"):
                yield msg.subject[len(prefix):], msg.data
            if not msg.metadata.num_pending:
                return
    finally:
        await sub.unsubscribe()


async def iter_projections(js: JetStreamContext, cfg: LogConfig, *, heads_only: bool = False
                           ) -> AsyncIterator[ProjectionHead]:
    """Every projection (or only its head, which decodes much less), in no particular order."""
    decoder = msgspec.msgpack.Decoder(ProjectionHead if heads_only else Projection)
    async for _, value in iter_bucket(js, cfg.projections_bucket):
        yield decoder.decode(value)
