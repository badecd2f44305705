"""``ops/bench/engine_pool.py`` runs end to end at its smallest size: both libraries post to a real server process
at each K and a row a K is printed (checks the benchmark works, not its numbers: edge/engines/http.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "ops" / "bench" / "engine_pool.py"


def test_each_library_serves_each_k_and_a_row_a_k_is_printed() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--ks", "1,4", "--requests", "40", "--rounds", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+(\d+)\s+(\d+)$", done.stdout, re.MULTILINE)
    assert [row[0] for row in rows] == ["1", "4"], done.stdout
    for _, old_ms, new_ms, ratio, old_rate, new_rate in rows:
        assert float(old_ms) > 0 and float(new_ms) > 0 and float(ratio) > 0, done.stdout
        assert int(old_rate) > 0 and int(new_rate) > 0, done.stdout


def test_a_k_larger_than_the_requests_is_one_line_and_exit_2() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--ks", "1,64", "--requests", "10"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("engine_pool: --ks must be positive integers") and \
        len(done.stderr.strip().splitlines()) == 1, done.stderr
