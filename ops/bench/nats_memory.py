"""nats-server memory per stored token: the unbounded server against the bounded one, in one run.

For each configuration, a private nats-server (``stack.nats_server.EmbeddedNats``) in a
temporary directory gets a stream like rollbus's log (file storage, limits retention, the
log's duplicate window, direct gets; subjects ``bench.>``). Sessions are written the way
concurrent rollouts write them: ``--concurrent`` sessions at a time (by default all of
them, like one training step's batch of rollouts), each appending its ``--messages``
messages (``bench.<session>.<kind>``, ``--size`` random bytes, a message id each) in turn
with the others, so a session's messages lie in many blocks. Every session is then read
back once with an ordered consumer filtered on ``bench.<session>.>`` (``--readers`` at a
time), and the server is left idle for ``--idle`` seconds. About 2.5 minutes on 2 cores.

It reports the server's RSS (``VmRSS``) before writing, after writing, after reading, at
its peak (sampled every 0.1 s) and after the idle wait, and the growth over "before" per
stored token, counting ``--size`` bytes as ``--size / 4`` tokens (8 KB: 2,000 tokens).

``unbounded`` is the command ``EmbeddedNats`` ran before the memory bound (no GOMEMLIMIT),
``bounded`` is its default now (``GOMEMLIMIT=DEFAULT_MEMORY_LIMIT``), or ``--memory-limit``.

    python ops/bench/nats_memory.py [--sessions 2000] [--messages 20] [--size 8192] [--idle 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nats
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from schemas.log import HDR_MSG_ID, LogConfig
from stack.nats_server import DEFAULT_MEMORY_LIMIT, ENV_GO_MEMORY_LIMIT, EmbeddedNats

STREAM = "BENCH"
KINDS = ("opened", "request", "chain", "context", "tokens", "turn")
BYTES_PER_TOKEN = 4
MiB = 1024 * 1024


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def varz(server: EmbeddedNats) -> dict[str, object]:
    with urllib.request.urlopen(f"{server.monitoring_url}/varz", timeout=5) as response:
        return json.load(response)


@dataclass
class Result:
    name: str
    gomemlimit: int | None
    tokens: int
    rss: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def per_token(self, phase: str) -> float:
        return (self.rss[phase] - self.rss["before"]) / self.tokens


class PeakSampler:
    """The highest RSS seen, sampled every ``interval_s`` while running."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak = rss_bytes(pid)
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes(self.pid))
            await asyncio.sleep(self.interval_s)

    def __enter__(self) -> PeakSampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        self.peak = max(self.peak, rss_bytes(self.pid))


def session_ids(count: int) -> list[str]:
    return [f"{index:032x}" for index in range(count)]


def kind(message: int, messages: int) -> str:
    return "finalized" if message == messages - 1 else KINDS[message % len(KINDS)]


async def write(js: JetStreamContext, args: argparse.Namespace, pool: bytes) -> None:
    rng = random.Random(0)
    sessions = session_ids(args.sessions)
    for start in range(0, len(sessions), args.concurrent):
        group = sessions[start:start + args.concurrent]
        for message in range(args.messages):
            for session in group:
                offset = rng.randrange(len(pool) - args.size)
                await js.publish_async(f"bench.{session}.{kind(message, args.messages)}",
                                       pool[offset:offset + args.size], wait_stall=10.0,
                                       headers={HDR_MSG_ID: f"{session}:{message}"})
        await js.publish_async_completed()


async def read_session(js: JetStreamContext, session: str, messages: int) -> None:
    """All of a session's messages through an ordered consumer, as rollbus's reader does. The consumer
    is deleted at once: an unsubscribed one would otherwise linger ~5 s, and nats-server 2.15 allows
    1,000 consumers per stream (``default_max_consumers``), fewer than the readers leave behind."""
    sub = await js.subscribe(f"bench.{session}.>", stream=STREAM, ordered_consumer=True)
    try:
        for _ in range(messages):
            await sub.next_msg(timeout=10.0)
    finally:
        await sub.unsubscribe()
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(STREAM, sub._consumer)


async def read(js: JetStreamContext, args: argparse.Namespace) -> None:
    queue = session_ids(args.sessions)

    async def reader() -> None:
        while queue:
            await read_session(js, queue.pop(), args.messages)

    await asyncio.gather(*(reader() for _ in range(args.readers)))


