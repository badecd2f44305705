"""The edge's engine client library: httpx (what ``edge/engines/http.py`` pools today) against httpx2 (the fork that
the official openai and anthropic SDKs bring, whose connection pool carries the fixes httpcore has not released):
the client's CPU a request with K requests in flight on one pooled client, configured as the edge's (256
connections, as many kept alive).

httpcore 1.0.9's pool, on every request and every answer, probes each idle connection's socket and, for each
idle connection, counts all of them again: its cost grows with the connections the pool holds, i.e. with K. A
burst test's driver on that pool spent 5 ms of CPU a request at K=64 (``rollbus/testing/burst.py``). The server
is ``_servers.py floor-asgi`` on granian, a process of its own (a fixed 1 KB JSON answer); the body sent is an
SGLang-sized ``/generate`` request (4,000 token ids). Rounds alternate the libraries' order; medians.

    python ops/bench/engine_pool.py [--ks 1,16,64] [--requests 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import httpx2
from edge_overhead import Server, free_port

LIBRARIES: dict[str, ModuleType] = {"httpx": httpx, "httpx2": httpx2}
BODY = json.dumps({"input_ids": list(range(1000, 5000)), "sampling_params": {"max_new_tokens": 512,
                                                                             "temperature": 1.0},
                   "return_logprob": True, "stream": False}).encode()


async def cpu_a_request(library: ModuleType, port: int, k: int, requests: int) -> tuple[float, float]:
    """(client CPU ms a request, requests/s) for ``requests`` POSTs, ``k`` in flight, on one pooled client."""
    limits = library.Limits(max_connections=256, max_keepalive_connections=256)
    async with library.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=30) as client:
        async def post() -> None:
            response = await client.post("/generate", content=BODY, headers={"content-type": "application/json"})
            if response.status_code != 200 or not response.content:
                raise RuntimeError(f"{library.__name__}: {response.status_code}")

        async def worker(count: int) -> None:
            for _ in range(count):
                await post()

        await asyncio.gather(*(worker(4) for _ in range(k)))  # warm: every connection opened
        shares = [requests // k + (i < requests % k) for i in range(k)]
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker(share) for share in shares))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return 1e3 * cpu / requests, requests / wall


async def measure(ks: list[int], requests: int, rounds: int) -> dict[tuple[str, int], list[tuple[float, float]]]:
    port = free_port()
    server = Server("floor-asgi", port, "nats://unused", None, extra=("--server", "granian"), quiet=True)
    runs: dict[tuple[str, int], list[tuple[float, float]]] = {(name, k): [] for name in LIBRARIES for k in ks}
    try:
        await server.wait_ready()
        for rnd in range(rounds):
            names = list(LIBRARIES) if rnd % 2 == 0 else list(LIBRARIES)[::-1]
            for k in ks:
                for name in names:
                    runs[(name, k)].append(await cpu_a_request(LIBRARIES[name], port, k, requests))
    finally:
        server.stop()
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="1,16,64", help="requests in flight [1,16,64]")
    parser.add_argument("--requests", type=int, default=3000, help="requests a run [3000]")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the libraries' order alternating [3]")
    args = parser.parse_args()
    try:
        ks = [int(k) for k in args.ks.split(",")]
        if min(ks) < 1 or args.requests < max(ks) or args.rounds < 1:
            raise ValueError
    except ValueError:
        parser.exit(2, f"engine_pool: --ks must be positive integers, --requests at least the largest K, "
                       f"--rounds at least 1 (got --ks {args.ks!r})\n")
    runs = asyncio.run(measure(ks, args.requests, args.rounds))
    print(f"httpx {httpx.__version__} against httpx2 {httpx2.__version__}; {args.requests} requests a run, "
          f"{args.rounds} rounds (medians); client CPU ms a request, requests/s")
    print(f"{'K':>4} {'httpx ms':>9} {'httpx2 ms':>10} {'httpx2/httpx':>13} {'httpx req/s':>12} {'httpx2 req/s':>13}")
    for k in ks:
        (old_ms, old_rate), (new_ms, new_rate) = (
            (statistics.median(r[0] for r in runs[(name, k)]), statistics.median(r[1] for r in runs[(name, k)]))
            for name in LIBRARIES)
        ratio = statistics.median(new[0] / old[0] for new, old in zip(runs[("httpx2", k)], runs[("httpx", k)],
                                                                       strict=True))
        print(f"{k:>4} {old_ms:>9.3f} {new_ms:>10.3f} {ratio:>12.2f}x {old_rate:>12.0f} {new_rate:>13.0f}")


if __name__ == "__main__":
    main()
