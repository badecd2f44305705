"""The append path's client cost: nats-py's ``js.publish`` against the alternatives, in the same run.

Every model turn waits for one JetStream acknowledgement, so what the client spends on an
acknowledged publish is spent on every turn. K concurrent writers (one session each, as the
edge's turns are) append envelopes of 2-8 KB with the headers the edge sends
(``Nats-Msg-Id``, the expected last subject sequence and its filter, the schema and the
sequence range), each waiting for its acknowledgement before the next, to a private
nats-server (file storage) through:

* ``js.publish``: nats-py's JetStream publish (the baseline);
* ``acked``: :class:`eventlog.acks.AckedPublisher`, nats-py's public ``Client`` API (one wildcard
  reply subscription, ``nc.publish`` with a reply subject, msgspec-decoded acks), when
  ``eventlog/acks.py`` is there;
* ``direct``: the former ``edge.nats_direct.DirectPublisher`` (a protocol client of our own),
  when ``edge/nats_direct.py`` is there: it was removed after this comparison; to measure it
  again, ``git show 41d31d8:edge/nats_direct.py > edge/nats_direct.py`` for the run (its
  ``AckWaits.fail_all`` is gone, so a publish pending when its connection drops is not failed).

Reported per variant and K: this process's CPU per append (``time.process_time``: every
thread of the client; the server is another process) and appends/s, medians over rounds,
with each variant's ratio to ``js.publish`` as the median of the rounds' own ratios (the
variants run back to back in each round, their order rotated, so a round's ratio compares
runs made moments apart). With two or more cores the server is pinned to CPU 0 and this
process to CPU 1. The client runs on uvloop, as ``rollbus`` does.

    python ops/bench/append_path.py [--ks 1,16,64] [--appends 3000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import uvloop
from nats.aio.client import Client

from schemas.log import (
    LogConfig,
    append_headers,
)
from stack.nats_server import EmbeddedNats
from stack.provision import connect, provision

Publish = Callable[[str, bytes, dict[str, str]], Awaitable[int]]  # -> the stored message's stream sequence
SIZES = (2048, 3072, 4096, 5120, 6144, 8192)  # envelope bytes, cycled


async def js_publish(nc: Client) -> tuple[Publish, Callable[[], Awaitable[None]]]:
    js = nc.jetstream()

    async def publish(subject: str, payload: bytes, headers: dict[str, str]) -> int:
        return (await js.publish(subject, payload, timeout=5.0, headers=headers)).seq

    return publish, _nothing


async def acked(nc: Client) -> tuple[Publish, Callable[[], Awaitable[None]]] | None:
    try:
        from eventlog.acks import AckedPublisher
    except ImportError:
        return None
    publisher = AckedPublisher(nc)

    async def publish(subject: str, payload: bytes, headers: dict[str, str]) -> int:
        return (await publisher.publish(subject, payload, headers, 5.0)).seq

    return publish, _nothing


async def direct(nc: Client) -> tuple[Publish, Callable[[], Awaitable[None]]] | None:
    try:
        from edge.nats_direct import direct_publisher  # type: ignore[import-not-found]
    except ImportError:
        return None
    publisher = direct_publisher(nc)
    if publisher is None:
        return None

    async def publish(subject: str, payload: bytes, headers: dict[str, str]) -> int:
        return (await publisher.publish(subject, payload, headers, 5.0)).seq

    return publish, publisher.close


async def _nothing() -> None:
    return None


VARIANTS = {"js.publish": js_publish, "acked": acked, "direct": direct}


def payloads(count: int) -> list[bytes]:
    """JSON-ish envelopes of the sizes in :data:`SIZES` (what they hold does not matter to NATS)."""
    rng = random.Random(0)
    alphabet = b'abcdefghijklmnopqrstuvwxyz0123456789 ,:"{}[]'
    return [bytes(rng.choices(alphabet, k=SIZES[i % len(SIZES)])) for i in range(count)]


async def writer(publish: Publish, cfg: LogConfig, bodies: list[bytes]) -> None:
    """One session's appends, each after the last one's acknowledgement, as the edge's turns are."""
    session_id = secrets.token_hex(16)
    subject, last = cfg.subject(session_id, "turn"), 0
    for seq, body in enumerate(bodies, 1):
        headers = append_headers(cfg, session_id, seq, seq, last, schema=1)
        last = await publish(subject, body, headers)


