"""The edge's instructions per model turn, counted by valgrind: a measure of a change that a busy machine does not move.

``edge_ab.py`` times CPU, which another process on the machine (or a neighbour on a virtual machine's host)
moves by 10-20 % from one run to the next. This runs each tree's ``ops/bench/_servers.py edge`` (on granian,
against a private nats-server, as ``edge_overhead.py`` does) under ``valgrind --tool=callgrind`` with the
instrumentation off, warms it up, and counts the instructions of every thread of the edge while K agents run
their 8-turn tool conversations (``edge_overhead.bodies``); it prints instructions a turn for each tree and its
ratio to the first. Repeated runs of one tree agree within about 1 %; a machine busy with other work adds
about 2 % to both sides (the event loop wakes more often), so compare trees in one run. The edge runs about
50 times slower under valgrind: a timer (the heap keeper's every 5 s) lands in the window more often than
it would.

Used to find where the edge's CPU went between two commits (docs/performance.md); needs ``valgrind`` and
``callgrind_control`` (Debian: ``apt-get install valgrind``).

``--floors`` also counts, in the same run, the first tree's floors a request (the same agents' requests): the
FastAPI echo (``floor``) and a plain ASGI callable with the same replies (``floor-asgi``: the HTTP server
alone), each on uvicorn + httptools and on granian, and prints each tree's edge against the FastAPI echo on
uvicorn (issue 28's floor). Instructions are not CPU time: what a thread hop costs (granian's I/O thread
handing a request to the event loop and back: wake-ups, caches) is not counted, so a server's instructions
can be the fewer and its CPU time the more (``edge_overhead.py`` times them).

``--apps KIND@SERVER,...`` counts more of the first tree's apps the same way (``edge-memlog@granian``: the edge
on the in-memory log; ``edge@uvicorn``: the edge on uvicorn), each against the FastAPI echo too.

A tree from before granian (its ``_servers.py`` has no ``--server``) runs its edge as it was deployed, on its own HTTP
protocol; a tree whose edge does not start (a commit in the middle of a move) is named, and the others still counted.
Each tree's line is printed as soon as it is counted. ``--keep DIR`` keeps the callgrind files (``callgrind.N``, the
N-th app counted) for ``callgrind_annotate``: two trees' per-function counts show what a step added.

    python ops/bench/edge_instructions.py TREE [TREE ...] [--k 1] [--turns 256] [--floors] [--apps KIND@SERVER,...]
                                          [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _servers import KINDS, SERVERS
from edge_overhead import Server, agent, bodies, free_port, open_sessions, run_load

from stack.nats_server import EmbeddedNats

FLOORS = (("floor", "uvicorn"), ("floor", "granian"), ("floor-asgi", "uvicorn"), ("floor-asgi", "granian"))


def parse_apps(text: str) -> list[tuple[str, str]]:
    """``KIND@SERVER,...`` as ``(kind, server)`` pairs; ValueError names a pair it cannot use."""
    apps = []
    for item in filter(None, text.split(",")):
        kind, _, server = item.strip().partition("@")
        if kind not in KINDS or server not in SERVERS:
            raise ValueError(f"--apps: {item!r} is not KIND@SERVER (KIND: {', '.join(KINDS)}; "
                             f"SERVER: {', '.join(SERVERS)})")
        apps.append((kind, server))
    return apps


class Counted(Server):
    """``tree``'s ``kind`` of app (the edge by default) on ``server`` under callgrind, its instrumentation off until
    :meth:`count` turns it on."""

    def __init__(self, tree: Path, nats_url: str, out: Path, kind: str = "edge", server: str = "granian") -> None:
        # A tree from before granian (its edge on its own HTTP protocol) has no ``--server``: its edge runs as it did.
        choice = ("--server", server) if '"--server"' in (tree / "ops" / "bench" / "_servers.py").read_text() else ()
        super().__init__(kind, free_port(), nats_url, None, 0, choice, tree, quiet=True,
                         wrapper=("valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"))
        self.out = out

    def _instrument(self, on: bool) -> None:
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(self.proc.pid)], check=True,
                       stdout=subprocess.DEVNULL)

    async def count(self, k: int, turns: int) -> float:
        """Instructions a turn over ``turns`` turns (K concurrent agents), the sessions opened beforehand."""
        turn_bodies = bodies(8)
        waves = max(1, -(-turns // (k * len(turn_bodies))))
        sessions = await open_sessions(self.port, k * waves)
        latencies: list[float] = []
        self._instrument(True)
        for wave in range(waves):
            await asyncio.gather(*(agent(self.port, s, turn_bodies, latencies)
                                   for s in sessions[wave * k:(wave + 1) * k]))
        self._instrument(False)
        self.proc.terminate()
        self.proc.wait(120)
        found = re.search(r"^totals: (\d+)", self.out.read_text(), re.MULTILINE)
        if found is None:
            raise RuntimeError(f"no totals in {self.out}")
        return int(found[1]) / len(latencies)


async def measure(apps: list[tuple[Path, str, str]], k: int, turns: int,
                  counted: Callable[[list[float | None]], None], keep: Path | None = None) -> list[float | None]:
    """Instructions a turn of each ``(tree, kind, server)``, one after the other on one nats-server; ``counted(counts)``
    hears the counts so far after each is taken (``None``: that app did not start, the others are still counted);
    ``keep``: a folder the callgrind files are kept in (``callgrind.N``, N the app's place in ``apps``), for
    ``callgrind_annotate``."""
    counts: list[float | None] = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(Path(tmp) / "nats", name="bench") as nats:
        for n, (tree, kind, server) in enumerate(apps):
            app = Counted(tree, nats.url, (keep or Path(tmp)) / f"callgrind.{n}", kind, server)
            try:
                await app.wait_ready(timeout=600.0)  # (starting under valgrind takes a while)
            except RuntimeError:
                app.proc.kill()
                app.proc.wait()
                counts.append(None)
            else:
                await run_load(app, 4, bodies(8), min_turns=64)  # warm up (lazy imports, caches), not counted
                counts.append(await app.count(k, turns))
            counted(counts)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path, help="source trees (the first is the baseline)")
    parser.add_argument("--k", type=int, default=1, help="concurrent agents [1]")
    parser.add_argument("--turns", type=int, default=256, help="turns counted per tree [256]")
    parser.add_argument("--floors", action="store_true",
                        help="also count the first tree's floors (FastAPI echo, plain ASGI) on uvicorn and granian")
    parser.add_argument("--apps", default="", metavar="KIND@SERVER,...",
                        help=f"more of the first tree's apps to count (KIND: {', '.join(KINDS)}; SERVER: "
                             f"{', '.join(SERVERS)})")
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="keep the callgrind files in DIR (callgrind.N: the N-th app counted; callgrind_annotate)")
    args = parser.parse_args()
    try:
        more = parse_apps(args.apps)
    except ValueError as exc:
        parser.exit(2, f"edge_instructions: {exc}\n")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.exit(2, "edge_instructions: needs valgrind and callgrind_control (apt-get install valgrind)\n")
    trees = [tree.resolve() for tree in args.trees]
    missing = [str(tree) for tree in trees if not (tree / "ops" / "bench" / "_servers.py").is_file()]
    if missing:
        parser.exit(2, f"edge_instructions: no ops/bench/_servers.py in {', '.join(missing)}\n")
    floors = [(trees[0], kind, server) for kind, server in FLOORS] if args.floors else []
    others = [(trees[0], kind, server) for kind, server in more]
    apps = [*((tree, "edge", "granian") for tree in trees), *floors, *others]

    def counted(so_far: list[float | None]) -> None:
        """Each edge's line as soon as it is counted (a long bisection shows its progress and keeps what it has)."""
        n, count, base = len(so_far) - 1, so_far[-1], so_far[0]
        if n == 0:
            print(f"edge instructions a turn (callgrind, K={args.k}, {args.turns} turns; every thread of the edge)",
                  flush=True)
        if n < len(trees):
            shown = "did not start (run its ops/bench/_servers.py edge to see why)" if count is None \
                else f"{shown_m(count)}  {ratio_x(count, base, 3)}"  # the first tree's own line says x1.000
            print(f"  {args.trees[n]!s:40s} {shown}", flush=True)

    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    counts = asyncio.run(measure(apps, args.k, args.turns, counted, args.keep and args.keep.resolve()))
    edges, floor_counts = counts[:len(trees)], counts[len(trees):len(trees) + len(floors)]
    other_counts = counts[len(trees) + len(floors):]
    if floor_counts:
        print(f"the floors a request, the same agents' requests (of {args.trees[0]})")
        for (_, kind, server), count in zip(floors, floor_counts, strict=True):
            print(f"  {kind + '@' + server:40s} {shown_m(count)}")
        uvicorn_floor = floor_counts[0]
        print("each edge (on granian) against the FastAPI echo on uvicorn + httptools, in instructions")
        for tree, count in zip(args.trees, edges, strict=True):
            print(f"  {tree!s:40s} {ratio_x(count, uvicorn_floor)}")
    if other_counts:
        against_floor = ", against the FastAPI echo on uvicorn" if floors else ""
        print(f"more apps, instructions a request or turn (of {args.trees[0]}){against_floor}")
        for (_, kind, server), count in zip(others, other_counts, strict=True):
            against = f"  {ratio_x(count, floor_counts[0])}" if floors else ""
            print(f"  {kind + '@' + server:40s} {shown_m(count)}{against}")


def shown_m(count: float | None) -> str:
    return "did not start" if count is None else f"{count / 1e6:7.3f} M"


def ratio_x(count: float | None, base: float | None, digits: int = 2) -> str:
    return "-" if count is None or not base else f"x{count / base:.{digits}f}"


if __name__ == "__main__":
    main()
