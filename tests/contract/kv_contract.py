"""The KV contract: what leases, the session index, projections, markers and the prompt ledger rely on
(:class:`eventlog.kv.KvStore`), as one suite to run against every KV backend.

A module binds it by subclassing :class:`KvContract` with a ``store`` fixture, an empty bucket:
``tests/integration/test_kv_contract_jetstream.py`` (:class:`eventlog.kv.KvStore` on a real nats-server's KV)
and ``tests/unit/test_kv_contract_memory.py`` (``rollbus.testing.memory_kv.InMemoryKv``).
"""

from __future__ import annotations

import asyncio

import pytest

from eventlog.kv import Kv
from schemas.errors import RevisionConflict


class KvContract:
    async def test_a_key_never_written_is_absent_at_revision_zero(self, store: Kv) -> None:
        assert tuple(await store.entry("k")) == (None, 0)
        assert await store.get("k") is None
        assert await store.keys() == []

    async def test_create_writes_once(self, store: Kv) -> None:
        revision = await store.create("k", b"one")
        assert revision > 0
        assert await store.get("k") == (b"one", revision)
        with pytest.raises(RevisionConflict):
            await store.create("k", b"two")
        assert await store.get("k") == (b"one", revision)

    async def test_update_is_a_compare_and_set_on_the_revision_read(self, store: Kv) -> None:
        first = await store.create("k", b"one")
        second = await store.update("k", b"two", first)
        assert second > first
        with pytest.raises(RevisionConflict):
            await store.update("k", b"stale", first)
        with pytest.raises(RevisionConflict):
            await store.update("k", b"as if new", 0)
        assert await store.get("k") == (b"two", second)

    async def test_update_at_revision_zero_creates(self, store: Kv) -> None:
        revision = await store.update("k", b"one", 0)
        assert await store.get("k") == (b"one", revision)

    async def test_write_creates_at_zero_and_updates_after(self, store: Kv) -> None:
        first = await store.write("k", b"one", 0)
        second = await store.write("k", b"two", first)
        assert await store.get("k") == (b"two", second)
        with pytest.raises(RevisionConflict):
            await store.write("k", b"three", first)

    async def test_a_deleted_key_is_absent_at_its_delete_marker_revision(self, store: Kv) -> None:
        revision = await store.create("k", b"one")
        await store.delete("k", revision)
        value, marker = await store.entry("k")
        assert value is None and marker > revision
        assert await store.get("k") is None and await store.keys() == []
        with pytest.raises(RevisionConflict):  # a writer that read the key before it was deleted
            await store.update("k", b"late", revision)
        again = await store.update("k", b"two", marker)
        assert await store.get("k") == (b"two", again)

    async def test_create_after_a_delete(self, store: Kv) -> None:
        await store.delete("k", await store.create("k", b"one"))
        revision = await store.create("k", b"two")
        assert await store.get("k") == (b"two", revision)

    async def test_delete_over_a_stale_revision_is_refused(self, store: Kv) -> None:
        first = await store.create("k", b"one")
        await store.update("k", b"two", first)
        with pytest.raises(RevisionConflict):
            await store.delete("k", first)
        assert (await store.get("k") or (b"",))[0] == b"two"
        await store.delete("k")  # without a revision: whatever it holds
        assert await store.get("k") is None

    async def test_put_writes_whatever_the_key_holds(self, store: Kv) -> None:
        await store.put("k", b"one")
        revision = await store.put("k", b"two")
        assert await store.get("k") == (b"two", revision)

    async def test_keys_are_the_live_keys(self, store: Kv) -> None:
        for key in ("a", "b", "c"):
            await store.put(key, key.encode())
        await store.delete("b")
        assert sorted(await store.keys()) == ["a", "c"]

    async def test_of_concurrent_compare_and_sets_over_one_revision_exactly_one_wins(self, store: Kv) -> None:
        revision = await store.create("k", b"zero")
        results = await asyncio.gather(*(store.update("k", str(i).encode(), revision) for i in range(8)),
                                       return_exceptions=True)
        won = [i for i, result in enumerate(results) if isinstance(result, int)]
        assert len(won) == 1
        assert all(isinstance(r, RevisionConflict) for i, r in enumerate(results) if i != won[0])
        assert await store.get("k") == (str(won[0]).encode(), results[won[0]])
