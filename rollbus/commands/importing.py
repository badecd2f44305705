"""``rollbus import``: an export (:mod:`schemas.archive`) republished into a log, idempotently.

Each session's envelopes go back in order under the target's subject prefix with the headers
rollbus writes (``Nats-Msg-Id``, ``Rollbus-Schema``, ``Rollbus-Seq``, ``Rollbus-Blobs``; the
expected-last-sequence pair is the target's own; anything else is dropped), each after the
pieces it needs and only once it decodes into events of its session; then the markers. A
session the target holds already is compared envelope by envelope (message id and payload):
what matches is skipped, what it lacks is appended, and a difference refuses the session (one
line on stderr, like a 409) and the exit status is 2. See :mod:`rollbus.commands.export`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.client import JetStreamContext

from eventlog.kv import KvStore
from eventlog.pieces import PieceStore
from eventlog.publisher import JetStreamLog
from eventlog.reader import iter_messages, last_stream_seq
from rollbus.commands.archive_io import CALL_TIMEOUT_S, Counts, piece_store, read_archive
from rollbus.progress import Progress, summary
from rollbus.tools import EXIT_ERROR, EXIT_OK, find_log, opened_log
from schemas import blobs, envelope
from schemas.archive import ArchivedEnvelope, ArchivedMarker, ArchivedPiece, ArchiveHeader
from schemas.errors import ArchiveError, FoldError, LogUnavailable, OwnershipLost, RevisionConflict, UserError
from schemas.events import SCHEMA_VERSION
from schemas.log import (
    HDR_BLOBS,
    HDR_EXPECTED_LAST_SUBJECT_SEQ,
    HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT,
    HDR_MSG_ID,
    HDR_SCHEMA,
    HDR_SEQ,
    SESSION_ID_RE,
    LogConfig,
)
from stack.provision import connect, provision
from stack.user_error import one_line

# What an import republishes of an envelope's headers (the expected-last-sequence pair is the target's;
# anything else, e.g. a Nats-Rollup in a crafted file, is dropped).
KEPT_HEADERS = frozenset({HDR_MSG_ID, HDR_SCHEMA, HDR_SEQ, HDR_BLOBS})
WIDTH = 64  # envelopes in flight at once, over different sessions (a session's go one after the other)


async def import_target(args: argparse.Namespace) -> int:
    """Into the log :func:`~rollbus.tools.find_log` finds (an embedded server's store is created when missing)."""
    place = await find_log(args, create=True)
    async with opened_log(place, name="rollbus-import") as url:
        return await _import_into(url, args)


async def _import_into(url: str, args: argparse.Namespace, cfg: LogConfig = LogConfig()) -> int:
    nc = await connect(url, name="rollbus-import")
    try:
        await provision(nc.jetstream(), cfg)
        return await import_main(nc, cfg, args)
    finally:
        await nc.close()


class _Target:
    """One session's place in the target log: what it already holds, compared with the archive as it comes."""

    def __init__(self, held: list[tuple[str, bytes]], last: int) -> None:
        self.held, self.last, self.position = held, last, 0
        self.refused = False


async def import_main(nc: Client, cfg: LogConfig, args: argparse.Namespace, *, width: int = WIDTH) -> int:
    js, writer = nc.jetstream(), JetStreamLog(nc, cfg, timeout=CALL_TIMEOUT_S)
    counts, targets = Counts(), dict[str, _Target]()
    pieces: list[ArchivedPiece] = []
    markers: list[ArchivedMarker] = []
    store = await piece_store(js, cfg)
    kv = await KvStore(js, cfg.markers_bucket, timeout=CALL_TIMEOUT_S).bind()
    lanes = _Lanes(width)

    async def envelope(record: ArchivedEnvelope, pieces: list[ArchivedPiece]) -> None:
        target = targets.get(record.session_id)
        if target is None:  # (the session's first envelope: the lane runs the next ones after it)
            target = targets[record.session_id] = await _target(js, cfg, record.session_id)
        await _import_envelope(writer, cfg, store, target, record, pieces, counts)
        progress.update(counts.envelopes + counts.skipped, detail=f"{len(targets)} sessions")

    try:
        records = read_archive(args.file)
        header = next(records)
        assert isinstance(header, ArchiveHeader)
        with Progress("import", unit="envelopes") as progress:
            for record in records:
                if isinstance(record, ArchivedPiece):
                    record.check()
                    pieces.append(record)
                elif isinstance(record, ArchivedEnvelope):
                    await lanes.add(record.session_id, functools.partial(envelope, record, pieces))
                    pieces = []
                elif isinstance(record, ArchivedMarker):
                    markers.append(record)
            await lanes.drain()
            for marker in markers:  # after every envelope: a marker names a session that is whole
                target = targets.get(marker.session_id)
                if target is not None and not target.refused:
                    counts.markers += await _import_marker(kv, marker)
    except ArchiveError as exc:
        raise UserError(str(exc)) from exc
    except NatsError as exc:  # a connection lost for good, a refused request: what is imported stays
        raise LogUnavailable(f"the import stopped: NATS failed ({exc!r}); run it again to finish it") from exc
    finally:
        await lanes.close()
        await writer.close()
    counts.sessions = len(targets)
    counts.conflicts = sum(t.refused for t in targets.values())
    print(f"imported {counts.sessions - counts.conflicts} sessions from {args.file} ({header.selection} of "
          f"{header.stream}, exported {header.exported_at}): {counts.envelopes} envelopes appended, "
          f"{counts.skipped} already held, {counts.markers} markers; {counts.conflicts} refused")
    summary("import", [("sessions", str(counts.sessions)), ("envelopes appended", str(counts.envelopes)),
                       ("already held", str(counts.skipped)), ("markers", str(counts.markers)),
                       ("refused", str(counts.conflicts))])
    return EXIT_ERROR if counts.conflicts else EXIT_OK


class _Lanes:
    """Sessions imported side by side, each in order: an envelope's work starts once its session's previous
    one is done, with at most ``width`` envelopes in flight. The first failure stops the rest and is raised
    by the next :meth:`add` or by :meth:`drain`."""

    def __init__(self, width: int) -> None:
        self._room = asyncio.Semaphore(width)
        self._tails: dict[str, asyncio.Task[None]] = {}  # each session's last envelope in flight
        self._failed: Exception | None = None

    async def add(self, session_id: str, work: Callable[[], Awaitable[None]]) -> None:
        self._raise()
        await self._room.acquire()
        previous = self._tails.get(session_id)
        self._tails[session_id] = asyncio.create_task(self._run(session_id, previous, work))

    async def _run(self, session_id: str, previous: asyncio.Task[None] | None,
                   work: Callable[[], Awaitable[None]]) -> None:
        try:
            if previous is not None:
                await previous  # (never raises: failures are kept in _failed)
            if self._failed is None:
                await work()
        except Exception as exc:
            self._failed = self._failed or exc
        finally:
            self._room.release()
            if self._tails.get(session_id) is asyncio.current_task():
                del self._tails[session_id]

    async def drain(self) -> None:
        await asyncio.gather(*self._tails.values())
        self._raise()

    async def close(self) -> None:
        for task in self._tails.values():
            task.cancel()
        await asyncio.gather(*self._tails.values(), return_exceptions=True)

    def _raise(self) -> None:
        if self._failed is not None:
            raise self._failed


async def _target(js: JetStreamContext, cfg: LogConfig, session_id: str) -> _Target:
    if not SESSION_ID_RE.fullmatch(session_id):
        raise ArchiveError(f"an envelope of a session id that is not subject-safe: {session_id[:80]!r}")
    subject = cfg.session_filter(session_id)
    last = await last_stream_seq(js, cfg, subject)
    held = [((msg.headers or {}).get(HDR_MSG_ID, ""), msg.data)
            async for _, msg in iter_messages(js, cfg, subject, last)]
    return _Target(held, last)


async def _import_envelope(writer: JetStreamLog, cfg: LogConfig, store: PieceStore, target: _Target,
                           record: ArchivedEnvelope, pieces: list[ArchivedPiece], counts: Counts) -> None:
    if target.refused:
        return
    msg_id = record.headers.get(HDR_MSG_ID, "")
    if target.position < len(target.held):
        held_id, held_data = target.held[target.position]
        target.position += 1
        if (held_id, held_data) == (msg_id, record.data):
            counts.skipped += 1
            return
        what = f"another payload under the same Nats-Msg-Id {msg_id}" if held_id == msg_id else \
            f"Nats-Msg-Id {held_id}, the export's {msg_id}"
        _refuse(target, record.session_id, f"the log holds a different event at its envelope {target.position} "
                                           f"({what})")
        return
    await _check_events(store, record, pieces)
    for piece in pieces:
        await store.put(piece.session_id, piece.digest, piece.data)
    headers = {name: value for name, value in record.headers.items() if name in KEPT_HEADERS}
    headers |= {HDR_EXPECTED_LAST_SUBJECT_SEQ: str(target.last),
                HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT: cfg.session_filter(record.session_id)}
    try:
        ack = await writer.publish(cfg.subject(record.session_id, _kind(record)), record.data, headers,
                                   session_id=record.session_id)
    except OwnershipLost:
        _refuse(target, record.session_id, "another writer appended to it during the import")
        return
    target.last = ack.seq
    counts.envelopes += 1


async def _check_events(store: PieceStore, record: ArchivedEnvelope, pieces: list[ArchivedPiece]) -> None:
    """Refuse an envelope that does not decode into events of its session (its pieces: the ones before it, else
    the ones an earlier envelope of the session restored)."""
    schema = int(record.headers.get(HDR_SCHEMA, SCHEMA_VERSION)) if record.headers.get(HDR_SCHEMA, "").isdigit() \
        else SCHEMA_VERSION
    try:
        if HDR_BLOBS not in record.headers:
            events = envelope.decode(record.data, schema)
        else:
            values = {piece.digest: piece.data for piece in pieces}
            for digest in blobs.references(record.data):
                if digest not in values:
                    found = await store.get(record.session_id, digest)
                    if found is None:
                        raise ArchiveError(f"session {record.session_id}: envelope {record.stream_seq} does not "
                                           f"decode (piece {blobs.object_name(record.session_id, digest)} is in "
                                           "neither the file nor the log)")
                    values[digest] = found
            events = blobs.decode_with(record.data, values, schema)
    except (FoldError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ArchiveError(f"session {record.session_id}: envelope {record.stream_seq} does not decode ({exc})") \
            from exc
    if not events or any(event.session_id != record.session_id for event in events):
        raise ArchiveError(f"session {record.session_id}: envelope {record.stream_seq} holds no events of it")


def _kind(record: ArchivedEnvelope) -> str:
    """The subject's kind (``<prefix>.<session>.<kind>``): the import writes it under the target's prefix."""
    tokens = record.subject.split(".")
    if len(tokens) != 3 or tokens[1] != record.session_id or not tokens[2].isidentifier():
        raise ArchiveError(f"session {record.session_id}: an envelope's subject is not a log subject: "
                           f"{record.subject[:80]!r}")
    return tokens[2]


def _refuse(target: _Target, session_id: str, why: str) -> None:
    target.refused = True
    print(f"rollbus import: session {session_id} refused (409): {one_line(why)}; nothing more of it was imported",
          file=sys.stderr)


async def _import_marker(kv: KvStore, record: ArchivedMarker) -> int:
    """1 when the marker was stored; 0 when the target had it already (the same, or its own materializer's)."""
    try:
        await kv.create(record.session_id, record.data)
    except RevisionConflict:
        return 0
    return 1