async def measure(name: str, memory_limit: int | None, args: argparse.Namespace, pool: bytes) -> Result:
    tokens = args.sessions * args.messages * args.size // BYTES_PER_TOKEN
    with tempfile.TemporaryDirectory(prefix="nats-memory-") as tmp, \
            EmbeddedNats(Path(tmp) / "nats", name=f"bench-{name}", memory_limit=memory_limit) as server:
        limit = varz(server).get("gomemlimit")
        result = Result(name, int(limit) if isinstance(limit, int) else None, tokens)
        nc = await nats.connect(server.url, name="nats-memory-bench")
        try:
            js = nc.jetstream(timeout=10.0)
            await js.add_stream(StreamConfig(
                name=STREAM, subjects=["bench.>"], storage=StorageType.FILE, retention=RetentionPolicy.LIMITS,
                duplicate_window=LogConfig().duplicate_window_s, allow_direct=True, max_msg_size=1024 * 1024))
            result.rss["before"] = rss_bytes(server.pid)
            with PeakSampler(server.pid) as sampler:
                t0 = time.perf_counter()
                await write(js, args, pool)
                result.seconds["write"] = time.perf_counter() - t0
                result.rss["written"] = rss_bytes(server.pid)
                t0 = time.perf_counter()
                await read(js, args)
                result.seconds["read"] = time.perf_counter() - t0
                result.rss["read"] = rss_bytes(server.pid)
                await asyncio.sleep(args.idle)
                result.rss["idle"] = rss_bytes(server.pid)
            result.rss["peak"] = sampler.peak
        finally:
            await nc.close()
    return result


def report(results: list[Result], args: argparse.Namespace) -> None:
    stored = args.sessions * args.messages * args.size
    print(f"{args.sessions} sessions x {args.messages} messages x {args.size} B = {stored / MiB:.0f} MiB stored, "
          f"{results[0].tokens:,} tokens at {BYTES_PER_TOKEN} B/token; written {args.concurrent} sessions at a "
          f"time, read by {args.readers} ordered consumers at a time; idle wait {args.idle:g} s")
    phases = ("before", "written", "read", "peak", "idle")
    print(f"{'config':>10} {'GOMEMLIMIT':>11} {'write s':>7} {'read s':>6} "
          + " ".join(f"{phase + ' MiB':>11}" for phase in phases)
          + " " + " ".join(f"{phase + ' B/tok':>12}" for phase in phases[1:]))
    for r in results:
        limit = f"{r.gomemlimit / MiB:.0f} MiB" if r.gomemlimit else "none"
        print(f"{r.name:>10} {limit:>11} {r.seconds['write']:>7.1f} {r.seconds['read']:>6.1f} "
              + " ".join(f"{r.rss[phase] / MiB:>11.1f}" for phase in phases)
              + " " + " ".join(f"{r.per_token(phase):>12.2f}" for phase in phases[1:]))
    base, bounded = results
    print("bounded / unbounded RSS growth per token: "
          + ", ".join(f"{phase} {bounded.per_token(phase) / base.per_token(phase):.2f}x"
                      for phase in phases[1:] if base.per_token(phase) > 0)
          + " (target: growth <= 8 B/token, bounded by the limit, not by what is stored)")


async def run(args: argparse.Namespace) -> None:
    for inherited in (ENV_GO_MEMORY_LIMIT, "GOGC"):
        if os.environ.pop(inherited, None) is not None:
            print(f"(ignoring {inherited} from the environment: both servers get the Go runtime's defaults)")
    pool = random.Random(1).randbytes(4 * MiB)
    results = [await measure("unbounded", None, args, pool),
               await measure("bounded", args.memory_limit, args, pool)]
    report(results, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=2000)
    parser.add_argument("--messages", type=int, default=20, help="messages per session")
    parser.add_argument("--size", type=int, default=8192, help="bytes per message")
    parser.add_argument("--concurrent", type=int, default=2000, help="sessions written at a time")
    parser.add_argument("--readers", type=int, default=4, help="sessions read at a time")
    parser.add_argument("--idle", type=float, default=20.0, help="seconds idle after reading")
    parser.add_argument("--memory-limit", type=int, default=DEFAULT_MEMORY_LIMIT,
                        help="GOMEMLIMIT of the bounded server, in bytes (default: EmbeddedNats's)")
    args = parser.parse_args()
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
