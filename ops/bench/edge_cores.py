"""One rollbus stack against its parts in processes of their own, and against several edges: what the cores buy.

``rollbus up`` runs the edge, the session projector and the materializer on one event loop in one process. This
runs the same verl-like step (K agents at a time, each session 8 OpenAI-protocol turns with tools, the instant
engine of ``edge_overhead.py`` in the edge, every turn acknowledged by JetStream, each session finalized once its
turns are done) through each layout, on a private nats-server of its own:

- ``up``: one process, ``rollbus up``'s three components together;
- ``apart``: ``rollbus edge``, ``rollbus projector`` and ``rollbus materializer``, three processes;
- ``apart:N``: N edge processes (each its own port; a session lives on the edge that opened it, its
  URL naming that edge) beside one projector and one materializer.

For each layout and K it prints turns/s (the agents' turns and finalizes, wall clock), the edge processes' CPU a
turn (``up``'s one process: its consumers' share too) and all of the layout's processes' CPU a turn (the consumers
too, counted until they have written every session and gone quiet; nats-server and the load generator not counted),
the Parquet records written (each must be one a session), and each against ``up`` in the same round. Rounds alternate
the layouts' order; ratios are medians of the rounds' own. Nothing is pinned: the layouts differ in how many cores
they can use, which is the question. The load generator shares the machine, so on a machine of few cores it takes a
core the layouts could use.

    python ops/bench/edge_cores.py [--ks 16,64] [--layouts up,apart,apart:2] [--sessions 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pyarrow.parquet as pq
from _http import Connection
from edge_overhead import Server, agent, bodies, cpu_seconds, finalize_session, free_port, open_sessions

from stack.nats_server import EmbeddedNats

QUIET_S = 1.0  # the consumers have finished once their CPU grew by under QUIET_CPU_S in this long
QUIET_CPU_S = 0.01
SETTLE_TIMEOUT_S = 120.0


def parse_layout(text: str) -> int:
    """The number of edge processes of a layout (0: ``up``, all in one); ValueError names one it cannot use."""
    if text == "up":
        return 0
    name, _, count = text.partition(":")
    if name != "apart" or (count and (not count.isdigit() or int(count) < 1)):
        raise ValueError(f"--layouts: {text!r} is not up, apart or apart:N (N >= 1 edge processes)")
    return int(count or 1)


@dataclass
class Layout:
    """The processes of one layout, started on ``nats_url``; their data under ``data``."""

    name: str
    nats_url: str
    data: Path
    edges: list[Server] = field(default_factory=list)
    consumers: list[Server] = field(default_factory=list)

    @classmethod
    async def start(cls, name: str, nats_url: str, data: Path) -> Layout:
        layout = cls(name, nats_url, data)
        n = parse_layout(name)
        if n == 0:
            layout.edges.append(layout._stack("edge,projector,materializer", "up"))
        else:
            layout.edges += [layout._stack("edge", f"edge{i}") for i in range(n)]
            layout.consumers += [layout._stack("projector", "projector"), layout._stack("materializer", "mat")]
        for edge in layout.edges:
            await edge.wait_ready(timeout=120.0)
        return layout

    def _stack(self, components: str, label: str) -> Server:
        # The consumers listen on no port: theirs is only a name here.
        return Server("stack", free_port(), self.nats_url, None, 0,
                      ("--components", components, "--data-dir", str(self.data / label)), quiet=True)

    @property
    def processes(self) -> list[Server]:
        return self.edges + self.consumers

    def records(self) -> int:
        """Parquet records written (every data dir's ``trajectories``)."""
        return sum(pq.ParquetFile(path).metadata.num_rows for path in self.data.glob("*/trajectories/**/*.parquet"))

    def stop(self) -> None:
        for proc in self.processes:
            proc.stop()


async def agent_then_finalize(port: int, session: tuple[str, str], turn_bodies: list[bytes],
                              latencies: list[float]) -> None:
    await agent(port, session, turn_bodies, latencies)
    conn = await Connection.open("127.0.0.1", port)
    try:
        await finalize_session(conn, session[0])
    finally:
        await conn.close()


def total_cpu(servers: list[Server]) -> float:
    return sum(cpu_seconds(server.proc.pid) for server in servers)


async def settled(servers: list[Server]) -> float:
    """Wait until ``servers`` have gone quiet (their CPU grew by under QUIET_CPU_S in QUIET_S); their CPU then."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    before = total_cpu(servers)
    while time.monotonic() < deadline:
        await asyncio.sleep(QUIET_S)
        now = total_cpu(servers)
        if now - before < QUIET_CPU_S:
            return now
        before = now
    raise RuntimeError(f"the processes did not go quiet within {SETTLE_TIMEOUT_S:.0f} s")


async def written(layout: Layout, records: int) -> None:
    """Wait (up to SETTLE_TIMEOUT_S) until the layout has written ``records`` records in all: a pause of the
    consumers' CPU is not the end of their work (a batch may wait for its delay); the count is checked after."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        if layout.records() >= records:
            return
        await asyncio.sleep(0.1)


async def run_step(layout: Layout, k: int, sessions_n: int, turn_bodies: list[bytes]) -> dict[str, float]:
    """``sessions_n`` sessions, K at a time, spread over the layout's edges; each finalized after its turns."""
    ports = [edge.port for edge in layout.edges]
    per_edge = [[(port, session) for session in await open_sessions(port, len(range(i, sessions_n, len(ports))))]
                for i, port in enumerate(ports)]
    opened = [pair for turn in itertools.zip_longest(*per_edge) for pair in turn if pair is not None]  # edges alternate
    before_records = layout.records()
    await settled(layout.processes)
    edge_before, all_before = total_cpu(layout.edges), total_cpu(layout.processes)
    latencies: list[float] = []
    queue = iter(opened)

    async def worker() -> None:
        for port, session in queue:
            await agent_then_finalize(port, session, turn_bodies, latencies)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(k)))
    wall = time.perf_counter() - started
    edge_cpu = total_cpu(layout.edges) - edge_before
    await written(layout, before_records + len(opened))
    all_cpu = await settled(layout.processes) - all_before
    turns = len(latencies)
    return {"turns_s": turns / wall, "p50_ms": 1e3 * statistics.median(latencies),
            "edge_cpu_ms": 1e3 * edge_cpu / turns, "all_cpu_ms": 1e3 * all_cpu / turns,
            "records": layout.records() - before_records, "sessions": len(opened)}


