"""What ``--fsync always`` costs: the same load against JetStream's default sync and ``sync_interval: always``.

Two private nats-servers run side by side, their stores in one directory (``--dir``, so on
one disk): one with JetStream's default (files synced every 2 minutes; an acknowledged write
is in the page cache) and one with ``sync_interval: always`` (every write synced before its
acknowledgement), as ``rollbus up --fsync default|always`` starts them
(:class:`stack.nats_server.EmbeddedNats`). Against each, in every round (the order swapped
every round, so a round's ratio compares runs made moments apart):

* **appends**: K concurrent writers (one session each) append 2-8 KB envelopes with the edge's
  headers, each after the last one's acknowledgement, through the edge's publisher
  (:class:`eventlog.acks.AckedPublisher`): appends/s and the append latency (p50, p99);
* **turns**: the edge (``ops/bench/_servers.py edge``: the rollbus edge on granian with an instant
  in-process engine, so the log's cost is not hidden behind a model's) serving K concurrent agent
  loops of ``edge_overhead.py``'s turns, every turn's events acknowledged before the reply:
  turns/s and the turn latency (p50, p99).

Reported: medians over rounds, and always/default as the median of the rounds' own ratios
[lowest-highest round]. The store's filesystem is printed: fsync's cost is the disk's (a
tmpfs or a disk with a volatile write cache syncs at no cost, and then also protects nothing).

    python ops/bench/fsync_cost.py [--ks 1,16] [--rounds 3] [--appends 2000] [--turns 8] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import uvloop
from append_path import payloads
from edge_overhead import Server, bodies, free_port, run_load

from eventlog.acks import AckedPublisher
from schemas.log import LogConfig, append_headers
from stack.nats_server import EmbeddedNats, Fsync
from stack.provision import connect, provision

MODES: tuple[Fsync, ...] = ("default", "always")
Run = dict[str, float]


def filesystem(path: Path) -> str:
    """The mount (type, device) holding ``path``, from /proc/mounts."""
    best, found = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return found
    for line in mounts:
        device, point, kind, *_ = line.split()
        if str(path.resolve()).startswith(point) and len(point) > len(best):
            best, found = point, f"{kind} on {point} ({device})"
    return found


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _writer(publisher: AckedPublisher, cfg: LogConfig, envelopes: list[bytes], latencies: list[float]) -> None:
    session_id = secrets.token_hex(16)
    subject, last = cfg.subject(session_id, "turn"), 0
    for seq, body in enumerate(envelopes, 1):
        headers = append_headers(cfg, session_id, seq, seq, last, schema=1)
        started = time.perf_counter()
        last = (await publisher.publish(subject, body, headers, 10.0)).seq
        latencies.append(time.perf_counter() - started)


async def appends(url: str, k: int, envelopes: list[bytes]) -> Run:
    cfg = LogConfig()
    nc = await connect(url, name="bench-fsync")
    try:
        await provision(nc.jetstream(), cfg)
        publisher = AckedPublisher(nc)
        per = max(1, len(envelopes) // k)
        latencies: list[float] = []
        started = time.perf_counter()
        await asyncio.gather(*(_writer(publisher, cfg, envelopes[i * per:(i + 1) * per], latencies)
                               for i in range(k)))
        wall = time.perf_counter() - started
    finally:
        await nc.close()
    return {"rate": len(latencies) / wall, "p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * _quantile(latencies, 0.99)}


async def turns(server: Server, k: int, turn_bodies: list[bytes]) -> Run:
    run = await run_load(server, k, turn_bodies, min_turns=256)
    return {"rate": run["turns_s"], "p50_ms": run["p50_ms"], "p99_ms": run["p99_ms"]}


Rounds = dict[tuple[str, int], list[dict[str, Run]]]  # (what, K) -> per round: mode -> its run


async def measure(base: Path, ks: list[int], rounds: int, n_appends: int, n_turns: int) -> Rounds:
    results: Rounds = {(what, k): [] for what in ("appends", "turns") for k in ks}
    servers = {mode: EmbeddedNats(base / mode / "nats", name=f"bench-fsync-{mode}", fsync=mode).start()
               for mode in MODES}
    edges: dict[str, Server] = {}
    try:
        for mode, nats in servers.items():
            sync = nats.jetstream_config().get("sync_always", False)
            assert bool(sync) == (mode == "always"), f"{mode}: the server reports sync_always={sync}"
            edges[mode] = Server("edge", free_port(), nats.url, cpu=None)
        turn_bodies, envelopes = bodies(n_turns), payloads(n_appends)
        for mode in MODES:  # warm up: lazy imports, caches, connections
            await _ready(edges[mode])
            await run_load(edges[mode], 4, turn_bodies, min_turns=64)
            await appends(servers[mode].url, 4, envelopes[:400])
        for index in range(rounds):
            order = MODES if index % 2 == 0 else MODES[::-1]
            for k in ks:
                results[("appends", k)].append({m: await appends(servers[m].url, k, envelopes) for m in order})
                results[("turns", k)].append({m: await turns(edges[m], k, turn_bodies) for m in order})
    finally:
        for edge in edges.values():
            edge.stop()
        for nats in servers.values():
            nats.stop()
    return results


async def _ready(server: Server, timeout_s: float = 180.0) -> None:
    """Wait for the edge (its imports and tokenizer take a while on a busy machine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await server.wait_ready()
            return
        except RuntimeError:
            if server.proc.poll() is not None or time.monotonic() > deadline:
                raise


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def report(results: Rounds, base: Path, n_appends: int, n_turns: int) -> None:
    n = len(next(iter(results.values())))
    print(f"stores in {base}: {filesystem(base)}; {n} rounds, the modes' order swapped every round")
    print(f"appends: {n_appends} per run of 2-8 KB envelopes (the edge's publisher and headers); turns: the edge "
          f"with an instant engine, agent loops of {n_turns} turns, >= 256 turns per run")
    print(f"{'what':>8} {'K':>3} {'fsync':>8} {'per s':>9} {'p50 ms':>8} {'p99 ms':>8}   (medians over rounds)")
    for (what, k), per_round in results.items():
        for mode in MODES:
            row = {m: statistics.median(r[mode][m] for r in per_round) for m in ("rate", "p50_ms", "p99_ms")}
            print(f"{what:>8} {k:>3} {mode:>8} {row['rate']:>9.0f} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}")
    print("\nalways / default, the median of the rounds' own ratios [lowest-highest round]")
    for (what, k), per_round in results.items():
        rate = _spread([r["always"]["rate"] / r["default"]["rate"] for r in per_round])
        p50 = _spread([r["always"]["p50_ms"] / r["default"]["p50_ms"] for r in per_round])
        added = statistics.median(r["always"]["p50_ms"] - r["default"]["p50_ms"] for r in per_round)
        print(f"{what:>8} K={k:<3} {what}/s = {rate}   p50 latency = {p50} ({added:+.2f} ms)")


async def main(args: argparse.Namespace) -> None:
    ks = [int(k) for k in args.ks.split(",")]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="rollbus-fsync-") as tmp:
        base = Path(tmp)
        results = await measure(base, ks, args.rounds, args.appends, args.turns)
        report(results, base, args.appends, args.turns)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="1,16", help="concurrent sessions, comma-separated [1,16]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--appends", type=int, default=2000, help="appends per run, split over the K writers")
    parser.add_argument("--turns", type=int, default=8, help="turns per agent loop")
    parser.add_argument("--dir", default=os.environ.get("TMPDIR"), help="where the stores go [the temp dir]")
    uvloop.run(main(parser.parse_args()))
