"""The log's KV buckets, one store for all: leases, the session index, projections, markers, prompts.

Each bucket is created by :func:`stack.provision.provision`; a :class:`KvStore` binds it on first
use (or at :meth:`KvStore.bind`, to fail early). Every call is bounded by the store's timeout and
what nats-py raises is mapped here, once (as httpx's ``map_httpcore_exceptions`` maps httpcore's)::

    KeyWrongLastSequenceError, or an API error 10071    RevisionConflict (a compare-and-set lost;
                                                       nats-py maps a delete's 10071 to no error of its own)
    KeyNotFoundError, NotFoundError on a read          absent: a KvEntry with value None
    the bucket does not exist                          LogUnavailable, naming it
    TimeoutError, any other nats-py error, OSError     LogUnavailable

A compare-and-set names the revision it read: 0 for a key never written, and for a deleted key
the revision of its delete marker (what :meth:`KvStore.entry` returns for it), so that a write
racing a delete is refused like any other.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import NamedTuple, Protocol, TypeVar

from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import ConsumerConfig, DeliverPolicy, RawStreamMsg
from nats.js.client import JetStreamContext
from nats.js.errors import APIError, KeyNotFoundError, KeyWrongLastSequenceError, NoKeysError, NotFoundError
from nats.js.kv import KeyValue

from eventlog.publisher import WRONG_LAST_SEQUENCE
from schemas.errors import LogUnavailable, RevisionConflict

T = TypeVar("T")

_KV_OPERATION = "KV-Operation"  # the header of a delete or purge marker in a bucket's stream


class Kv(Protocol):
    """A KV bucket as its users see it: :class:`KvStore` on JetStream, ``rollbus.testing.memory_kv.InMemoryKv``
    in memory; ``tests/contract/kv_contract.py`` holds both to one contract."""

    bucket: str

    async def bind(self) -> Kv:
        """The store, its bucket bound now: :class:`LogUnavailable` when it does not exist or does not answer."""
        ...
    async def entry(self, key: str) -> KvEntry: ...
    async def get(self, key: str) -> tuple[bytes, int] | None: ...
    async def create(self, key: str, value: bytes) -> int: ...
    async def update(self, key: str, value: bytes, revision: int) -> int: ...
    async def write(self, key: str, value: bytes, revision: int) -> int: ...
    async def put(self, key: str, value: bytes) -> int: ...
    async def delete(self, key: str, revision: int | None = None) -> None: ...
    async def keys(self) -> list[str]: ...
    def items(self) -> AsyncIterator[tuple[str, bytes]]: ...


class KvEntry(NamedTuple):
    """A key as read: its value (None when absent or deleted) and the revision a write over it names."""

    value: bytes | None
    revision: int


async def bounded(call: Awaitable[T], timeout: float, what: str) -> T:
    """``call`` within ``timeout``; JetStream's silence or refusal is :class:`LogUnavailable` (of ``what``)."""
    try:
        return await asyncio.wait_for(call, timeout)
    except KeyWrongLastSequenceError as exc:
        raise RevisionConflict(f"{what}: written concurrently") from exc
    except (NotFoundError, NoKeysError):  # (KeyNotFoundError among them): the caller's to read as absent
        raise
    except APIError as exc:
        if exc.err_code == WRONG_LAST_SEQUENCE:  # (a delete's: nats-py maps only an update's to the error above)
            raise RevisionConflict(f"{what}: written concurrently") from exc
        raise LogUnavailable(f"JetStream KV refused {what}: {exc!r}") from exc
    except (TimeoutError, NatsError, OSError) as exc:  # (nats-py's TimeoutError subclasses both)
        raise LogUnavailable(f"JetStream KV did not answer ({what}: {exc!r})") from exc


