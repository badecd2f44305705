"""The files of ``rollbus export`` / ``rollbus import`` (JSON lines or Parquet, :mod:`schemas.archive`),
and what both commands share: their counts and opening the log's buckets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import IO

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
from nats.js.client import JetStreamContext

from eventlog.pieces import PieceStore, open_pieces
from schemas.archive import (
    ArchiveHeader,
    ArchiveRecord,
    check_header,
    from_batch,
    from_json_line,
    to_batch,
    to_json_line,
)
from schemas.errors import ArchiveError, IncompleteLog
from schemas.log import LogConfig

CALL_TIMEOUT_S = 30.0
PARQUET_ROWS, PARQUET_BYTES = 4096, 64 << 20  # a row group holds at most this many rows, or about this many bytes


class Counts(msgspec.Struct, kw_only=True):
    sessions: int = 0
    envelopes: int = 0
    pieces: int = 0
    piece_bytes: int = 0
    markers: int = 0
    skipped: int = 0  # import: envelopes the target already held
    conflicts: int = 0  # import: sessions refused


async def piece_store(js: JetStreamContext, cfg: LogConfig) -> PieceStore:
    """The log's object store of pieces: :class:`IncompleteLog` when it has none."""
    store = await open_pieces(js, cfg, timeout=CALL_TIMEOUT_S)
    if store is None:
        raise IncompleteLog(f"the log has no object store {cfg.pieces_bucket}")
    return store


class ArchiveWriter:
    """Writes records to a file in one format; a context manager that closes it."""

    def __init__(self, path: Path, fmt: str) -> None:
        self._file: IO[bytes] | None = path.open("xb") if fmt == "jsonl" else None
        self._parquet = pq.ParquetWriter(str(path), to_batch([]).schema, compression="zstd") \
            if fmt == "parquet" else None
        self._rows: list[ArchiveRecord] = []
        self._bytes = 0

    def __call__(self, record: ArchiveRecord) -> None:
        if self._file is not None:
            self._file.write(to_json_line(record))
            return
        self._rows.append(record)
        self._bytes += len(getattr(record, "data", b""))
        if len(self._rows) >= PARQUET_ROWS or self._bytes >= PARQUET_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._parquet is not None and self._rows:
            self._parquet.write_batch(to_batch(self._rows))
        self._rows, self._bytes = [], 0

    def __enter__(self) -> ArchiveWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()
        if self._parquet is not None:
            self._flush()
            self._parquet.close()


def check_archive(path: Path) -> ArchiveHeader:
    """The header of the archive at ``path``: a file that cannot be an archive (missing, a directory, empty,
    truncated Parquet, a first record that is no header) raises :class:`ArchiveError` before any work."""
    try:
        return check_header(next(read_archive(path)))
    except OSError as exc:
        raise ArchiveError(f"{path}: cannot read it ({(exc.strerror or str(exc)).lower()})") from exc


def read_archive(path: Path) -> Iterator[ArchiveRecord]:
    """The records of an export, header first (checked), in either format (told apart by their first bytes)."""
    with path.open("rb") as file:
        parquet = file.read(4) == b"PAR1"
    records = _parquet_records(path) if parquet else _jsonl_records(path)
    first = next(records, None)
    if first is None:
        raise ArchiveError(f"{path} is empty")
    yield check_header(first)
    yield from records


def _jsonl_records(path: Path) -> Iterator[ArchiveRecord]:
    with path.open("rb") as file:
        for number, line in enumerate(file, 1):
            if line.strip():
                try:
                    yield from_json_line(line)
                except ArchiveError as exc:
                    raise ArchiveError(f"{path} line {number}: {exc}") from None


def _parquet_records(path: Path) -> Iterator[ArchiveRecord]:
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=256):
            yield from from_batch(batch)
    except (OSError, pa.ArrowException) as exc:  # not Parquet, truncated (no footer), a corrupt page
        raise ArchiveError(f"{path}: not a readable Parquet archive ({exc})") from exc
