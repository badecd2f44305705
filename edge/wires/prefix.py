"""A resent history is not parsed again: the part of a body its session's last request had.

Agents resend their whole history on every request, byte for byte as before (an SDK
serializes the same message objects the same way). A :class:`KnownPrefix` remembers, for a
session's last decoded request, where its messages array starts and where its last message
ends, the messages decoded from it (with their history digests) and the sha256 state of the
body up to that point. A new body that starts with the same bytes up to there (one memcmp)
has the same messages there: :func:`skip_known` cuts them out of the array, and only what
is left (the new messages, the other fields) is parsed. The body's digest is finished from
the remembered hash state, so a 1 MB history costs a comparison, not a parse and a hash.

The cut is sound because the bytes before it are identical: a JSON parser is in the same
state there as it was in the earlier body, inside the messages array, after a whole message;
and :func:`cut_holds` checks that the messages parsed are those of that array. Any other body
(a rewritten or compacted history, other tools, a resend with no new message) is decoded in full.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from edge.chat.conversation import Message

_SPACE = b" \t\r\n"


class KnownPrefix:
    """What one decoded body teaches about the next (see the module docstring)."""

    __slots__ = ("body", "count", "digests", "end", "extra", "messages", "root", "sha", "start", "tip")

    def __init__(self, *, body: bytes, start: int, end: int, root: bytes, messages: tuple[Message, ...],
                 digests: tuple[str, ...], sha: Any, count: int, tip: bytes, extra: bytes = b"") -> None:
        self.body = body  # the body it was learnt from
        self.start = start  # offset of the first message (just after the array's ``[``)
        self.end = end  # offset just after the last message
        self.root = root  # the tools digest the history digests are rooted at
        self.messages = messages  # the neutral messages decoded from the known wire messages
        self.digests = digests  # their history digests (hex)
        self.sha = sha  # sha256 of body[:end]
        self.count = count  # wire messages in body[start:end]
        self.tip = tip  # the history digest after them
        self.extra = extra  # what else the history depends on, as the wire sees it (Anthropic's system)


def skip_known(body: bytes, known: KnownPrefix | None) -> tuple[bytes, KnownPrefix | None, int]:
    """``(document, known, shift)``: the body with ``known``'s messages cut out of its messages
    array, and how far the bytes after the cut moved (an offset ``o >= known.start`` in the
    document is ``o + shift`` in the body); or ``(body, None, 0)`` when the body does not start
    with them."""
    if known is None or not body.startswith(memoryview(known.body)[:known.end]):
        return body, None, 0
    at = known.end
    while at < len(body) and body[at] in _SPACE:
        at += 1
    if at >= len(body):
        return body, None, 0
    if body[at] == 0x2C:  # ",": more messages follow; the first of them starts the array now
        after = at + 1
        while after < len(body) and body[after] in _SPACE:
            after += 1
        if after >= len(body) or body[after] == 0x5D:  # "..., ]": a trailing comma, which JSON refuses
            return body, None, 0
        return body[:known.start] + body[at + 1:], known, at + 1 - known.start
    return body, None, 0  # "]" (no new message: a resend, decoded in full) or not JSON we know


def cut_holds(document: bytes, known: KnownPrefix, raws: list[Any]) -> bool:
    """Whether the messages parsed from a :func:`skip_known` document are those of the array that was
    cut: its first message right where the cut was. (Else the body has a second ``messages`` key
    further on, which a parser lets win: decoded in full, as it would be without the cut.)"""
    if not raws:
        return False
    at = known.start
    while at < len(document) and document[at] in _SPACE:
        at += 1
    return offset_in(document, raws[0]) == at


def offset_in(buffer: bytes, raw: Any) -> int:
    """Where ``raw`` (a ``msgspec.Raw`` decoded from ``buffer``, which it references) starts in it."""
    return _address(raw) - _address(buffer)


def _address(data: Any) -> int:
    """Where a buffer's bytes are in memory (numpy's array interface: half what ``.ctypes.data`` costs)."""
    address: int = np.frombuffer(data, np.uint8).__array_interface__["data"][0]
    return address


def learn(body: bytes, document: bytes, shift: int, known: KnownPrefix | None, new_raws: list[Any], *, root: bytes,
          messages: tuple[Message, ...], digests: tuple[str, ...], tip: bytes, extra: bytes = b""
          ) -> tuple[KnownPrefix | None, str]:
    """The prefix to remember from this body, and the body's sha256 hex.

    ``new_raws`` are the raw messages parsed from ``document`` (all of them when ``known`` is None);
    ``tip`` is the history digest after the last of them."""
    if known is not None:
        start, end, sha = known.start, known.end, known.sha.copy()
    else:
        start = end = -1
        sha = hashlib.sha256()
    if new_raws:
        first, last = new_raws[0], new_raws[-1]
        if known is None:
            start = offset_in(document, first)
            sha.update(memoryview(body)[:start])
            end = start
        last_end = offset_in(document, last) + len(last) + (shift if known is not None else 0)
        sha.update(memoryview(body)[end:last_end])
        end = last_end
    if end < 0:  # no message at all (refused later)
        return None, hashlib.sha256(body).hexdigest()
    whole = sha.copy()
    whole.update(memoryview(body)[end:])
    count = (known.count if known is not None else 0) + len(new_raws)
    prefix = KnownPrefix(body=body, start=start, end=end, root=root, messages=messages, digests=digests, sha=sha,
                         count=count, tip=tip, extra=extra)
    return prefix, whole.hexdigest()
