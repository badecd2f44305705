"""``ops/bench/edge_cores.py`` runs end to end at its smallest size: one ``rollbus up``-like process and two edges
beside a projector and a materializer each serve every turn, and every finalized session is one Parquet record
(checks the benchmark works, not its numbers: docs/performance.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "ops" / "bench" / "edge_cores.py"


def test_each_layout_serves_the_step_and_writes_a_record_a_session() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--ks", "2", "--sessions", "4", "--rounds", "1",
                           "--layouts", "up,apart:2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {m[1]: m for m in re.finditer(r"^\s+2\s+(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)/(\d+)$",
                                         done.stdout, re.MULTILINE)}
    assert set(rows) == {"up", "apart:2"}, done.stdout
    for row in rows.values():
        assert row[6] == row[7] == "4", done.stdout  # a record a session, none lost or doubled
        edge_cpu, all_cpu = float(row[4]), float(row[5])
        assert 0 < edge_cpu <= all_cpu, done.stdout  # the consumers' CPU is counted with the edges'
    assert re.search(r"^K=2\s+apart:2 / up\s+turns/s [\d.]+x\s+CPU a turn [\d.]+x$", done.stdout, re.MULTILINE), \
        done.stdout


def test_a_layout_it_does_not_know_is_one_line_and_exit_2() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--layouts", "up,apart:0"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "edge_cores: --layouts: 'apart:0' is not up, apart or apart:N (N >= 1 edge processes)"
