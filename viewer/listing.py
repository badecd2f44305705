"""The session list: summaries as rows, newest first, filtered by uid and status, paged by cursor. Pure.

A page's ``next`` cursor names the last row shown, ``(opened_at, session_id)``, as an opaque
URL-safe token; the next page starts strictly after it, so a page boundary holds still while
sessions are added (new ones are newer, listed before the first page's first row).
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence

import msgspec

from schemas.errors import MalformedRequest
from session.summary import SessionSummary

MAX_LIMIT = 500
DEFAULT_LIMIT = 50
STATUSES = ("open", "finalized", "aborted", "quarantined")


class SessionRow(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    status: str  # "quarantined" for a session the materializer set aside, else the session's status
    uid: str
    session_index: int
    agent_name: str
    turns: int
    chains: int
    trajectories: int
    reward: float | None
    reason: str  # why it was quarantined, else why it ended and its chains' materialization reasons
    opened_at: float
    updated_at: float
    forks: dict[str, int] = {}  # chains after the first, by the cause of their fork (SessionSummary.forks)


class Page(msgspec.Struct, frozen=True, kw_only=True):
    sessions: list[SessionRow]
    matching: int  # rows matching the filter, all pages
    total: int  # rows in all
    next: str | None  # cursor of the page after this one; None on the last page


def row(summary: SessionSummary) -> SessionRow:
    status = "quarantined" if summary.quarantined is not None else summary.status
    reasons = [summary.close_reason] if summary.close_reason not in (None, summary.status) else []
    reasons += [c.materialization_reason for c in summary.chains if c.materialization_reason]
    reason = summary.quarantined or ", ".join(dict.fromkeys(r for r in reasons if r))
    return SessionRow(session_id=summary.session_id, status=status, uid=summary.uid,
                      session_index=summary.session_index, agent_name=summary.agent_name, turns=summary.turns,
                      chains=len(summary.chains), trajectories=summary.trajectories, reward=summary.reward,
                      reason=reason or "", opened_at=summary.opened_at, updated_at=summary.updated_at,
                      forks=dict(summary.forks))


def order_key(r: SessionRow) -> tuple[float, str]:
    """Newest first; a session's key never changes (it opened once), so an update keeps its place."""
    return (-r.opened_at, r.session_id)


def newest_first(rows: Iterable[SessionRow]) -> list[SessionRow]:
    return sorted(rows, key=order_key)


def put(rows: list[SessionRow], new: SessionRow) -> None:
    """Insert ``new`` into ``rows`` (sorted by :func:`order_key`), or replace the row of its session."""
    index = bisect_left(rows, order_key(new), key=order_key)
    if index < len(rows) and rows[index].session_id == new.session_id:
        rows[index] = new
    else:
        rows.insert(index, new)


def remove(rows: list[SessionRow], old: SessionRow) -> None:
    index = bisect_left(rows, order_key(old), key=order_key)
    if index < len(rows) and rows[index].session_id == old.session_id:
        del rows[index]


def encode_cursor(r: SessionRow) -> str:
    raw = json.dumps([r.opened_at, r.session_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    """The sort key a cursor names; :class:`MalformedRequest` for anything not made by :func:`encode_cursor`."""
    try:
        if len(cursor) > 512:
            raise ValueError("too long")
        value = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        opened_at, session_id = value
        if not isinstance(opened_at, int | float) or not isinstance(session_id, str) or not math.isfinite(opened_at):
            raise ValueError("not a cursor")
    except (ValueError, TypeError, binascii.Error) as exc:
        raise MalformedRequest("after: not a cursor this viewer gave out", param="after") from exc
    return (-float(opened_at), session_id)


def parse_limit(text: str | None) -> int:
    if text is None or text == "":
        return DEFAULT_LIMIT
    try:
        limit = int(text)
    except ValueError:
        raise MalformedRequest(f"limit: not an integer: {text[:40]!r}", param="limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise MalformedRequest(f"limit: must be 1 to {MAX_LIMIT}, not {limit}", param="limit")
    return limit


def parse_status(text: str | None) -> str | None:
    if not text:
        return None
    if text not in STATUSES:
        raise MalformedRequest(f"status: one of {', '.join(STATUSES)}, not {text[:40]!r}", param="status")
    return text


def page(rows: Sequence[SessionRow], *, uid: str | None = None, status: str | None = None,
         after: str | None = None, limit: int = DEFAULT_LIMIT) -> Page:
    """One page of ``rows`` (sorted by :func:`newest_first`): those whose uid contains ``uid``, of ``status``."""
    if status is None and not uid:
        matching = rows
    else:
        matching = [r for r in rows if (status is None or r.status == status) and (not uid or uid in r.uid)]
    start = bisect_right(matching, decode_cursor(after), key=order_key) if after else 0
    shown = matching[start: start + limit]
    more = start + limit < len(matching)
    return Page(sessions=shown, matching=len(matching), total=len(rows),
                next=encode_cursor(shown[-1]) if more and shown else None)
