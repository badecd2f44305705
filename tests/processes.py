"""CLI components run as real subprocesses, for the tests that kill them."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


class CliProcess:
    """``python -m rollbus.cli *args`` as a real process, its output read line by line as it prints."""

    def __init__(self, args: Sequence[str]) -> None:
        self.name = f"rollbus {args[0]}"
        self.proc = subprocess.Popen([sys.executable, "-m", "rollbus.cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []

    def read_until(self, pattern: str, timeout: float = 60.0) -> str:
        """The first group of the first line matching ``pattern`` (the whole line if it has none)."""
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"{self.name} exited:\n" + "".join(self.lines))
            self.lines.append(line)
            if match := re.search(pattern, line):
                return match.group(1) if match.groups() else line
        raise AssertionError(f"no {pattern!r} in:\n" + "".join(self.lines))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        self.lines.append(out)
        return self.proc.returncode

    def started(self, *patterns: str, timeout: float = 180.0) -> list[str]:
        """:meth:`read_until` each of ``patterns`` in turn, within ``timeout`` seconds in all (a busy machine
        starts Ray and TransferQueue slowly); if one never comes, the process is stopped before the error is
        raised (SIGTERM, so that it shuts down the Ray it hosts; SIGKILL after 30 s), never left running
        beside the tests that follow (a ``rollbus up`` left so held its Ray and TransferQueue, and the next
        tests that started a Ray hung)."""
        deadline = time.monotonic() + timeout
        try:
            return [self.read_until(p, max(1.0, deadline - time.monotonic())) for p in patterns]
        except BaseException:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
            raise


class MaterializerProcess:
    """``rollbus materializer --nats URL --data-dir DIR *args``, its output in ``output``."""

    def __init__(self, nats_url: str, data_dir: Path, output: Path, args: Sequence[str]) -> None:
        self.output = output
        cmd = [sys.executable, "-m", "rollbus.cli", "materializer", "--nats", nats_url, "--data-dir", str(data_dir),
               "--batch-delay", "0.05", "--ack-wait", "2", *args]
        with self.output.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    async def ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while "rollbus materializer running" not in self.output.read_text():
            assert self.proc.poll() is None, self.output.read_text()
            assert time.monotonic() < deadline, self.output.read_text()
            await asyncio.sleep(0.1)

    def batches(self) -> int:
        """How many batches this process wrote (its log lines)."""
        return self.output.read_text().count("materialized ")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)
