"""How long the CLI takes to answer ``--help``, against ``python -c pass`` in the same run.

    python ops/bench/cli_start.py [--runs 9]

Each command runs ``--runs`` times in a fresh interpreter (the one running this script, so the same venv);
rounds interleave the commands so that load drifts fall on all of them alike. Prints each one's median
and spread in seconds and its ratio to ``python -c pass`` (the interpreter's own start).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "rollbus --help": [sys.executable, "-m", "rollbus.cli", "--help"],
    "rollbus sessions --help": [sys.executable, "-m", "rollbus.cli", "sessions", "--help"],
    "rollbus replay --help": [sys.executable, "-m", "rollbus.cli", "replay", "--help"],
    "rollbus up --help": [sys.executable, "-m", "rollbus.cli", "up", "--help"],
}


def _time(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} cores; {args.runs} runs each")
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for command in COMMANDS.values():
        _time(command)  # warm the page cache and the bytecode
    for _ in range(args.runs):
        for name, command in COMMANDS.items():
            times[name].append(_time(command))
    base = statistics.median(times["python -c pass"])
    print(f"{'command':<26} {'median s':>9} {'min-max s':>13} {'vs python -c pass':>18}")
    for name, taken in times.items():
        median = statistics.median(taken)
        print(f"{name:<26} {median:>9.3f} {min(taken):>6.3f}-{max(taken):<6.3f} {median / base:>17.1f}x")


if __name__ == "__main__":
    main()
