"""Placement of sessions on engine servers (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.engines.pool import ServerPool, session_of
from schemas.errors import EngineUnavailable

A, B, C = "http://a:1", "http://b:2", "http://c:3"


def test_session_of_strips_the_request_number() -> None:
    assert session_of("abc123:7") == "abc123"
    assert session_of("abc123") == "abc123"


def test_new_sessions_spread_and_then_stick() -> None:
    pool = ServerPool([A, B + "/", C])
    first = [pool.acquire(s) for s in ("s1", "s2", "s3")]
    for url in first:
        pool.release(url)
    assert first == [A, B, C]  # idle servers: fewest sessions, then order
    assert [pool.acquire("s2") for _ in range(3)] == [B, B, B]  # sticky, whatever the load


def test_new_sessions_go_to_the_server_with_fewest_requests_in_flight() -> None:
    pool = ServerPool([A, B])
    pool.acquire("busy1")  # A, in flight
    pool.acquire("busy1")  # A again: 2 in flight
    assert pool.acquire("new") == B
    assert pool.in_flight(A) == 2 and pool.in_flight(B) == 1
    pool.release(A)
    pool.release(A)
    pool.release(B)
    assert pool.acquire("newer") == A  # both idle; A and B have one session each: order decides


def test_an_unhealthy_server_gets_no_new_sessions_and_its_sessions_move() -> None:
    pool = ServerPool([A, B])
    assert pool.acquire("s1") == A
    pool.set_health(A, False)
    assert pool.acquire("s2") == B
    assert pool.acquire("s1") == B  # re-placed at its next request
    assert pool.sessions_on(A) == 0 and pool.sessions_on(B) == 2
    pool.set_health(A, True)
    assert pool.acquire("s1") == B  # stays where it was re-placed
    assert pool.acquire("s3") == A


def test_no_healthy_server_is_unavailable() -> None:
    pool = ServerPool([A])
    pool.set_health(A, False)
    with pytest.raises(EngineUnavailable, match="no healthy engine server"):
        pool.acquire("s1")


def test_placements_are_bounded_least_recently_used_first() -> None:
    pool = ServerPool([A, B], max_sessions=2)
    pool.acquire("s1")
    pool.acquire("s2")
    pool.acquire("s1")  # s1 is now the most recent
    pool.acquire("s3")  # forgets s2
    assert pool.server_of("s2") is None
    assert pool.server_of("s1") is not None and pool.server_of("s3") is not None
    assert pool.sessions_on(A) + pool.sessions_on(B) == 2


def test_release_never_goes_negative_and_urls_are_deduplicated() -> None:
    pool = ServerPool([A, A + "/", B])
    assert pool.urls == (A, B)
    pool.release(A)
    assert pool.in_flight(A) == 0
    with pytest.raises(ValueError):
        ServerPool([])


operations = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.sampled_from(["s1", "s2", "s3", "s4", "s5"])),
        st.tuples(st.just("release"), st.sampled_from([A, B, C])),
        st.tuples(st.just("down"), st.sampled_from([A, B, C])),
        st.tuples(st.just("up"), st.sampled_from([A, B, C])),
    ),
    max_size=60,
)


@given(operations)
def test_invariants_hold_under_any_sequence(ops: list[tuple[str, str]]) -> None:
    pool = ServerPool([A, B, C], max_sessions=4)
    for op, arg in ops:
        if op == "acquire":
            try:
                url = pool.acquire(arg)
            except EngineUnavailable:
                assert pool.healthy() == ()
                continue
            assert pool.is_healthy(url) and pool.server_of(arg) == url
        elif op == "release":
            pool.release(arg)
        else:
            pool.set_health(arg, op == "up")
        placed = [pool.server_of(s) for s in ("s1", "s2", "s3", "s4", "s5")]
        assert sum(pool.sessions_on(u) for u in pool.urls) == sum(p is not None for p in placed) <= 4
        assert all(pool.sessions_on(u) == placed.count(u) for u in pool.urls)
        assert all(pool.in_flight(u) >= 0 for u in pool.urls)
