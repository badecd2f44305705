"""The session index: one session per ``(uid, session_index)``.

The materializer keys trajectories ``{uid}_{session_index}_{trajectory_index}``, so a second
session with the pair would have its records dropped. Opening a session with a client-chosen uid
claims the pair in the index (:class:`KvSessionIndex`); see :mod:`edge.service` for the rules.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Protocol

import msgspec
from nats.js.client import JetStreamContext

from eventlog.kv import Kv, KvStore
from schemas.errors import Conflict, LogUnavailable, RevisionConflict
from schemas.log import LogConfig
from schemas.metadata import or_default, read_settings

log = logging.getLogger(__name__)


class IndexHolder(msgspec.Struct, frozen=True, kw_only=True):
    """The value of a session index entry: the session that holds a (uid, session_index)."""

    session_id: str
    attempt: int = 0


_holder_decoder = msgspec.json.Decoder(IndexHolder)


def _holder(value: bytes, key: str) -> IndexHolder:
    try:
        return _holder_decoder.decode(value)
    except msgspec.DecodeError as exc:  # not written by an edge: who holds the pair is unknown
        raise LogUnavailable(f"session index entry {key} is not a session index entry: {exc}") from exc


def index_key(uid: str, session_index: int) -> str:
    """The session index key of ``(uid, session_index)``: a digest, safe as a KV key whatever the uid."""
    return hashlib.sha256(msgspec.json.encode([uid, session_index])).hexdigest()


def attempt_of(metadata: dict[str, Any]) -> int:
    """The session's dispatch attempt (``metadata.attempt``, checked by :func:`_check_metadata`; 0 without it)."""
    return or_default(read_settings(metadata)[0].attempt, 0)


class IndexClaim(Protocol):
    async def release(self) -> None:
        """Undo the claim (best effort): the session it was for was not opened."""


class SessionIndex(Protocol):
    async def claim(self, uid: str, session_index: int, attempt: int, session_id: str) -> IndexClaim:
        """Make ``session_id`` the holder of ``(uid, session_index)``, or raise :class:`Conflict`."""


class _KvClaim:
    def __init__(self, store: Kv, key: str, revision: int, previous: bytes | None) -> None:
        self._store = store
        self._key = key
        self._revision = revision
        self._previous = previous

    async def release(self) -> None:
        try:
            if self._previous is None:
                await self._store.delete(self._key, self._revision)
            else:
                await self._store.update(self._key, self._previous, self._revision)
        except (RevisionConflict, LogUnavailable) as exc:
            log.warning("session index key %s not released: %r", self._key, exc)


class KvSessionIndex:
    """``cfg.session_index_bucket``: ``index_key(uid, session_index)`` -> :class:`IndexHolder`, written
    by compare-and-set (revision 0 to create). Read and written only when a session opens."""

    def __init__(self, store: Kv, *, tries: int = 4) -> None:
        self._store = store
        self._tries = tries

    @classmethod
    def on(cls, js: JetStreamContext, cfg: LogConfig, *, timeout: float = 5.0, tries: int = 4) -> KvSessionIndex:
        """The index in ``cfg.session_index_bucket``, each call bounded by ``timeout``."""
        return cls(KvStore(js, cfg.session_index_bucket, timeout=timeout), tries=tries)

    async def claim(self, uid: str, session_index: int, attempt: int, session_id: str) -> IndexClaim:
        key = index_key(uid, session_index)
        value = msgspec.json.encode(IndexHolder(session_id=session_id, attempt=attempt))
        for _ in range(self._tries):
            previous, revision = await self._store.entry(key)  # (a released claim: its marker's revision)
            if previous is not None:
                holder = _holder(previous, key)
                if attempt <= holder.attempt:
                    raise Conflict(
                        f"uid {uid!r} session_index {session_index} is already taken by session "
                        f"{holder.session_id} (attempt {holder.attempt}); only a newer metadata.attempt "
                        f"than {holder.attempt} may open it again", param="session_index")
            try:
                new_revision = await self._store.update(key, value, revision)
            except RevisionConflict:  # another open of the pair came first: look again
                continue
            if previous is not None:
                log.info("uid %r session_index %d: attempt %d takes over from session %s", uid, session_index,
                         attempt, _holder(previous, key).session_id)
            return _KvClaim(self._store, key, new_revision, previous)
        raise Conflict(f"uid {uid!r} session_index {session_index} is being opened concurrently",
                       param="session_index")


class _NoClaim:
    async def release(self) -> None:
        return None


NO_CLAIM = _NoClaim()
