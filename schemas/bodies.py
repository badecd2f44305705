"""Request bodies stored once: a body is written as parts, rebuilt from them on read.

Agents resend their whole history on every request, so a session's raw requests grow with
the square of its length, while what is *new* in each grows only with the turn. A
``request_received`` event therefore stores its body as :class:`~schemas.events.BodyPart`\\ s:
the bytes it shares with an earlier request of the session (the longest common prefix,
typically the history, and the longest common suffix after it, typically the tools and
sampling options) as references ``(request_no, start, length)`` into that request's body,
and only the bytes between them as data. The body is their concatenation, byte for byte.

This module is pure: :func:`parts_against` decides a body's parts (the edge writes them),
:class:`Bodies` rebuilds bodies from the events of one session (replay, audit, export).
Rebuilding is linear in what the log stores: a body is held as a list of spans over the
events' own data (never copied until asked for), and a reference takes the spans it names.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence

from schemas.errors import FoldError
from schemas.events import BodyPart, RequestReceived, body_digest

MIN_SHARED = 64  # shared runs shorter than this are stored as data (a reference costs ~10 bytes)
_BLOCK = 64 * 1024  # bytes compared per step while finding the common prefix / suffix


def literal(body: bytes) -> tuple[BodyPart, ...]:
    """A body stored whole (the session's first request, or one that shares nothing)."""
    return (BodyPart(data=body),)


def received(*, session_id: str, seq: int, time: float, request_no: int, wire: str, body: bytes,
             idempotency_key: str | None = None) -> RequestReceived:
    """A ``request_received`` whose body is stored whole (tests, tools, the first request)."""
    return RequestReceived(session_id=session_id, seq=seq, time=time, request_no=request_no, wire=wire,
                           parts=literal(body), body_size=len(body), idempotency_key=idempotency_key,
                           body_digest=body_digest(body))


def common_prefix(a: bytes, b: bytes) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (block-wise memcmp, then bisection)."""
    limit = min(len(a), len(b))
    view = memoryview(b)
    start = 0
    while start < limit:
        end = min(start + _BLOCK, limit)
        if not a.startswith(view[start:end], start):
            low, high = start, end  # a[:low] == b[:low]; they differ before high
            while high - low > 1:
                middle = (low + high) // 2
                if a.startswith(view[low:middle], low):
                    low = middle
                else:
                    high = middle
            return low
        start = end
    return limit


def common_suffix(a: bytes, b: bytes, limit: int) -> int:
    """Length (at most ``limit``) of the longest common suffix of ``a`` and ``b``."""
    limit = min(limit, len(a), len(b))
    view = memoryview(b)
    la, lb = len(a), len(b)
    done = 0  # a[la - done:] == b[lb - done:]
    while done < limit:
        size = min(_BLOCK, limit - done)
        if a.startswith(view[lb - done - size: lb - done], la - done - size):
            done += size
            continue
        low, high = done, done + size  # the suffix of length low matches; of length high does not
        while high - low > 1:
            middle = (low + high) // 2
            if a.startswith(view[lb - middle: lb - low], la - middle):
                low = middle
            else:
                high = middle
        return low
    return done


def parts_against(body: bytes, base_request_no: int, base: bytes) -> tuple[BodyPart, ...]:
    """``body`` as parts: what it shares with ``base`` (the body of request ``base_request_no``,
    stored earlier in the session) at its start and at its end as references, the rest as data."""
    prefix = common_prefix(body, base)
    if prefix < MIN_SHARED:
        prefix = 0
    suffix = common_suffix(body, base, min(len(body), len(base)) - prefix)
    if suffix < MIN_SHARED:
        suffix = 0
    if not prefix and not suffix:
        return literal(body)
    parts: list[BodyPart] = []
    if prefix:
        parts.append(BodyPart(request_no=base_request_no, start=0, length=prefix))
    middle = body[prefix: len(body) - suffix]
    if middle:
        parts.append(BodyPart(data=middle))
    if suffix:
        parts.append(BodyPart(request_no=base_request_no, start=len(base) - suffix, length=suffix))
    return tuple(parts)


MIN_RUN = 64  # an image text shorter than this is not looked for (a reference costs about 10 bytes)


def referencing(parts: tuple[BodyPart, ...], runs: dict[bytes, tuple[int, int]]) -> tuple[BodyPart, ...]:
    """``parts`` with each occurrence, in their data, of a known run (its bytes -> where an earlier request's body
    holds them: ``(request_no, start)``) made a reference to it. An agent that sends the same image again in a
    new message (a screenshot every turn) sends the same base64 text, which its first request stored: the new
    body stores a reference to it, not the text again."""
    if not runs:
        return parts
    out: list[BodyPart] = []
    for part in parts:
        out += _split(part, runs) if part.data and len(part.data) >= MIN_RUN else [part]
    return tuple(out)


def _split(part: BodyPart, runs: dict[bytes, tuple[int, int]]) -> list[BodyPart]:
    return _cut(part, runs, lambda run: BodyPart(request_no=runs[run][0], start=runs[run][1], length=len(run)))


def isolating(parts: tuple[BodyPart, ...], texts: Sequence[bytes]) -> tuple[BodyPart, ...]:
    """``parts`` with each occurrence, in their data, of one of ``texts`` (the base64 text of images a request is
    the first to send) made a data part of its own, so that the log's writer moves it to the object store
    (:func:`schemas.blobs.move_image_texts`): the log's messages hold its digest, not the image."""
    if not texts:
        return parts
    out: list[BodyPart] = []
    for part in parts:
        out += _cut(part, texts, lambda text: BodyPart(data=text)) if part.data and len(part.data) >= MIN_RUN \
            else [part]
    return tuple(out)


def _cut(part: BodyPart, runs: Iterable[bytes], make: Callable[[bytes], BodyPart]) -> list[BodyPart]:
    """``part`` cut around each occurrence in its data of one of ``runs`` (the first of overlapping ones), each
    occurrence the part ``make`` gives for it."""
    found: list[tuple[int, bytes]] = []
    data = part.data
    for run in runs:
        for at in occurrences(data, run):
            found.append((at, run))
    if not found:
        return [part]
    out: list[BodyPart] = []
    cut = 0
    for at, run in sorted(found):
        if at < cut:  # overlaps one taken already
            continue
        if at > cut:
            out.append(BodyPart(data=data[cut:at]))
        out.append(make(run))
        cut = at + len(run)
    if cut < len(data):
        out.append(BodyPart(data=data[cut:]))
    return out


def occurrences(data: bytes, run: bytes, head: int = 64) -> list[int]:
    """Where ``run`` occurs in ``data``, not overlapping: its first ``head`` bytes are looked for (a search for a
    megabyte-long needle would first preprocess all of it), each place found then checked whole."""
    found: list[int] = []
    key = run[:head]
    at = data.find(key)
    while at >= 0:
        if data.startswith(run, at):
            found.append(at)
            at = data.find(key, at + len(run))
        else:
            at = data.find(key, at + 1)
    return found


Span = tuple[bytes, int, int]  # (buffer, start, end)


class _Rope:
    """A body as spans over buffers the events already hold, with the offset where each span ends."""

    __slots__ = ("ends", "spans")

    def __init__(self, spans: list[Span]) -> None:
        self.spans = spans
        self.ends: list[int] = []
        total = 0
        for _, start, end in spans:
            total += end - start
            self.ends.append(total)

    @property
    def size(self) -> int:
        return self.ends[-1] if self.ends else 0

    def cut(self, start: int, length: int) -> list[Span]:
        """The spans of bytes ``[start, start + length)``."""
        if start < 0 or length < 0 or start + length > self.size:
            raise ValueError(f"bytes {start}..{start + length} of a body of {self.size}")
        out: list[Span] = []
        index = bisect_right(self.ends, start)
        position = self.ends[index - 1] if index else 0  # where span ``index`` begins in the body
        remaining = length
        while remaining > 0:
            buffer, lo, hi = self.spans[index]
            skip = start - position if start > position else 0
            take = min(hi - lo - skip, remaining)
            out.append((buffer, lo + skip, lo + skip + take))
            remaining -= take
            position += hi - lo
            index += 1
        return out

    def join(self) -> bytes:
        if len(self.spans) == 1 and self.spans[0][1] == 0 and self.spans[0][2] == len(self.spans[0][0]):
            return self.spans[0][0]
        return b"".join(memoryview(buffer)[lo:hi] for buffer, lo, hi in self.spans)


class Bodies:
    """The request bodies of one session, rebuilt from its ``request_received`` events in log order."""

    def __init__(self) -> None:
        self._ropes: dict[int, _Rope] = {}
        self._digests: dict[int, str] = {}

    def __contains__(self, request_no: object) -> bool:
        return request_no in self._ropes

    def __len__(self) -> int:
        return len(self._ropes)

    def add(self, event: RequestReceived) -> None:
        """Take a request's parts (every request it references must have been added before)."""
        spans: list[Span] = []
        for part in event.parts:
            if not part.request_no:
                if part.data:
                    spans.append((part.data, 0, len(part.data)))
                continue
            base = self._ropes.get(part.request_no)
            if base is None:
                raise FoldError(f"session {event.session_id}: request {event.request_no} refers to request "
                                f"{part.request_no}, which is not before it in the log")
            try:
                spans.extend(base.cut(part.start, part.length))
            except ValueError as exc:
                raise FoldError(f"session {event.session_id}: request {event.request_no} refers to {exc}") from exc
        rope = _Rope(spans)
        if rope.size != event.body_size:
            raise FoldError(f"session {event.session_id}: request {event.request_no}'s parts make {rope.size} "
                            f"bytes, its body had {event.body_size}")
        self._ropes[event.request_no] = rope
        self._digests[event.request_no] = event.body_digest

    def body(self, request_no: int) -> bytes:
        """The request's raw body, byte for byte as the agent sent it."""
        rope = self._ropes.get(request_no)
        if rope is None:
            raise KeyError(request_no)
        return rope.join()

    def verify(self, request_no: int) -> bool:
        """Whether the rebuilt body has the digest recorded when it was received."""
        return body_digest(self.body(request_no)) == self._digests[request_no]

    def request_numbers(self) -> Sequence[int]:
        return list(self._ropes)


def rebuild(events: Sequence[object]) -> Bodies:
    """Every request body of a session, from its events (any types; only requests are read)."""
    bodies = Bodies()
    for event in events:
        if type(event) is RequestReceived:
            bodies.add(event)
    return bodies
