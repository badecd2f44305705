"""``rollbus export`` and ``rollbus import``: the raw log, for long-term audit, and back.

::

    rollbus export SESSION_ID -o FILE           one session
    rollbus export --all [--since 7d|ISO] -o FILE  every session (with --since: every session that
                                                appended at or after then, each whole, from its start)
        [--format jsonl|parquet]                [the -o suffix: .parquet, else jsonl]
    rollbus import FILE [--nats URL | --data-dir DIR]

An export holds the envelopes as the stream stores them (subject, headers, stream sequence,
time, the payload bytes), the large pieces and the images they reference in the object store, and the
session's materializer marker (format: :mod:`schemas.archive`). An import republishes each
session's envelopes in order with their subjects and headers (``Nats-Msg-Id`` included; the
expected-last-sequence headers are the target stream's own), restores the pieces before the
envelopes that need them, and the markers, so ``rollbus replay --verify`` of an imported
session checks it against what was materialized from the original.

An import is idempotent: a session the target already holds is compared envelope by envelope
(message id and payload) and only what it lacks is appended, so importing twice stores nothing
twice. A session the target holds *differently* is refused (one line on stderr, like a 409) and
nothing more of it is written; the other sessions are imported, and the exit status is 2.

The import's target is ``--nats URL``, else the running ``rollbus up`` of ``--data-dir``, else
an embedded nats-server on ``<data-dir>/nats`` (created when missing: a fresh stream).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
from collections.abc import AsyncIterator
from typing import Any

from nats.errors import Error as NatsError
from nats.js.client import JetStreamContext

from eventlog.kv import KvStore
from eventlog.pieces import PieceStore
from eventlog.reader import iter_messages, last_stream_seq, next_message
from rollbus.commands.archive_io import (
    CALL_TIMEOUT_S,
    ArchiveWriter,
    Counts,
    check_archive,
    piece_store,
)
from rollbus.commands.importing import import_target
from rollbus.progress import Progress, rate_text, summary
from rollbus.tools import EXIT_OK, run_tool
from schemas import blobs
from schemas.archive import ArchivedEnvelope, ArchivedMarker, ArchivedPiece, ArchiveHeader
from schemas.errors import ArchiveError, IncompleteLog, LogUnavailable, UserError
from schemas.log import HDR_BLOBS, LogConfig, check_session_id
from stack.provision import bytes_text

# --- the command line ---------------------------------------------------------------------

def run_export(args: argparse.Namespace) -> int:
    if bool(args.session_id) == bool(args.all):
        raise UserError("name one SESSION_ID, or --all")
    if args.since is not None and not args.all:
        raise UserError("--since goes with --all")
    if args.session_id:
        check_session_id(args.session_id)
    if args.output.exists():
        raise UserError(f"-o {args.output} exists; choose a new file")
    if not args.output.parent.is_dir():
        raise UserError(f"-o {args.output}: no directory {args.output.parent}")
    return asyncio.run(run_tool(args, export_main))


def run_import(args: argparse.Namespace) -> int:
    if not args.file.is_file():
        raise UserError(f"{args.file}: no such file")
    try:  # a file that is no archive is refused before a log is opened (or an embedded store created)
        check_archive(args.file)
    except ArchiveError as exc:
        raise UserError(str(exc)) from exc
    return asyncio.run(import_target(args))


def _format(args: argparse.Namespace) -> str:
    return str(args.format or ("parquet" if args.output.suffix == ".parquet" else "jsonl"))


# --- exporting ----------------------------------------------------------------------------

async def export_main(js: JetStreamContext, cfg: LogConfig, args: argparse.Namespace) -> int:
    selection, sessions, start, last = await _selection(js, cfg, args)
    counts, fmt = Counts(), _format(args)
    partial = args.output.with_name(args.output.name + ".partial")
    header = ArchiveHeader(stream=cfg.stream, prefix=cfg.prefix, selection=selection,
                           exported_at=dt.datetime.now(dt.UTC).isoformat())
    partial.unlink(missing_ok=True)  # one an export killed earlier left
    try:
        with ArchiveWriter(partial, fmt) as write, Progress("export", unit="envelopes") as progress:
            write(header)
            exported = await _export_envelopes(js, cfg, sessions, start, last, write, counts, progress)
            for marker in [m async for m in _markers(js, cfg, exported)]:
                write(marker)
                counts.markers += 1
        partial.rename(args.output)
    except NatsError as exc:  # nothing is written then: the partial file goes
        raise LogUnavailable(f"the export stopped: NATS failed ({exc!r})") from exc
    except OSError as exc:  # a full disk, a directory gone
        raise UserError(f"-o {args.output}: cannot write it ({exc.strerror or exc})") from exc
    finally:
        partial.unlink(missing_ok=True)
    size = args.output.stat().st_size
    print(f"exported {counts.sessions} sessions ({counts.envelopes} envelopes, {counts.pieces} pieces, "
          f"{counts.markers} markers) to {args.output} ({fmt}, {bytes_text(size)}) in {progress.elapsed_s:.1f}s")
    summary("export", [("sessions", str(counts.sessions)), ("envelopes", str(counts.envelopes)),
                       ("pieces", f"{counts.pieces} ({bytes_text(counts.piece_bytes)})"),
                       ("markers", str(counts.markers)), ("file", f"{bytes_text(size)} {fmt}"),
                       ("rate", rate_text(counts.envelopes, progress.elapsed_s, "envelopes"))])
    return EXIT_OK


async def _selection(js: JetStreamContext, cfg: LogConfig, args: argparse.Namespace
                     ) -> tuple[str, set[str] | None, int, int]:
    """(what, the sessions to export or None for all, first stream seq to read, last)."""
    if args.session_id:
        last = await last_stream_seq(js, cfg, cfg.session_filter(args.session_id))
        if last == 0:
            raise UserError(f"no session {args.session_id} in the log")
        return f"session {args.session_id}", {args.session_id}, await _first_seq(js, cfg, args.session_id), last
    last = await last_stream_seq(js, cfg, cfg.subjects)
    if args.since is None:
        return "all", None, 1, last
    sessions: set[str] = set()
    async for _, msg in iter_messages(js, cfg, cfg.subjects, last, start=await _seq_at(js, cfg, args.since, last)):
        sessions.add(cfg.session_of(msg.subject))
    starts = [await _first_seq(js, cfg, session_id) for session_id in sorted(sessions)]
    return f"all since {args.since.isoformat()}", sessions, min(starts, default=last + 1), last


async def _get(js: JetStreamContext, cfg: LogConfig, seq: int, subject: str) -> tuple[int, dt.datetime] | None:
    """(seq, time) of the first message on ``subject`` at or after ``seq``; None when there is none."""
    found = await next_message(js, cfg, subject, seq, CALL_TIMEOUT_S)
    if found is None:
        return None
    return found.seq, dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(microseconds=found.time_ns // 1000)


async def _first_seq(js: JetStreamContext, cfg: LogConfig, session_id: str) -> int:
    found = await _get(js, cfg, 1, cfg.session_filter(session_id))
    return found[0] if found is not None else 1


async def _seq_at(js: JetStreamContext, cfg: LogConfig, when: dt.datetime, last: int) -> int:
    """The first stream seq stored at or after ``when`` (last + 1: none), by bisection (stream times only grow)."""
    low, high = 1, last + 1
    while low < high:
        middle = (low + high) // 2
        found = await _get(js, cfg, middle, cfg.subjects)
        if found is None or found[1] >= when:
            high = middle
        else:
            low = found[0] + 1
    return low


async def _export_envelopes(js: JetStreamContext, cfg: LogConfig, sessions: set[str] | None, start: int, last: int,
                            write: ArchiveWriter, counts: Counts, progress: Progress) -> list[str]:
    """Write the selected sessions' envelopes (each after its pieces); the sessions met, in order."""
    met: dict[str, None] = {}
    subject = cfg.session_filter(next(iter(sessions))) if sessions is not None and len(sessions) == 1 \
        else cfg.subjects
    store: PieceStore | None = None
    written: set[tuple[str, bytes]] = set()  # a piece goes once, before the first envelope that needs it
    async for seq, msg in iter_messages(js, cfg, subject, last, start=start):
        session_id = cfg.session_of(msg.subject)
        if sessions is not None and session_id not in sessions:
            continue
        headers = dict(msg.headers or {})
        digests = blobs.references(msg.data) if HDR_BLOBS in headers else []
        digests += [bytes.fromhex(image) for image in blobs.image_digests(msg.data)]  # images: pieces too
        if digests:
            for digest in digests:
                if (session_id, digest) in written:
                    continue
                written.add((session_id, digest))
                store = store or await piece_store(js, cfg)
                piece = await _piece(store, session_id, digest)
                write(piece)
                counts.pieces += 1
                counts.piece_bytes += len(piece.data)
        write(ArchivedEnvelope(session_id=session_id, subject=msg.subject, headers=headers, stream_seq=seq,
                               time=msg.timestamp.isoformat(), data=msg.data))
        counts.envelopes += 1
        met.setdefault(session_id)
        counts.sessions = len(met)
        progress.update(counts.envelopes, **_position(sessions, seq - start + 1, last - start + 1, counts))
    return list(met)


def _position(sessions: set[str] | None, read: int, of: int, counts: Counts) -> dict[str, Any]:
    """The progress's total and detail: every envelope read is exported with ``--all`` (the total is the range);
    of a selection only its own are, so the count is what was exported and the detail how far the log is read."""
    if sessions is None:
        return {"total": of, "detail": f"{counts.sessions} sessions"}
    return {"total": None, "detail": f"{counts.sessions} sessions, log {read}/{of} read"}


async def _piece(store: PieceStore, session_id: str, digest: bytes) -> ArchivedPiece:
    data = await store.get(session_id, digest)
    if data is None:
        name = blobs.object_name(session_id, digest)
        raise IncompleteLog(f"session {session_id}: piece {name} is missing from the object store")
    return ArchivedPiece(session_id=session_id, digest=digest, data=data)


async def _markers(js: JetStreamContext, cfg: LogConfig, sessions: list[str]) -> AsyncIterator[ArchivedMarker]:
    if not sessions:
        return
    markers = KvStore(js, cfg.markers_bucket, timeout=CALL_TIMEOUT_S)
    for session_id in sessions:
        found = await markers.get(session_id)
        if found is not None and found[0]:
            yield ArchivedMarker(session_id=session_id, data=found[0])
