"""Running an agent program as a subprocess, in its own install, with nothing but the given environment."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROGRAMS = Path(__file__).parent / "programs"
AGENT_TIMEOUT_S = 300


def run(command: Sequence[str | Path], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run an agent to its end; asserts it exits 0 (its output's tail in the message otherwise)."""
    done = subprocess.run([str(part) for part in command], env=env, cwd=cwd, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=AGENT_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"exit {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-3000:]}"
    return done


def run_python(python: Path, program: str, args: Sequence[str], env: dict[str, str], cwd: Path) -> Any:
    """Run one of :data:`PROGRAMS` with the agent's Python; the JSON its last line prints."""
    done = run([python, PROGRAMS / program, *args], env, cwd)
    return json.loads(done.stdout.strip().splitlines()[-1])
