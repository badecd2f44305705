"""An export of the log: what ``rollbus export`` writes and ``rollbus import`` reads.

A contract, kept here because an audit file outlives the code that wrote it. An archive is a
sequence of records, each tagged by ``kind``:

- one :class:`ArchiveHeader` first (format version, the stream it came from, when);
- per session, in stream order: the :class:`ArchivedPiece` values its next envelope keeps in
  the object store (``Rollbus-Blobs``), then that :class:`ArchivedEnvelope`: the message as the
  stream holds it (subject, headers, stream sequence, time, the MessagePack payload bytes,
  untouched), and, after its last envelope, its :class:`ArchivedMarker` when the materializer
  recorded one (the marker bucket's value as stored, so ``replay --verify`` of the import
  checks the records against what was materialized from the original).

Two encodings of the same records: JSON lines (:func:`to_json_line` / :func:`from_json_line`:
bytes are base64, as msgspec writes them), and Parquet with the one Arrow schema
:data:`ARCHIVE_SCHEMA` (binary columns; :func:`to_batch` / :func:`from_batch`). Pure: the files
are opened by the command.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import msgspec
import pyarrow as pa

from schemas.errors import ArchiveError

ARCHIVE_VERSION = 1


class ArchiveHeader(msgspec.Struct, frozen=True, kw_only=True, tag="archive", tag_field="kind"):
    version: int = ARCHIVE_VERSION
    stream: str  # the stream exported, and its subject prefix
    prefix: str
    exported_at: str  # ISO 8601, UTC
    selection: str  # "session <id>", "all" or "all since <ISO time>"


class ArchivedEnvelope(msgspec.Struct, frozen=True, kw_only=True, tag="envelope", tag_field="kind"):
    session_id: str
    subject: str
    headers: dict[str, str]
    stream_seq: int  # in the exported stream (an import gets its own)
    time: str  # when the exported stream stored it (ISO 8601, as JetStream reports it)
    data: bytes  # the payload, as stored


class ArchivedPiece(msgspec.Struct, frozen=True, kw_only=True, tag="piece", tag_field="kind"):
    session_id: str
    digest: bytes  # sha256 of data: the object store's name is <session_id>/<digest hex>
    data: bytes

    def check(self) -> None:
        if hashlib.sha256(self.data).digest() != self.digest:
            raise ArchiveError(f"session {self.session_id}: piece {self.digest.hex()[:16]} does not have its sha256")


class ArchivedMarker(msgspec.Struct, frozen=True, kw_only=True, tag="marker", tag_field="kind"):
    session_id: str
    data: bytes  # the markers bucket's value, as stored (schemas.records.MaterializedMarker in JSON)


ArchiveRecord = ArchiveHeader | ArchivedEnvelope | ArchivedPiece | ArchivedMarker

_json_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder(ArchiveRecord)


def to_json_line(record: ArchiveRecord) -> bytes:
    return _json_encoder.encode(record) + b"\n"


def from_json_line(line: bytes) -> ArchiveRecord:
    try:
        return _json_decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise ArchiveError(f"not an archive record: {exc}") from exc


ARCHIVE_SCHEMA = pa.schema(
    [
        pa.field("kind", pa.string(), nullable=False),
        pa.field("session_id", pa.string()),  # every kind but the header
        pa.field("subject", pa.string()),  # envelope
        pa.field("headers", pa.map_(pa.string(), pa.string())),  # envelope
        pa.field("stream_seq", pa.int64()),  # envelope
        pa.field("time", pa.string()),  # envelope
        pa.field("digest", pa.binary()),  # piece
        pa.field("data", pa.binary()),  # envelope, piece, marker; the header's JSON
    ],
    metadata={"rollbus.archive_version": str(ARCHIVE_VERSION)},
)


def to_batch(records: Sequence[ArchiveRecord]) -> pa.RecordBatch:
    """The records as one Arrow batch of :data:`ARCHIVE_SCHEMA`."""
    columns: dict[str, list[object]] = {field.name: [] for field in ARCHIVE_SCHEMA}
    for record in records:
        row: dict[str, object] = {"kind": record.__struct_config__.tag}
        if isinstance(record, ArchiveHeader):
            row["data"] = _json_encoder.encode(record)
        elif isinstance(record, ArchivedEnvelope):
            row.update(session_id=record.session_id, subject=record.subject, headers=list(record.headers.items()),
                       stream_seq=record.stream_seq, time=record.time, data=record.data)
        elif isinstance(record, ArchivedPiece):
            row.update(session_id=record.session_id, digest=record.digest, data=record.data)
        else:
            row.update(session_id=record.session_id, data=record.data)
        for name, values in columns.items():
            values.append(row.get(name))
    return pa.RecordBatch.from_pydict(columns, schema=ARCHIVE_SCHEMA)


def from_batch(batch: pa.RecordBatch) -> Iterator[ArchiveRecord]:
    """The records of a batch written by :func:`to_batch`."""
    if batch.schema.remove_metadata() != ARCHIVE_SCHEMA.remove_metadata():
        raise ArchiveError("not a rollbus archive (its Parquet schema differs)")
    for row in batch.to_pylist():
        yield _from_row(row)


def _from_row(row: dict[str, object]) -> ArchiveRecord:
    kind, data = row["kind"], row["data"]
    if not isinstance(data, bytes):
        raise ArchiveError(f"a {kind} row without data")
    session_id = str(row["session_id"])
    if kind == "archive":
        try:
            return msgspec.json.decode(data, type=ArchiveHeader)
        except msgspec.DecodeError as exc:
            raise ArchiveError(f"not an archive header: {exc}") from exc
    if kind == "envelope":
        headers = row["headers"]
        return ArchivedEnvelope(session_id=session_id, subject=str(row["subject"]),
                                headers=dict(headers) if isinstance(headers, list) else {},
                                stream_seq=int(str(row["stream_seq"])), time=str(row["time"]), data=data)
    if kind == "piece":
        digest = row["digest"]
        if not isinstance(digest, bytes):
            raise ArchiveError("a piece row without its digest")
        return ArchivedPiece(session_id=session_id, digest=digest, data=data)
    if kind == "marker":
        return ArchivedMarker(session_id=session_id, data=data)
    raise ArchiveError(f"unknown archive record kind {kind!r}")


def check_header(record: ArchiveRecord) -> ArchiveHeader:
    """The archive's first record, which must be a header of a version this code reads."""
    if not isinstance(record, ArchiveHeader):
        raise ArchiveError("not a rollbus archive (its first record is not an archive header)")
    if record.version > ARCHIVE_VERSION:
        raise ArchiveError(f"archive version {record.version} is newer than this rollbus reads ({ARCHIVE_VERSION})")
    return record
