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

from collections import OrderedDict
from collections.abc import AsyncIterator

import msgspec
from nats.js.client import JetStreamContext

from eventlog.kv import Kv, KvStore, iter_bucket
from eventlog.reader import iter_envelopes, last_stream_seq
from schemas.errors import Conflict, FoldError, RevisionConflict
from schemas.log import LogConfig, ProjectionHead, check_session_id
from session.fold import SessionState, fold, release_buffers
from session.summary import SessionSummary, summarize

__all__ = ["Projection", "ProjectionHead", "ProjectionStore"]  # (the head is a contract: schemas.log)


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


class ProjectionStore:
    """Projections by session id, compare-and-set on revision, with a small cache of recent ones."""

    def __init__(self, kv: Kv, *, cache: int = 1024) -> None:
        """``kv``: the projections bucket (``cfg.projections_bucket``)."""
        self._kv = kv
        self._cache: OrderedDict[str, tuple[Projection, int]] = OrderedDict()
        self._cache_size = cache

    async def get(self, session_id: str) -> tuple[Projection | None, int]:
        """The projection and its revision (0: there is none yet)."""
        cached = self._cache.get(session_id)
        if cached is not None:
            self._cache.move_to_end(session_id)
            return cached
        found = await self._kv.get(session_id)
        return (decode(found[0]), found[1]) if found is not None else (None, 0)

    async def put(self, projection: Projection, revision: int) -> int:
        """Write if the stored revision is still ``revision``; raises :class:`Conflict` otherwise."""
        key = projection.session_id
        try:
            new = await self._kv.write(key, encode(projection), revision)
        except RevisionConflict as exc:
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
    store = ProjectionStore(KvStore(js, cfg.projections_bucket, timeout=timeout), cache=0)
    projection, _ = await store.get(check_session_id(session_id))
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


async def iter_projections(js: JetStreamContext, cfg: LogConfig, *, heads_only: bool = False
                           ) -> AsyncIterator[ProjectionHead]:
    """Every projection (or only its head, which decodes much less), in no particular order."""
    decoder = msgspec.msgpack.Decoder(ProjectionHead if heads_only else Projection)
    async for _, value in iter_bucket(js, cfg.projections_bucket):
        yield decoder.decode(value)
