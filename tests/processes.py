"""CLI components run as real subprocesses, for the tests that kill them."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path


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
