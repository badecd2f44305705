"""A KV bucket in memory: what :class:`eventlog.kv.KvStore` does on JetStream KV, for tests that need no NATS.

The same contract suite (``tests/contract/kv_contract.py``) runs against both, so that they cannot drift
apart. It follows JetStream KV's rules:

* revisions count every write of every key of the bucket, from 1 (a KV bucket is one stream);
* a delete writes a marker: the key reads as absent, at the marker's revision, which a compare-and-set
  over the deleted key names (0 only for a key never written);
* ``update(key, value, revision)`` writes only over exactly ``revision``, else :class:`RevisionConflict`;
  ``create`` writes a key that holds no value (never written, or deleted);
* ``delete(key, revision)`` deletes only over exactly ``revision``; without one, whatever the key holds.

What it does not do: time out, or be refused (:meth:`InMemoryKv.fail_next` makes the next call raise
:class:`LogUnavailable`, as a store JetStream does not answer).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from eventlog.kv import KvEntry
from schemas.errors import LogUnavailable, RevisionConflict


class InMemoryKv:
    def __init__(self, bucket: str = "memory") -> None:
        self.bucket = bucket
        self._revision = 0
        self._entries: dict[str, KvEntry] = {}  # value None: a delete marker
        self._failures: list[str] = []

    def fail_next(self, why: str = "no answer") -> None:
        """The next call raises :class:`LogUnavailable` (and changes nothing)."""
        self._failures.append(why)

    def _check(self, what: str) -> None:
        if self._failures:
            raise LogUnavailable(f"JetStream KV did not answer ({what}: {self._failures.pop(0)})")

    async def bind(self) -> InMemoryKv:
        self._check(f"bind {self.bucket}")
        return self

    def _write(self, key: str, value: bytes | None) -> int:
        self._revision += 1
        self._entries[key] = KvEntry(value, self._revision)
        return self._revision

    async def entry(self, key: str) -> KvEntry:
        self._check(f"get {key}")
        return self._entries.get(key, KvEntry(None, 0))

    async def get(self, key: str) -> tuple[bytes, int] | None:
        value, revision = await self.entry(key)
        return None if value is None else (value, revision)

    async def create(self, key: str, value: bytes) -> int:
        self._check(f"create {key}")
        if self._entries.get(key, KvEntry(None, 0)).value is not None:
            raise RevisionConflict(f"create {key}: written concurrently")
        return self._write(key, value)

    async def update(self, key: str, value: bytes, revision: int) -> int:
        self._check(f"update {key}")
        if self._entries.get(key, KvEntry(None, 0)).revision != revision:
            raise RevisionConflict(f"update {key}: written concurrently")
        return self._write(key, value)

    async def write(self, key: str, value: bytes, revision: int) -> int:
        return await (self.update(key, value, revision) if revision else self.create(key, value))

    async def put(self, key: str, value: bytes) -> int:
        self._check(f"put {key}")
        return self._write(key, value)

    async def delete(self, key: str, revision: int | None = None) -> None:
        self._check(f"delete {key}")
        if revision is not None and self._entries.get(key, KvEntry(None, 0)).revision != revision:
            raise RevisionConflict(f"delete {key}: written concurrently")
        self._write(key, None)

    async def keys(self) -> list[str]:
        self._check(f"keys of {self.bucket}")
        return [key for key, entry in self._entries.items() if entry.value is not None]

    async def items(self) -> AsyncIterator[tuple[str, bytes]]:
        self._check(f"read {self.bucket}")
        for key, (value, _) in sorted(self._entries.items(), key=lambda item: item[1].revision):
            if value is not None:
                yield key, value
