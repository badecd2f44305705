"""Memory comes back: after big requests end and their sessions are finalized, the RSS of ``rollbus up``
returns near its baseline. Runs ``ops/bench/edge_memory.py --big-requests`` at a small size (two requests
of 1 MB of accented text, which the edge tokenizes on a worker thread before refusing it as too long:
with glibc's malloc as it is, that leaves the process ~1.8x its baseline)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "ops" / "bench" / "edge_memory.py"


@pytest.mark.slow
def test_rss_returns_near_its_baseline_after_big_requests() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--big-requests", "--requests", "2", "--mb", "1",
                           "--settle", "15"], capture_output=True, text=True, timeout=280)
    out = done.stdout
    turns = re.findall(r"request \d: 1\.0 MB -> 200 length", out)
    assert len(turns) == 2, out + done.stderr[-3000:]
    row = re.search(r"before\s+(\d+) MiB\s+peak\s+(\d+) MiB\s+after\s+(\d+) MiB\s+after/before ([\d.]+)x", out)
    assert row is not None, out
    before, peak, after = (int(row.group(i)) for i in (1, 2, 3))
    assert peak > before + 100, f"the requests did not load the edge: {out}"  # the tokenizer's work was there
    assert after <= 1.25 * before, out
    assert done.returncode == 0, out
