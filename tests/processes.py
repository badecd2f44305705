"""CLI components run as real subprocesses, for the tests that kill them."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil


class CliProcess:
    """``python -m rollbus.cli *args`` as a real process, its output read line by line as it prints, on a thread
    from its start until it exits: a wait for a line is bounded even when the process prints nothing, and a
    running process never stalls on a full pipe (64 KiB nobody read would stop ``rollbus up`` at its next log
    line)."""

    def __init__(self, args: Sequence[str]) -> None:
        self.name = f"rollbus {args[0]}"
        self.proc = subprocess.Popen([sys.executable, "-m", "rollbus.cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._seen = 0  # lines read_until has looked at
        self._eof = False
        self._printed = threading.Condition()
        self._follower = threading.Thread(target=self._follow, name=f"{self.name} output", daemon=True)
        self._follower.start()

    def _follow(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._printed:
                self.lines.append(line)
                self._printed.notify_all()
        with self._printed:
            self._eof = True
            self._printed.notify_all()

    def read_until(self, pattern: str, timeout: float = 60.0) -> str:
        """The first group of the first line not looked at yet that matches ``pattern`` (the whole line if it has
        no group), within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._printed:
            while True:
                for line in self.lines[self._seen:]:
                    self._seen += 1
                    if match := re.search(pattern, line):
                        return match.group(1) if match.groups() else line
                if self._eof:
                    raise AssertionError(f"{self.name} exited:\n" + "".join(self.lines))
                if (left := deadline - time.monotonic()) <= 0:
                    raise AssertionError(f"no {pattern!r} within {timeout:.0f} s in:\n" + "".join(self.lines))
                self._printed.wait(left)

    def started(self, *patterns: str, timeout: float = 180.0) -> list[str]:
        """:meth:`read_until` each of ``patterns`` in turn, within ``timeout`` seconds in all (a busy machine
        starts Ray and TransferQueue slowly). If one never comes, the process is stopped before the error is
        raised (SIGTERM, so that it shuts down the Ray it hosts; SIGKILL after 30 s), never left running
        beside the tests that follow (a ``rollbus up`` left so held its Ray and TransferQueue, and the next
        tests that started a Ray hung)."""
        deadline = time.monotonic() + timeout
        try:
            return [self.read_until(p, max(1.0, deadline - time.monotonic())) for p in patterns]
        except BaseException:
            self.stop(30)
            raise

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then its exit status; one that has not exited within ``timeout`` is killed (SIGKILL: -9),
        never left running."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self._ended(timeout)

    def kill(self) -> int:
        """SIGKILL, as a crash would end it."""
        self.proc.kill()
        return self._ended(30)

    def _ended(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.lines.append(f"[{self.name} did not exit within {timeout:.0f} s: killed]\n")
            self.proc.kill()
            self.proc.wait()
        self._follower.join(10)  # (a child that inherited the pipe may hold it open a little longer)
        return self.proc.returncode


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


def busiest_processes(top: int = 8, over: float = 1.0) -> str:
    """The machine's ``top`` busiest processes over ``over`` seconds, a line each (CPU %, resident MiB, age,
    command): what else ran when a test was slower than it should be."""
    procs = list(psutil.process_iter(["pid", "cmdline", "name", "create_time", "memory_info"]))
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.cpu_percent(None)
    time.sleep(over)
    rows = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            rows.append((proc.cpu_percent(None), proc))
    rows.sort(key=lambda row: row[0], reverse=True)
    now = time.time()
    lines = []
    for cpu, proc in rows[:top]:
        info = proc.info
        command = " ".join(info["cmdline"] or [info["name"] or "?"]).replace("\n", " ")
        rss = info["memory_info"].rss / 2**20 if info["memory_info"] is not None else 0.0
        lines.append(f"{cpu:6.1f}% {rss:8.0f} MiB {now - info['create_time']:7.0f} s  pid {info['pid']}  "
                     f"{command[:160]}\n")
    return "".join(lines)
