"""The viewer's session list: rows from summaries, filters, and paging by cursor (pure)."""

from __future__ import annotations

import msgspec
import pytest

from schemas.errors import MalformedRequest
from session.fold import fold
from session.summary import summarize
from tests.helpers import SessionScript
from viewer.listing import (
    MAX_LIMIT,
    SessionRow,
    decode_cursor,
    encode_cursor,
    newest_first,
    page,
    parse_limit,
    parse_status,
    put,
    remove,
    row,
)


def _row(n: int, *, uid: str = "prompt", status: str = "open", opened_at: float | None = None) -> SessionRow:
    return SessionRow(session_id=f"{n:032x}", status=status, uid=uid, session_index=0, agent_name="", turns=1,
                      chains=1, trajectories=1, reward=None, reason="", opened_at=float(n) if opened_at is None
                      else opened_at, updated_at=float(n))


def test_rows_come_from_summaries_with_quarantine_shown_as_the_status():
    script = SessionScript(uid="u7")
    script.turn(0, [1, 2], [3], new_chain=True)
    script.close(0)
    script.reward(0.5, acc=1.0)
    script.abort("runner_failed")
    r = row(summarize(fold(script.events)))
    assert (r.status, r.uid, r.turns, r.chains, r.trajectories, r.reward, r.reason) == \
        ("aborted", "u7", 1, 1, 1, 0.5, "runner_failed, max_trajectory_length")
    quarantined = msgspec.structs.replace(summarize(fold(script.events)), quarantined="invalid: bad ids")
    assert (row(quarantined).status, row(quarantined).reason) == ("quarantined", "invalid: bad ids")


def test_pages_cover_every_matching_row_once_newest_first():
    rows = newest_first([_row(n, uid="a" if n % 3 else "b", status="open" if n % 2 else "finalized")
                         for n in range(1, 101)])
    seen, cursor, pages = [], None, 0
    while True:
        p = page(rows, after=cursor, limit=7)
        seen += [r.session_id for r in p.sessions]
        pages += 1
        assert p.matching == 100 and p.total == 100
        if p.next is None:
            break
        cursor = p.next
    assert pages == 15 and seen == [r.session_id for r in rows]
    assert [r.opened_at for r in rows] == sorted((r.opened_at for r in rows), reverse=True)


def test_filters_by_uid_substring_and_status():
    rows = newest_first([_row(1, uid="math_12"), _row(2, uid="math_13", status="finalized"),
                         _row(3, uid="code_1"), _row(4, uid="math_12", status="quarantined")])
    assert [r.opened_at for r in page(rows, uid="math").sessions] == [4, 2, 1]
    assert [r.opened_at for r in page(rows, uid="math_12", status="open").sessions] == [1]
    assert page(rows, status="quarantined").matching == 1
    assert page(rows, uid="nothing").sessions == [] and page(rows, uid="nothing").next is None


def test_a_page_boundary_holds_while_newer_sessions_arrive():
    rows = newest_first([_row(n) for n in range(10)])
    first = page(rows, limit=4)
    grown = newest_first([*rows, _row(100), _row(101)])
    assert [r.opened_at for r in page(grown, after=first.next, limit=4).sessions] == [5, 4, 3, 2]


def test_equal_open_times_are_ordered_by_session_id_and_paged_without_loss():
    rows = newest_first([_row(n, opened_at=5.0) for n in range(9)])
    first = page(rows, limit=5)
    rest = page(rows, after=first.next, limit=5)
    assert [r.session_id for r in first.sessions + rest.sessions] == sorted(r.session_id for r in rows)
    assert rest.next is None


def test_cursors_round_trip_and_anything_else_is_a_400():
    assert decode_cursor(encode_cursor(_row(3))) == (-3.0, f"{3:032x}")
    for bad in ("x", "!!!", encode_cursor(_row(1))[:-3], "W10", "WyJhIiwxXQ", "a" * 600):
        with pytest.raises(MalformedRequest):
            decode_cursor(bad)


def test_limit_and_status_parameters_are_bounded():
    assert parse_limit(None) == 50 and parse_limit("500") == MAX_LIMIT
    for bad in ("0", "501", "-3", "ten", "1e3"):
        with pytest.raises(MalformedRequest):
            parse_limit(bad)
    assert parse_status("") is None and parse_status("aborted") == "aborted"
    with pytest.raises(MalformedRequest):
        parse_status("closed")


def test_rows_kept_in_order_as_sessions_come_change_and_go():
    rows: list[SessionRow] = []
    for n in (5, 1, 9, 3, 7):
        put(rows, _row(n))
    assert [r.opened_at for r in rows] == [9, 7, 5, 3, 1]
    put(rows, msgspec.structs.replace(_row(5), turns=4, status="finalized"))  # an update keeps its place
    assert [(r.opened_at, r.turns) for r in rows] == [(9, 1), (7, 1), (5, 4), (3, 1), (1, 1)]
    remove(rows, _row(7))
    remove(rows, _row(8))  # not there: nothing changes
    assert [r.opened_at for r in rows] == [9, 5, 3, 1] == [r.opened_at for r in newest_first(rows)]