async def measure(layouts: list[str], ks: list[int], sessions_n: int, rounds: int) -> dict[tuple[str, int], list]:
    turn_bodies = bodies(8)
    runs: dict[tuple[str, int], list[dict[str, float]]] = {(name, k): [] for name in layouts for k in ks}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(rounds):
            order = layouts if rnd % 2 == 0 else layouts[::-1]
            for n, name in enumerate(order):
                data = Path(tmp) / f"r{rnd}-{n}"
                with EmbeddedNats(data / "nats", name="bench") as nats:
                    layout = await Layout.start(name, nats.url, data)
                    try:
                        await run_step(layout, 4, 16, turn_bodies)  # warm up: lazy imports, caches
                        for k in ks:
                            run = await run_step(layout, k, sessions_n, turn_bodies)
                            runs[(name, k)].append(run)
                            print(json.dumps({"round": rnd, "layout": name, "k": k, **run}), file=sys.stderr,
                                  flush=True)
                    finally:
                        layout.stop()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="16,64", help="concurrent agents [16,64]")
    parser.add_argument("--layouts", default="up,apart,apart:2", help="up, apart, apart:N [up,apart,apart:2]")
    parser.add_argument("--sessions", type=int, default=64, help="sessions per run, 8 turns each [64]")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the layouts' order alternating [3]")
    args = parser.parse_args()
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    try:
        for name in layouts:
            parse_layout(name)
        ks = [int(k) for k in args.ks.split(",")]
    except ValueError as exc:
        parser.exit(2, f"edge_cores: {exc}\n")
    if "up" not in layouts:
        layouts.insert(0, "up")  # the baseline of every ratio
    runs = asyncio.run(measure(layouts, ks, args.sessions, args.rounds))
    print(f"{os.cpu_count()} cores; {args.sessions} sessions x 8 turns a run, K at a time, each finalized after its "
          f"turns; {args.rounds} rounds (medians)")
    print(f"{'K':>4} {'layout':>10} {'turns/s':>9} {'p50 ms':>8} {'edge CPU ms/turn':>17} {'all CPU ms/turn':>16} "
          f"{'records':>8}")
    for k in ks:
        for name in layouts:
            rows = runs[(name, k)]
            med = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
            print(f"{k:>4} {name:>10} {med['turns_s']:>9.0f} {med['p50_ms']:>8.2f} {med['edge_cpu_ms']:>17.3f} "
                  f"{med['all_cpu_ms']:>16.3f} {int(min(row['records'] for row in rows)):>5}/{int(med['sessions'])}")
    print("each layout against up, the same round (turns/s; all processes' CPU a turn), medians of the rounds' ratios")
    for k in ks:
        for name in layouts[1:]:
            pairs = list(zip(runs[(name, k)], runs[("up", k)], strict=True))
            speed = statistics.median(a["turns_s"] / b["turns_s"] for a, b in pairs)
            cpu = statistics.median(a["all_cpu_ms"] / b["all_cpu_ms"] for a, b in pairs)
            print(f"K={k:<4} {name:>10} / up   turns/s {speed:.2f}x   CPU a turn {cpu:.2f}x")
    lost = [(name, k) for (name, k), rows in runs.items() if any(row["records"] != row["sessions"] for row in rows)]
    if lost:
        print(f"records missing or doubled in {lost}")
        sys.exit(1)


if __name__ == "__main__":
    main()
