"""``ops/bench/edge_instructions.py`` runs end to end at its smallest size: the edge under callgrind serves every
turn, and the instructions it counted a turn are a plausible number (checks the benchmark works, not its numbers:
docs/performance.md)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "ops" / "bench" / "edge_instructions.py"


@pytest.mark.skipif(shutil.which("callgrind_control") is None, reason="valgrind is not installed")
def test_the_instruction_count_benchmark_counts_the_edges_turns() -> None:
    done = subprocess.run([sys.executable, str(BENCH), str(ROOT), "--turns", "16"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    row = re.search(r"^\s+\S+\s+([\d.]+) M\s+x1\.000$", done.stdout, re.MULTILINE)
    assert row is not None, done.stdout
    assert 0.2 < float(row[1]) < 20, done.stdout  # a turn is about 1.4 M instructions on this machine
