"""The test suite under load: ``pytest`` run several times in a row while busy processes (``yes > /dev/null``)
hold the cores, each run's results compared test by test.

A test that passes on a quiet machine and fails beside busy ones waits on a timer its work may outlast: this
finds it. Each run writes a JUnit XML file (``--out``); the report gives each run's totals and time and every
test whose result differs between runs. Exits 1 on a failed or erroring test, or results that differ.

    python ops/chaos/loaded_suite.py [--burners 2] [--runs 2] [--out DIR] [-- PYTEST_ARGS ...]

Run it from the checkout to test, with its environment set as CI's (``.ci/run``: ``ROLLBUS_REQUIRE_AGENTS=1
ROLLBUS_REQUIRE_BROWSER=1``). Issue 26's acceptance: the whole suite, two burners, two runs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUTCOMES = ("failure", "error", "skipped")


def results(junit: Path) -> dict[str, str]:
    """Each test's outcome in a JUnit XML file (``passed``, ``failure``, ``error`` or ``skipped``), by its id."""
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        found = [child.tag for child in case if child.tag in OUTCOMES]
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = found[0] if found else "passed"
    return outcomes


def differing(runs: list[dict[str, str]]) -> list[str]:
    """The tests whose outcome is not the same in every run (a test missing from a run counts as differing)."""
    every = set().union(*runs)
    return sorted(test for test in every if len({run.get(test) for run in runs}) > 1)


def totals(run: dict[str, str]) -> str:
    counted = Counter(run.values())
    return ", ".join(f"{counted[kind]} {kind}" for kind in ("passed", *OUTCOMES) if counted[kind])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--burners", type=int, default=2, help="busy processes beside the runs [2]")
    parser.add_argument("--runs", type=int, default=2, help="runs, one after the other [2]")
    parser.add_argument("--out", type=Path, default=Path("loaded-suite"), help="where the JUnit files go")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    if args.burners < 0 or args.runs < 1:
        parser.exit(2, "loaded_suite: --burners must be 0 or more and --runs 1 or more\n")
    args.out.mkdir(parents=True, exist_ok=True)
    burners = [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(args.burners)]
    runs: list[dict[str, str]] = []
    try:
        for n in range(1, args.runs + 1):
            junit = args.out / f"run{n}.xml"
            started = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}",
                                   *args.pytest_args], check=False)
            minutes = (time.monotonic() - started) / 60
            runs.append(results(junit) if junit.exists() else {})
            print(f"run {n}: {totals(runs[-1]) or 'no results'} in {minutes:.1f} min (pytest exit {done.returncode}) "
                  f"beside {args.burners} busy processes", flush=True)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    changed = differing(runs)
    print(f"tests whose result differs between runs: {len(changed)}")
    for test in changed:
        print(f"  {test}: " + " / ".join(run.get(test, "missing") for run in runs))
    failed = any(outcome in ("failure", "error") for run in runs for outcome in run.values())
    return 1 if failed or changed or not all(runs) else 0


if __name__ == "__main__":
    sys.exit(main())
