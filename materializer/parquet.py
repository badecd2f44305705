"""The Parquet sink: one file per session under ``<data-dir>/trajectories/``.

Writes are idempotent: a session's file is named by its id and replaced atomically
(temporary file, then ``os.replace``), so a redelivered session rewrites the same bytes
and a crash never leaves a half-written file where readers look.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from schemas.records import TrajectoryRecord, records_to_table


class ParquetSink:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def path_for(self, session_id: str) -> Path:
        return self.directory / f"{session_id}.parquet"

    def write(self, session_id: str, records: list[TrajectoryRecord]) -> Path | None:
        """Write a session's records (nothing for a session without trajectories)."""
        if not records:
            return None
        table = records_to_table(records)
        target = self.path_for(session_id)
        fd, tmp = tempfile.mkstemp(prefix=f".{session_id}.", suffix=".tmp", dir=self.directory)
        os.close(fd)
        try:
            pq.write_table(table, tmp, compression="zstd")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return target
