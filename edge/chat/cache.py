"""A small bounded cache for the codec's hot paths (tokenized pieces, decoded messages,
history digests, dumped tool schemas).

Entries are kept until either bound is passed, then all are dropped at once: the hot
entries (a session's history, its tool schemas) come back on the next request, and
there is no per-hit bookkeeping. The byte bound keeps long tool results from pinning
memory: ``size`` is what an entry holds, roughly.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedCache(Generic[K, V]):
    def __init__(self, *, max_items: int = 16384, max_bytes: int = 32 * 1024 * 1024,
                 pinned: dict[K, V] | None = None) -> None:
        """``pinned``: entries that are always there (they survive the clears and count towards
        neither bound)."""
        self._pinned = dict(pinned or {})
        self._data: dict[K, V] = dict(self._pinned)
        self._bytes = 0
        self._max_items = max_items
        self._max_bytes = max_bytes

    def __len__(self) -> int:
        """Entries held besides the pinned ones."""
        return len(self._data) - len(self._pinned)

    def __iter__(self) -> Iterator[K]:
        return (key for key in self._data if key not in self._pinned)

    def get(self, key: K) -> V | None:
        return self._data.get(key)

    def put(self, key: K, value: V, size: int = 0) -> V:
        if size > self._max_bytes // 4:
            return value  # too big to be worth keeping
        if len(self._data) >= self._max_items + len(self._pinned) or self._bytes + size > self._max_bytes:
            self._data.clear()
            self._data.update(self._pinned)
            self._bytes = 0
        self._data[key] = value
        self._bytes += size
        return value
