"""``ops/chaos/loaded_suite.py``: pytest run several times in a row beside busy processes, results compared test
by test (issue 26's "the full suite twice in a row beside two ``yes``"), here on a tiny suite of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ops" / "chaos" / "loaded_suite.py"

STEADY = """
def test_steady():
    assert True
"""
FLAKY = """
from pathlib import Path

def test_fails_every_other_run():
    runs = Path(__file__).with_name("runs")
    count = int(runs.read_text()) + 1 if runs.exists() else 1
    runs.write_text(str(count))
    assert count % 2 == 1
"""


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *args, "--", "-q", "-x",
                           str(tmp_path / "suite")], cwd=tmp_path, capture_output=True, text=True, timeout=300)


def _busy() -> int:
    """``yes`` processes running now."""
    return sum(1 for process in psutil.process_iter(["name"]) if process.info["name"] == "yes")


def test_the_same_results_twice_beside_a_busy_process_pass(tmp_path: Path) -> None:
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_steady.py").write_text(STEADY)
    before = _busy()
    done = _run(tmp_path, "--burners", "1", "--runs", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "run 1: 1 passed in " in done.stdout and "run 2: 1 passed in " in done.stdout
    assert "beside 1 busy processes" in done.stdout
    assert "tests whose result differs between runs: 0" in done.stdout
    assert (tmp_path / "out" / "run2.xml").exists()
    assert _busy() == before  # its busy process is gone with it


def test_a_test_that_passes_once_and_fails_once_is_named_and_exits_1(tmp_path: Path) -> None:
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_flaky.py").write_text(FLAKY)
    done = _run(tmp_path, "--burners", "0", "--runs", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "run 1: 1 passed in " in done.stdout and "run 2: 1 failure in " in done.stdout
    assert "tests whose result differs between runs: 1" in done.stdout
    assert "test_flaky::test_fails_every_other_run: passed / failure" in done.stdout


def test_no_run_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--runs", "0"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "loaded_suite: --burners must be 0 or more and --runs 1 or more"
