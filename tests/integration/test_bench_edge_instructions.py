"""``ops/bench/edge_instructions.py`` runs end to end at its smallest size: the edge under callgrind serves every
turn, and the instructions it counted a turn are a plausible number, as are the floors' with ``--floors`` (checks the
benchmark works, not its numbers: docs/performance.md)."""

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
def test_the_instruction_count_benchmark_counts_the_edges_turns_and_the_floors_requests(tmp_path: Path) -> None:
    broken = tmp_path / "broken"  # a tree whose edge does not start (a commit mid-refactor): named, the rest counted
    (broken / "ops" / "bench").mkdir(parents=True)
    (broken / "ops" / "bench" / "_servers.py").write_text("raise SystemExit(1)\n")
    keep = tmp_path / "kept"
    done = subprocess.run([sys.executable, str(BENCH), str(ROOT), str(broken), "--turns", "16", "--floors", "--keep",
                           str(keep)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(rf"^\s+{re.escape(str(broken))}\s+did not start", done.stdout, re.MULTILINE), done.stdout
    assert (keep / "callgrind.0").stat().st_size > 0  # the edge's callgrind file, for callgrind_annotate
    row = re.search(r"^\s+\S+\s+([\d.]+) M\s+x1\.000$", done.stdout, re.MULTILINE)
    assert row is not None, done.stdout
    edge = float(row[1])
    assert 0.2 < edge < 20, done.stdout  # a turn is about 1.3 M instructions on this machine
    floors = {name: float(count) for name, count in re.findall(r"^\s+(floor\S*@\w+)\s+([\d.]+) M$", done.stdout,
                                                                re.MULTILINE)}
    assert set(floors) == {"floor@uvicorn", "floor@granian", "floor-asgi@uvicorn", "floor-asgi@granian"}, done.stdout
    # a framework's routing and request objects cost something over the plain callable on the same server; the edge's
    # turn (tokenizing, the log) more than the echo's request
    assert floors["floor-asgi@uvicorn"] < floors["floor@uvicorn"] < edge, done.stdout
    ratio = re.search(r"^\s+\S+\s+x([\d.]+)$", done.stdout.split("against the FastAPI echo")[1], re.MULTILINE)
    assert ratio is not None and float(ratio[1]) == pytest.approx(edge / floors["floor@uvicorn"], rel=0.02), done.stdout


def test_an_app_it_cannot_count_is_one_line_and_exit_2() -> None:
    done = subprocess.run([sys.executable, str(BENCH), str(ROOT), "--apps", "edge@hypercorn"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == ("edge_instructions: --apps: 'edge@hypercorn' is not KIND@SERVER (KIND: edge, "
                                   "edge-memlog, floor, floor-asgi; SERVER: granian, uvicorn)"), done.stderr
