"""Leases and the session index on the in-memory KV: the edge's ownership rules without a nats-server."""

from __future__ import annotations

import pytest

from edge.ownership import KvLeases
from edge.session_index import KvSessionIndex
from rollbus.testing.memory_kv import InMemoryKv
from schemas.errors import Conflict, LogUnavailable, OwnershipLost, SessionOwned


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_held_lease_refuses_another_edge_until_it_lapses() -> None:
    kv, clock = InMemoryKv("leases"), Clock()
    mine = KvLeases(kv, edge_id="a", ttl=10.0, grace=2.0, clock=clock)
    other = KvLeases(kv, edge_id="b", ttl=10.0, grace=2.0, clock=clock)
    handle = await mine.create("s1")
    with pytest.raises(SessionOwned) as owned:
        await other.acquire("s1")
    assert owned.value.retry_after == pytest.approx(12.0)
    clock.now += 12.5  # past expiry and grace
    taken = await other.acquire("s1")
    lease, _ = await mine.read("s1")
    assert lease is not None and lease.edge_id == "b"
    with pytest.raises(OwnershipLost):  # the first edge's renewal finds the lease changed hands
        await handle.renew()
    await taken.release()
    assert (await other.read("s1"))[0] is None


async def test_create_refuses_a_session_id_that_has_a_lease() -> None:
    kv = InMemoryKv("leases")
    await KvLeases(kv, edge_id="a").create("s1")
    with pytest.raises(OwnershipLost):
        await KvLeases(kv, edge_id="b").create("s1")


async def test_a_write_that_timed_out_but_was_applied_is_adopted() -> None:
    class AppliedThenSilent(InMemoryKv):
        """The next update is stored, and its answer lost."""

        lose_answer = False

        async def update(self, key: str, value: bytes, revision: int) -> int:
            written = await super().update(key, value, revision)
            if self.lose_answer:
                self.lose_answer = False
                raise LogUnavailable("no answer")
            return written

    kv, clock = AppliedThenSilent("leases"), Clock()
    leases = KvLeases(kv, edge_id="a", ttl=10.0, clock=clock)
    handle = await leases.create("s1")
    kv.lose_answer = True
    clock.now += 1.0
    await handle.renew()  # adopts the revision it wrote
    assert handle.revision == (await leases.read("s1"))[1]
    kv.fail_next()  # not applied: the error reaches the caller
    with pytest.raises(LogUnavailable):
        await leases.create("s2")


async def test_the_session_index_claims_by_attempt() -> None:
    index = KvSessionIndex(InMemoryKv("index"))
    await index.claim("task", 0, 0, "s1")
    with pytest.raises(Conflict, match="already taken by session s1"):
        await index.claim("task", 0, 0, "s2")
    await index.claim("task", 0, 1, "s2")  # a newer attempt takes it over
    with pytest.raises(Conflict, match="s2"):
        await index.claim("task", 0, 1, "s3")
