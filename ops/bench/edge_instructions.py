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

    python ops/bench/edge_instructions.py TREE [TREE ...] [--k 1] [--turns 256]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from edge_overhead import Server, agent, bodies, free_port, open_sessions, run_load

from stack.nats_server import EmbeddedNats


class Counted(Server):
    """``tree``'s edge under callgrind, its instrumentation off until :meth:`count` turns it on."""

    def __init__(self, tree: Path, nats_url: str, out: Path) -> None:
        super().__init__("edge", free_port(), nats_url, None, 0, ("--server", "granian"), tree, quiet=True,
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


async def measure(trees: list[Path], k: int, turns: int) -> list[float]:
    counts = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(Path(tmp) / "nats", name="bench") as nats:
        for n, tree in enumerate(trees):
            edge = Counted(tree, nats.url, Path(tmp) / f"callgrind.{n}")
            await edge.wait_ready(timeout=600.0)  # (starting under valgrind takes a while)
            await run_load(edge, 4, bodies(8), min_turns=64)  # warm up (lazy imports, caches), not counted
            counts.append(await edge.count(k, turns))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", type=Path, help="source trees (the first is the baseline)")
    parser.add_argument("--k", type=int, default=1, help="concurrent agents [1]")
    parser.add_argument("--turns", type=int, default=256, help="turns counted per tree [256]")
    args = parser.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.exit(2, "edge_instructions: needs valgrind and callgrind_control (apt-get install valgrind)\n")
    counts = asyncio.run(measure([tree.resolve() for tree in args.trees], args.k, args.turns))
    print(f"edge instructions a turn (callgrind, K={args.k}, {args.turns} turns; every thread of the edge)")
    for tree, count in zip(args.trees, counts, strict=True):
        print(f"  {tree!s:40s} {count / 1e6:7.3f} M  x{count / counts[0]:.3f}")


if __name__ == "__main__":
    main()
