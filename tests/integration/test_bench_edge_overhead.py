"""``ops/bench/edge_overhead.py`` runs end to end at its smallest size: every app it compares serves
every turn (a turn that fails stops the benchmark), and the report names them all.

This checks that the benchmark works, not its numbers: speed is read from its output by a person,
on a quiet machine (see docs/performance.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "ops" / "bench" / "edge_overhead.py"


def test_the_edge_benchmark_runs_the_floor_the_edge_and_the_edge_on_the_in_memory_log() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--ks", "1", "--turns", "4", "--repeat", "1", "--seeds", "0",
                           "--servers", "granian", "--memlog", "--stream"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for app in ("floor", "edge", "edge-memlog", "edge-stream"):
        row = re.search(rf"^\s+1\s+granian\s+{app}\s+(\d+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+([\d.]+)$", out,
                        re.MULTILINE)
        assert row is not None, f"no row for {app} in:\n{out}"
        assert int(row.group(1)) > 0 and float(row.group(2)) > 0
        assert float(row.group(3)) <= float(row.group(2)) + 0.05  # the kernel's part of it (clock ticks)
    assert re.search(r"^K=1\s+granian\s+CPU/turn = [\d.]+x", out, re.MULTILINE), out
    share = re.search(r"the append: (-?[\d.]+) ms a turn \((-?[\d.]+)x the floor's turn\), (-?[\d.]+) ms of it "
                      r"in the kernel", out)
    assert share is not None, out
    assert "edge-memlog@granian" in out
    streamed = re.search(r"^K=1\s+granian\s+CPU/turn = ([\d.]+)x \[.*\(target <= 1.5\)$", out, re.MULTILINE)
    assert streamed is not None and float(streamed.group(1)) > 0, out  # every streamed reply ended in [DONE]


def test_with_both_servers_the_edge_is_also_reported_against_the_uvicorn_floor() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--ks", "1", "--turns", "4", "--repeat", "1", "--seeds", "0",
                           "--servers", "granian,uvicorn"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for http in ("granian", "uvicorn"):
        for app in ("floor", "edge"):
            assert re.search(rf"^\s+1\s+{http}\s+{app}\s+\d+", out, re.MULTILINE), f"no {app}@{http} in:\n{out}"
    ratio = re.search(r"^K=1\s+edge@granian / floor@uvicorn  CPU/turn = ([\d.]+)x \[", out, re.MULTILINE)
    assert ratio is not None and float(ratio.group(1)) > 1.0, out  # the edge does more than echo
