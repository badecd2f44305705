"""The KV contract (tests/contract/kv_contract.py) against :class:`rollbus.testing.memory_kv.InMemoryKv`."""

from __future__ import annotations

import pytest

from rollbus.testing.memory_kv import InMemoryKv
from schemas.errors import LogUnavailable
from tests.contract.kv_contract import KvContract


class TestInMemoryKv(KvContract):
    @pytest.fixture
    def store(self) -> InMemoryKv:
        return InMemoryKv()


async def test_a_failure_asked_for_is_log_unavailable_and_changes_nothing() -> None:
    kv = InMemoryKv()
    revision = await kv.create("k", b"one")
    kv.fail_next()
    with pytest.raises(LogUnavailable):
        await kv.update("k", b"two", revision)
    assert await kv.get("k") == (b"one", revision)


async def test_items_are_the_live_keys_in_write_order() -> None:
    kv = InMemoryKv()
    for key in ("a", "b", "c"):
        await kv.put(key, key.encode())
    await kv.put("a", b"again")
    await kv.delete("b")
    assert [item async for item in kv.items()] == [("c", b"c"), ("a", b"again")]
