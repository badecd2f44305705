"""The Parquet sink: a dataset of ``part-<batch>.parquet`` files under ``<data-dir>/trajectories/``.

One file per materialized batch (the records of many sessions, in row groups of up to
``row_group_rows``), all written with :data:`TRAJECTORY_SCHEMA`. A file's name is derived
from the ids of the sessions it holds and the sink that staged it, so two sinks' copies of one
batch (two materializers that raced on it) never pass for one another.

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

Several materializer processes may share one ``--data-dir`` (they share the work of one
durable consumer, see :mod:`materializer.service`). Each sink stages in a directory of its
own, ``.<dir>-staging/<owner>/``, and holds an exclusive lock on it for as long as it lives: a
:mod:`filelock` lock (an ``flock``) on the file beside it, ``.<dir>-staging/<owner>.lock``, taken
before the directory is made. So no process's recovery ever discards another's batch in flight. A
staging directory nobody holds (its process died; the kernel released the lock) is adopted by the
next sink that lists what is staged: its batches move into the adopter's directory and are
committed or discarded there, and the directory and its lock file are removed. The lock files
live in staging only, never in the dataset. Two sinks that raced on one session (each staged it,
one marker won) are settled by :meth:`drop`: the loser's file loses those rows before it is
committed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from filelock import BaseFileLock, FileLock, Timeout

from materializer.dataset import read_dataset
from materializer.padding import Padding, pad_records
from materializer.validation import bounded
from schemas.errors import RecordTooLong
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


def batch_name(session_ids: Iterable[str], owner: str = "") -> str:
    """``owner``: the staging sink's id (a batch staged by another sink gets another name)."""
    digest = hashlib.sha256("\n".join(sorted(session_ids)).encode()).hexdigest()[:24]
    return f"part-{digest}-{owner[:12]}.parquet" if owner else f"part-{digest}.parquet"


LOCK_SUFFIX = ".lock"  # .<dir>-staging/<owner>.lock: held by the sink staging in .<dir>-staging/<owner>/


def _hold(directory: Path) -> BaseFileLock | None:
    """An exclusive lock on a staging directory (on its lock file, beside it), taken now or not at all;
    None if a live process holds it."""
    lock = FileLock(directory.with_name(directory.name + LOCK_SUFFIX), timeout=0, thread_local=False)
    try:
        lock.acquire()
    except Timeout:
        return None
    return lock


def _drop(lock: BaseFileLock) -> None:
    """Remove a held lock's file, then release it (a process that opened the file meanwhile finds, once it
    has the lock, that the file is gone, and does not count itself the holder)."""
    Path(lock.lock_file).unlink(missing_ok=True)
    lock.release()


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
        self.staging_root = directory.parent / f".{directory.name}-staging"
        self.owner = uuid.uuid4().hex
        self.staging = self.staging_root / self.owner  # this sink's own, locked while it lives
        self.padding = padding
        self.row_group_rows = row_group_rows
        directory.mkdir(parents=True, exist_ok=True)
        self.staging_root.mkdir(parents=True, exist_ok=True)
        lock = _hold(self.staging)  # before the directory exists: an adopter never sees it unheld
        if lock is None:  # cannot happen: the name is fresh
            raise OSError(f"{self.staging}: locked by another process")
        self.staging.mkdir()
        weakref.finalize(self, _drop, lock)  # released when the sink is collected, or by the kernel at exit

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
        name = batch_name((m.session_id for m in markers), self.owner)
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

    def drop(self, name: str, session_ids: set[str]) -> StagedBatch | None:
        """Rewrite a staged batch without these sessions' rows (another sink's markers won them); None when
        nothing is left (the file is discarded). The name stays: this batch's markers name it."""
        path = self.staging / name
        table = pq.read_table(path)
        meta = table.schema.metadata or {}
        markers = [m for m in _markers.decode(meta[MARKERS_METADATA]) if m.session_id not in session_ids]
        if not markers:
            self.discard(name)
            return None
        keep = pc.invert(pc.is_in(table.column("session_id"), value_set=pa.array(sorted(session_ids), pa.string())))
        table = table.filter(keep).replace_schema_metadata({**meta, MARKERS_METADATA: msgspec.json.encode(markers)})
        tmp = self.staging / f".{name}.tmp"
        with tmp.open("wb") as f:
            pq.write_table(table, f, compression="zstd", row_group_size=self.row_group_rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.staging)
        return StagedBatch(name=name, markers=markers)

    def adopt(self) -> int:
        """Move into this sink's staging the batches of staging directories nobody holds (their sinks'
        processes died) and of the flat layout of older versions; returns how many batches moved."""
        moved = 0
        for other in sorted(self.staging_root.iterdir()):
            if other == self.staging or not other.is_dir():
                continue
            lock = _hold(other)
            if lock is None:  # a live sink's
                continue
            try:
                for path in other.glob("part-*.parquet"):
                    os.replace(path, self.staging / path.name)
                    moved += 1
                shutil.rmtree(other, ignore_errors=True)
            finally:
                _drop(lock)
        for path in self.staging_root.glob(f"*{LOCK_SUFFIX}"):  # a sink's that died before its directory was made
            if not path.with_suffix("").exists() and (lock := _hold(path.with_suffix(""))) is not None:
                _drop(lock)
        for path in self.staging_root.glob("part-*.parquet"):  # staged by a version before per-sink staging
            with contextlib.suppress(FileNotFoundError):  # another sink adopted it first
                os.replace(path, self.staging / path.name)
                moved += 1
        if moved:
            _fsync_dir(self.staging)
        return moved

    def staged(self) -> list[StagedBatch]:
        """Batches left in staging by a process that stopped between stage and commit (this sink's, and
        those it adopted from dead sinks' staging directories)."""
        self.adopt()
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