class KvStore:
    """One KV bucket: bounded calls, compare-and-set on revisions, errors mapped."""

    def __init__(self, js: JetStreamContext, bucket: str, *, timeout: float = 5.0) -> None:
        self._js = js
        self.bucket = bucket
        self.timeout = timeout
        self._kv: KeyValue | None = None

    async def bind(self: S) -> S:
        """Bind the bucket now: :class:`LogUnavailable` when it does not exist or JetStream does not answer."""
        await self._bound()
        return self

    async def _bound(self) -> KeyValue:
        if self._kv is None:
            try:
                self._kv = await bounded(self._js.key_value(self.bucket), self.timeout, f"bind {self.bucket}")
            except NotFoundError as exc:
                raise LogUnavailable(f"KV bucket {self.bucket} does not exist; run provisioning first") from exc
        return self._kv

    async def entry(self, key: str) -> KvEntry:
        """The key's value and revision; a missing key is ``(None, 0)``, a deleted one ``(None, its marker's)``."""
        kv = await self._bound()
        try:
            found = await bounded(kv.get(key), self.timeout, f"get {key}")
        except KeyNotFoundError as exc:  # a deleted key: its delete marker's revision
            return KvEntry(None, int(exc.entry.revision or 0) if exc.entry is not None else 0)
        except NotFoundError:
            return KvEntry(None, 0)
        return KvEntry(found.value or b"", int(found.revision or 0))

    async def get(self, key: str) -> tuple[bytes, int] | None:
        """The key's value and revision, or None when it has none."""
        value, revision = await self.entry(key)
        return None if value is None else (value, revision)

    async def create(self, key: str, value: bytes) -> int:
        """Write a key that holds no value (never written, or deleted); :class:`RevisionConflict` when it does."""
        kv = await self._bound()
        return await bounded(kv.create(key, value), self.timeout, f"create {key}")

    async def update(self, key: str, value: bytes, revision: int) -> int:
        """Write over exactly ``revision`` (0: the key was never written); returns the new revision."""
        kv = await self._bound()
        return await bounded(kv.update(key, value, last=revision), self.timeout, f"update {key}")

    async def write(self, key: str, value: bytes, revision: int) -> int:
        """Create (``revision == 0``) or compare-and-set."""
        return await (self.update(key, value, revision) if revision else self.create(key, value))

    async def put(self, key: str, value: bytes) -> int:
        """Write whatever the key holds (no compare-and-set)."""
        kv = await self._bound()
        return await bounded(kv.put(key, value), self.timeout, f"put {key}")

    async def delete(self, key: str, revision: int | None = None) -> None:
        """Delete the key (over exactly ``revision``, when given)."""
        kv = await self._bound()
        await bounded(kv.delete(key, last=revision), self.timeout, f"delete {key}")

    async def keys(self) -> list[str]:
        """The bucket's live keys."""
        kv = await self._bound()
        try:
            return await bounded(kv.keys(), self.timeout, f"keys of {self.bucket}")
        except NoKeysError:
            return []

    async def watch(self) -> KeyValue.KeyWatcher:
        """nats-py's watcher of every key: their current values, a None, then each update as it comes."""
        kv = await self._bound()
        return await bounded(kv.watchall(), self.timeout, f"watch {self.bucket}")

    async def items(self) -> AsyncIterator[tuple[str, bytes]]:
        """(key, value) of every live key, read in one pass over the bucket's stream (the last value per key)."""
        async for item in iter_bucket(self._js, self.bucket, self.timeout):
            yield item


S = TypeVar("S", bound=KvStore)


async def iter_bucket(js: JetStreamContext, name: str, timeout: float = 5.0) -> AsyncIterator[tuple[str, bytes]]:
    """(key, value) of every live key of a KV bucket, read in one pass (last value per key); nothing
    when the bucket does not exist."""
    stream = f"KV_{name}"
    try:
        info = await bounded(js.stream_info(stream), timeout, f"info {stream}")
    except NotFoundError:
        return
    if not info.state.messages:
        return
    prefix = f"$KV.{name}."
    config = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
    sub = await bounded(js.subscribe(prefix + ">", ordered_consumer=True, stream=stream, config=config),
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


async def bucket_writes(js: JetStreamContext, bucket: str, after: int, *, batch: int = 256,
                        timeout: float = 10.0) -> tuple[list[tuple[str, bytes | None]], int]:
    """The writes to a KV bucket stored after its stream's sequence ``after``, in order: (key, value; None for a
    delete or purge), and the sequence read up to (``after`` for the next call). Each message is fetched once by
    sequence, ``batch`` at a time, with no consumer on the server; a write since overwritten (beyond the bucket's
    history) is skipped. :class:`LogUnavailable` when JetStream does not answer."""
    stream, prefix = f"KV_{bucket}", f"$KV.{bucket}."
    top = (await bounded(js.stream_info(stream), timeout, f"info {stream}")).state.last_seq
    writes: list[tuple[str, bytes | None]] = []
    for start in range(after + 1, top + 1, batch):
        seqs = range(start, min(start + batch, top + 1))
        for msg in await asyncio.gather(*(_stored(js, stream, seq, timeout) for seq in seqs)):
            if msg is not None and msg.subject:
                deleted = (msg.headers or {}).get(_KV_OPERATION) in ("DEL", "PURGE")
                writes.append((msg.subject.removeprefix(prefix), None if deleted else msg.data or b""))
    return writes, max(after, top)


async def _stored(js: JetStreamContext, stream: str, seq: int, timeout: float) -> RawStreamMsg | None:
    try:
        return await bounded(js.get_msg(stream, seq), timeout, f"{stream} message {seq}")
    except NotFoundError:  # deleted, or beyond the bucket's history
        return None
