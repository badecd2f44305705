"""The Parquet sink: a dataset of ``part-<batch>.parquet`` files under ``<data-dir>/trajectories/``.

One file per materialized batch (the records of many sessions, in row groups of up to
``row_group_rows``), all written with :data:`TRAJECTORY_SCHEMA`. A file's name is derived
from the ids of the sessions it holds, so the same batch always has the same name.

Exactly once, with the session markers as the commit record:

1. :meth:`stage` writes the batch to ``.<dir>-staging/part-<batch>.parquet`` (invisible to
   readers of the dataset), fsynced, with the markers it commits in its metadata
   (``rollbus.markers``);
2. the materializer writes those markers (each names the file);
3. :meth:`commit` renames the file into the dataset (atomic, then the directory fsynced).

After a crash, :meth:`staged` lists what was left in staging: a file some of whose
markers exist was committed (step 2 began after step 1 finished), so the materializer
writes its missing markers and commits it; a file with no marker is discarded, and its
sessions, never acknowledged, come back and are written again. A reader therefore sees
only whole batches, and every session in at most one file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from materializer.dataset import read_dataset
from materializer.padding import Padding, RecordTooLong, pad_records
from materializer.validation import bounded
from schemas.records import MaterializedMarker, TrajectoryRecord, records_to_table

MARKERS_METADATA = b"rollbus.markers"
_markers = msgspec.json.Decoder(list[MaterializedMarker])
# What records the schema cannot hold make building their table raise.
_DATA_ERRORS = (pa.ArrowException, ValueError, TypeError, OverflowError, UnicodeError, msgspec.EncodeError,
                RecordTooLong)


class StagedBatch(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    markers: list[MaterializedMarker]

    @property
    def session_ids(self) -> list[str]:
        return [m.session_id for m in self.markers]


def batch_name(session_ids: Iterable[str]) -> str:
    digest = hashlib.sha256("\n".join(sorted(session_ids)).encode()).hexdigest()[:24]
    return f"part-{digest}.parquet"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ParquetSink:
    name = "parquet"

    def __init__(self, directory: Path, *, padding: Padding | None = None, row_group_rows: int = 1024) -> None:
        self.directory = directory
        self.staging = directory.parent / f".{directory.name}-staging"
        self.padding = padding
        self.row_group_rows = row_group_rows
        directory.mkdir(parents=True, exist_ok=True)
        self.staging.mkdir(parents=True, exist_ok=True)

    def table(self, records: list[TrajectoryRecord]) -> pa.Table:
        """The records as they are stored: unpadded, or padded when the sink pads."""
        if self.padding is None:
            return records_to_table(records)
        return records_to_table(records, pad_records(records, self.padding), msgspec.structs.asdict(self.padding))

    def fit(self, groups: Sequence[Sequence[TrajectoryRecord]]) -> tuple[pa.Table | None, dict[int, str]]:
        """One table of the groups' records (a group: one session's), and the groups it cannot hold, by
        index, with why: built at once, and only when that fails, group by group (None: no group fits)."""
        try:
            return self.table([r for group in groups for r in group]), {}
        except _DATA_ERRORS:
            pass
        tables: list[pa.Table] = []
        refused: dict[int, str] = {}
        for index, group in enumerate(groups):
            try:
                tables.append(self.table(list(group)))
            except _DATA_ERRORS as exc:
                refused[index] = bounded(f"{type(exc).__name__}: {exc}")
        return (pa.concat_tables(tables) if tables else None), refused

    def stage(self, records: list[TrajectoryRecord], markers: list[MaterializedMarker], *,
              table: pa.Table | None = None) -> StagedBatch:
        """Write a batch into staging; ``markers`` (one per session in ``records``) get the file's name.
        ``table``: the records' table already built (:meth:`fit`)."""
        name = batch_name(m.session_id for m in markers)
        markers = [msgspec.structs.replace(m, parquet_file=name) for m in markers]
        table = table if table is not None else self.table(records)
        meta = {**(table.schema.metadata or {}), MARKERS_METADATA: msgspec.json.encode(markers)}
        table = table.replace_schema_metadata(meta)
        tmp = self.staging / f".{name}.tmp"
        with tmp.open("wb") as f:
            pq.write_table(table, f, compression="zstd", row_group_size=self.row_group_rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.staging / name)
        _fsync_dir(self.staging)
        return StagedBatch(name=name, markers=markers)

    def commit(self, name: str) -> Path:
        """Move a staged batch into the dataset (idempotent: a batch already moved stays)."""
        target = self.directory / name
        source = self.staging / name
        if source.exists():
            os.replace(source, target)
            _fsync_dir(self.directory)
        return target

    def discard(self, name: str) -> None:
        (self.staging / name).unlink(missing_ok=True)

    def staged(self) -> list[StagedBatch]:
        """Batches left in staging by a process that stopped between stage and commit."""
        for tmp in self.staging.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)  # a write cut short: no marker can name it
        found = []
        for path in sorted(self.staging.glob("part-*.parquet")):
            try:
                meta = pq.read_schema(path).metadata or {}
                markers = _markers.decode(meta[MARKERS_METADATA])
            except (OSError, pa.ArrowException, KeyError, msgspec.DecodeError):
                markers = []
            found.append(StagedBatch(name=path.name, markers=markers))
        return found

    def read(self, columns: list[str] | None = None) -> pa.Table:
        """The committed dataset as one table (empty with the schema when nothing is committed)."""
        return read_dataset(self.directory, columns)
