"""The edge of several source trees against one HTTP floor, in the same run: did a change make a turn dearer?

Each tree (a directory holding a rollbus checkout, e.g. made by ``git worktree add /tmp/base <rev>``)
runs its own ``ops/bench/_servers.py edge`` on granian; the floor is this tree's. For each seed a
fresh floor and one edge per tree start side by side (pinned to CPU 0 on two cores or more, with that
``PYTHONHASHSEED``); each round runs the floor, then every edge (their order reversed every
other round), K sessions x 8 turns each, as ``edge_overhead.py`` does. Reported per K and tree:
the median over rounds of each round's edge/floor CPU a turn, with the middle half of the rounds
in brackets. A tree whose ``_servers.py`` predates a flag this one passes cannot be compared.

    python ops/bench/edge_ab.py DIR [DIR ...] [--ks 1,16] [--seeds 0,1] [--repeat 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from edge_overhead import Server, bodies, free_port, pin_load_generator, run_load

from stack.nats_server import EmbeddedNats

HERE = Path(__file__).resolve().parent


Ratios = dict[tuple[Path, int], list[float]]  # per tree and K: each round's edge/floor CPU a turn


async def measure(trees: list[Path], ks: list[int], seeds: list[int], repeat: int, cpu: int | None) -> Ratios:
    turn_bodies = bodies(8)
    ratios: Ratios = {(tree, k): [] for tree in trees for k in ks}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(Path(tmp) / "nats", name="bench") as nats:
        for seed in seeds:
            floor = Server("floor", free_port(), nats.url, cpu, seed, extra=("--server", "granian"))
            edges = {tree: Server("edge", free_port(), nats.url, cpu, seed, extra=("--server", "granian"), tree=tree)
                     for tree in trees}
            try:
                for started in (floor, *edges.values()):
                    await started.wait_ready()
                    await run_load(started, 4, turn_bodies, min_turns=64)  # warm up: lazy imports and caches
                for k in ks:
                    for rep in range(repeat):
                        base = await run_load(floor, k, turn_bodies)
                        for tree in trees if rep % 2 == 0 else trees[::-1]:
                            run = await run_load(edges[tree], k, turn_bodies)
                            ratios[(tree, k)].append(run["cpu_ms"] / base["cpu_ms"])
            finally:
                for started in (floor, *edges.values()):
                    started.stop()
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+", type=Path, help="directories holding a rollbus checkout each")
    parser.add_argument("--ks", default="1,16")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--repeat", type=int, default=4, help="rounds per K and seed")
    args = parser.parse_args()
    trees = [tree.resolve() for tree in args.trees]
    missing = [str(tree) for tree in trees if not (tree / "ops" / "bench" / "_servers.py").is_file()]
    if missing:
        parser.error(f"not a rollbus checkout (no ops/bench/_servers.py): {', '.join(missing)}")
    ks = [int(k) for k in args.ks.split(",")]
    server_cpu = pin_load_generator()
    ratios = asyncio.run(measure(trees, ks, [int(s) for s in args.seeds.split(",")], args.repeat,
                                 server_cpu))
    width = max(len(str(tree)) for tree in trees)
    print("edge/floor CPU a turn, the median of the rounds' own ratios (in brackets: the middle half of them); "
          f"the floor is {HERE.parents[1]}'s")
    for k in ks:
        for tree in trees:
            values = sorted(ratios[(tree, k)])
            quarter = len(values) // 4
            print(f"K={k:<3} {tree!s:>{width}}  {statistics.median(values):.2f}x "
                  f"[{values[quarter]:.2f}-{values[-quarter - 1]:.2f}]  ({len(values)} rounds)")


if __name__ == "__main__":
    main()