async def run(publish: Publish, cfg: LogConfig, k: int, bodies: list[bytes]) -> dict[str, float]:
    per = max(1, len(bodies) // k)
    cpu, started = time.process_time(), time.perf_counter()
    await asyncio.gather(*(writer(publish, cfg, bodies[i * per:(i + 1) * per]) for i in range(k)))
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    return {"appends_s": per * k / wall, "cpu_us": 1e6 * cpu / (per * k)}


Rounds = dict[int, list[dict[str, dict[str, float]]]]  # per K, per round: variant -> its run


async def measure(url: str, ks: list[int], appends: int, rounds: int) -> tuple[list[str], Rounds]:
    cfg = LogConfig()
    nc = await connect(url, name="bench-append")
    await provision(nc.jetstream(), cfg)
    made = {name: await make(nc) for name, make in VARIANTS.items()}
    variants = {name: v for name, v in made.items() if v is not None}
    names = list(variants)
    bodies = payloads(appends)
    try:
        for publish, _ in variants.values():  # warm up: lazy imports, subscriptions, connections
            await run(publish, cfg, 4, bodies[:400])
        results: Rounds = {k: [] for k in ks}
        for index in range(rounds):
            order = names[index % len(names):] + names[:index % len(names)]
            for k in ks:
                results[k].append({name: await run(variants[name][0], cfg, k, bodies) for name in order})
        return names, results
    finally:
        for _, close in variants.values():
            await close()
        await nc.close()


def report(names: list[str], results: Rounds, appends: int) -> None:
    n = len(next(iter(results.values())))
    print(f"{appends} appends per run of 2-8 KB envelopes with the edge's headers; {n} rounds; client CPU is "
          "this process's (time.process_time), the server is another process")
    print(f"{'K':>3} {'variant':>11} {'CPU us/append':>14} {'appends/s':>10} {'CPU vs js.publish':>18} "
          f"{'appends/s vs js.publish':>24}")
    for k, per_round in results.items():
        for name in names:
            cpu = statistics.median(r[name]["cpu_us"] for r in per_round)
            rate = statistics.median(r[name]["appends_s"] for r in per_round)
            cpu_ratio = _spread([r[name]["cpu_us"] / r["js.publish"]["cpu_us"] for r in per_round])
            rate_ratio = _spread([r[name]["appends_s"] / r["js.publish"]["appends_s"] for r in per_round])
            print(f"{k:>3} {name:>11} {cpu:>14.1f} {rate:>10.0f} {cpu_ratio:>18} {rate_ratio:>24}")
    print("ratios: the median of the rounds' own ratios [the lowest and highest round]")


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def pin(server_pid: int) -> None:
    """With two cores or more: the server on CPU 0 (every thread it has started), this process on CPU 1."""
    if len(os.sched_getaffinity(0)) >= 2:
        for task in os.listdir(f"/proc/{server_pid}/task"):
            os.sched_setaffinity(int(task), {0})
        os.sched_setaffinity(0, {1})


async def main(args: argparse.Namespace) -> None:
    ks = [int(k) for k in args.ks.split(",")]
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(Path(tmp) / "nats", name="bench-append") as nats:
        pin(nats.pid)
        names, results = await measure(nats.url, ks, args.appends, args.rounds)
    report(names, results, args.appends)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="1,16,64")
    parser.add_argument("--appends", type=int, default=3000, help="appends per run (split over the K writers)")
    parser.add_argument("--rounds", type=int, default=5)
    uvloop.run(main(parser.parse_args()))
