"""Installing a pinned agent program into a cache directory of its own, once.

``<cache>/<name>-<version>`` is a virtualenv (PyPI agents) or an npm prefix (npm agents). It is
used when its stamp file names exactly the pinned packages; otherwise it is installed anew, under a
file lock (two pytest processes install it once). The stamp, written last, also says how long the
install took. The cache is ``$ROLLBUS_AGENTS_CACHE``, else ``~/.cache/rollbus/agents``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.agents.pins import Pin

STAMP = "rollbus-pin.json"
INSTALL_TIMEOUT_S = 1200


class InstallFailed(Exception):
    """The agent could not be installed; the message says why."""


def cache_root() -> Path:
    return Path(os.environ.get("ROLLBUS_AGENTS_CACHE") or Path.home() / ".cache" / "rollbus" / "agents")


def installed(pin: Pin, root: Path) -> Path | None:
    """The agent's executable when its install is complete and of these packages, else ``None``."""
    directory = root / pin.key
    try:
        stamp = json.loads((directory / STAMP).read_text())
    except (OSError, ValueError):
        return None
    executable = directory / pin.executable
    return executable if stamp.get("packages") == list(pin.packages) and executable.exists() else None


def install(pin: Pin, root: Path) -> tuple[Path, float | None]:
    """The agent's executable, installed first if needed, and the seconds that took (``None``: cached)."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / f"{pin.key}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (found := installed(pin, root)) is not None:
            return found, None
        directory = root / pin.key
        shutil.rmtree(directory, ignore_errors=True)
        started = time.monotonic()
        for command in _commands(pin, directory):
            _run(command, pin)
        seconds = round(time.monotonic() - started, 1)
        (directory / STAMP).write_text(json.dumps({"packages": list(pin.packages), "install_s": seconds}))
        found = installed(pin, root)
        if found is None:
            raise InstallFailed(f"{pin.key}: installed, but {pin.executable} is not there")
        return found, seconds


def _commands(pin: Pin, directory: Path) -> list[list[str]]:
    if pin.registry == "npm":
        npm = shutil.which("npm")
        if npm is None:
            raise InstallFailed(f"{pin.key}: npm is not installed (Node.js is needed for it)")
        return [[npm, "install", "--prefix", str(directory), "--no-audit", "--no-fund", "--loglevel", "error",
                 *pin.packages]]
    python = str(directory / "bin" / "python")
    return [[sys.executable, "-m", "venv", str(directory)],
            [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *pin.packages]]


def _run(command: list[str], pin: Pin) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise InstallFailed(f"{pin.key}: {command[0]} took over {INSTALL_TIMEOUT_S} s") from exc
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "is ignored: it is neither" not in line]
        raise InstallFailed(f"{pin.key}: {' '.join(command[:3])} ... exited {done.returncode}: "
                            + " | ".join(errors[-5:]))
