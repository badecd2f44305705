"""A verl step at training scale: sessions ending at once, and what it costs.

For each size, through one nats-server, ``rollbus edge`` (scripted SGLang engine) and ``rollbus projector``,
each a process of its own as in a scale-out deployment, a step of N sessions (:mod:`rollbus.testing.burst`:
``N/8`` prompts x 8, each a short tool-using conversation over the OpenAI wire, all finalized at once at the
end) is run in each mode, into TransferQueue hosted by this process (as verl's trainer hosts it) and Parquet:

- ``live``: ``rollbus materializer`` runs through the step: the time from the last finalize answered to
  the last session's records written (what the trainer waits after the step), and records/s from the
  first finalize (it only keeps pace with the finalizes);
- ``backlog``: ``rollbus materializer`` starts after the last finalize, with the whole step waiting (a
  restart after a crash): the time from its start to its "running" line (loading torch, joining Ray and
  TransferQueue), then from there to the last record, and records/s so: its full speed.

Each row also prints sessions/s of the step (opening and running every conversation) and the finalize
burst's wall time; records/s against a bare TransferQueue put of the same records (re-derived from the
log, fields built untimed, one ``kv_batch_put`` per 1,024) measured in the same run; the peak number of
consumers the NATS account held (a reader per session would show here); the peak RSS of the edge, the
materializer and nats-server; and lost, duplicated, quarantined and stray sessions (must all be 0), and
the requests the driver retried as an SDK would (429/5xx).

    python ops/bench/burst.py --sessions 4096,16384 [--modes backlog,live] [--concurrency 64] [--no-tq]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil

from edge.tokens.tokenizer import load_tokenizer
from eventlog.reader import load_state
from materializer.records import derive_records
from materializer.tq_fields import grouped
from rollbus.testing.burst import (
    Component,
    ConsumerPeak,
    Driver,
    Outcome,
    Step,
    outcome,
    tool_responder,
    wait_marked,
)
from rollbus.testing.scripted import ScriptedEngineServer
from schemas.log import LogConfig
from stack.nats_server import EmbeddedNats
from stack.provision import connect

PUT_BATCH = 1024


class RssPeak:
    """The peak resident memory of each named process, sampled every 0.2 s until stopped."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.peak = dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            for name, proc in self._procs.items():
                with contextlib.suppress(psutil.Error):
                    self.peak[name] = max(self.peak[name], proc.memory_info().rss)

    def stop(self) -> dict[str, float]:
        """The peaks, in MiB."""
        self._stop.set()
        self._thread.join()
        return {name: rss / 2**20 for name, rss in self.peak.items()}


def _host_transfer_queue() -> str:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback, as the sink sets it
    import ray
    import transfer_queue as tq

    from materializer.transfer_queue import RAY_HOSTED

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="rollbus-bench",
             _node_ip_address="127.0.0.1", **RAY_HOSTED)
    tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 2}}})
    return str(ray.get_runtime_context().gcs_address)


async def _bare_put(url: str, session_ids: list[str], partition: str) -> tuple[int, float]:
    """(records, seconds) of TransferQueue's own put of the step's records, fields built beforehand."""
    import transfer_queue as tq

    client = await connect(url, name="bench-burst")
    js, cfg = client.jetstream(), LogConfig()
    records = []
    for start in range(0, len(session_ids), 256):
        states = await asyncio.gather(*(load_state(js, cfg, sid) for sid in session_ids[start:start + 256]))
        records += [r for state, _ in states for r in derive_records(state)]
    await client.close()
    puts = [g for start in range(0, len(records), PUT_BATCH) for g in grouped(records[start:start + PUT_BATCH])]
    started = time.perf_counter()
    for keys, fields, tags in puts:
        await tq.async_kv_batch_put(keys=keys, partition_id=partition, fields=fields, tags=tags)
    return len(records), time.perf_counter() - started


async def _step(edge_url: str, nats: str, sessions: int, concurrency: int, prefix: str) -> tuple[Step, Driver, int]:
    driver = Driver(edge_url, "tok", concurrency=concurrency)
    async with ConsumerPeak(nats) as consumers:
        step = await driver.step(sessions, uid_prefix=prefix)
    return step, driver, consumers.peak


async def _written(nats: str, step: Step, timeout: float) -> tuple[dict[str, str], float, int]:
    async with ConsumerPeak(nats) as consumers:
        statuses, last_marked = await wait_marked(nats, step.session_ids, timeout=timeout)
    return statuses, last_marked, consumers.peak


def _phase(mode: str, sessions: int, edge: Component, server: EmbeddedNats, data: Path,
           materializer_args: list[str], concurrency: int) -> tuple[dict[str, object], Step]:
    """``live``: the materializer runs through the step (what a finalize waits for its records);
    ``backlog``: it starts after the last finalize, with the whole step waiting (its full speed)."""
    nats = server.url
    materializer_cmd = ["materializer", "--nats", nats, "--data-dir", str(data), *materializer_args]
    materializer = Component(*materializer_cmd) if mode == "live" else None
    pids = {"edge": edge.proc.pid, "nats": server.pid}
    rss = RssPeak({**pids, **({"materializer": materializer.proc.pid} if materializer else {})})
    step, driver, consumers = asyncio.run(_step(edge.url, nats, sessions, concurrency, f"{mode}{sessions}p"))
    spawned = time.monotonic()
    late = None
    if materializer is None:
        materializer = Component(*materializer_cmd)
        late = RssPeak({"materializer": materializer.proc.pid})
    ready = time.monotonic()
    try:
        statuses, last, drained = asyncio.run(_written(nats, step, timeout=max(600.0, sessions / 5)))
    finally:
        materializer.stop()
    peaks = {**rss.stop(), **(late.stop() if late is not None else {})}
    found: Outcome = outcome(data / "trajectories", step.session_ids, statuses)
    since = step.finalized_at if mode == "live" else ready
    first = step.finalized_at - step.finalize_s if mode == "live" else ready
    return {
        "mode": mode, "sessions": sessions, "sessions/s": sessions / step.ran_s, "finalize s": step.finalize_s,
        "startup s": ready - spawned if mode == "backlog" else 0.0,
        "to last record s": last - since, "records/s": sessions / (last - first),
        "peak consumers": max(consumers, drained), **{f"rss {k} MiB": v for k, v in peaks.items()},
        "lost": found.lost, "duplicated": found.duplicated, "quarantined": found.quarantined,
        "stray": found.stray, "retried": dict(driver.retried),
    }, step


def _size(sessions: int, engine_url: str, concurrency: int, ray_address: str | None,
          modes: list[str]) -> list[dict[str, object]]:
    """Each mode's step through one nats-server, edge and projector, each a process of its own."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="rollbus-burst-") as tmp, EmbeddedNats(Path(tmp) / "nats") as server:
        edge = Component("edge", "--nats", server.url, "--port", "0", "--data-dir", f"{tmp}/edge", "--admin-token",
                         "tok", "--engine", "sglang", "--engine-url", engine_url)
        projector = Component("projector", "--nats", server.url, "--data-dir", f"{tmp}/data", "--metrics-port", "off")
        try:
            for mode in modes:
                tq = [] if ray_address is None else ["--transfer-queue", "--ray-address", ray_address,
                                                     "--tq-partition", f"{mode}{sessions}"]
                row, step = _phase(mode, sessions, edge, server, Path(tmp) / mode, [*tq, "--metrics-port", "off"],
                                   concurrency)
                if ray_address is not None:
                    records, seconds = asyncio.run(_bare_put(server.url, step.session_ids, f"bare{mode}{sessions}"))
                    row["bare put records/s"] = records / seconds
                    row["ratio"] = float(row["records/s"]) / float(row["bare put records/s"])  # type: ignore[arg-type]
                rows.append(row)
                print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
        finally:
            projector.stop()
            edge.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", default="4096,16384", help="comma-separated step sizes [4096,16384]")
    parser.add_argument("--modes", default="backlog,live", help="comma-separated: backlog, live [backlog,live]")
    parser.add_argument("--concurrency", type=int, default=64, help="sessions in flight [64]")
    parser.add_argument("--no-tq", action="store_true", help="Parquet only (no Ray, no TransferQueue)")
    args = parser.parse_args()
    tokenizer = load_tokenizer("builtin:qwen2.5")
    ray_address = None if args.no_tq else _host_transfer_queue()
    rows = []
    responder = tool_responder(tokenizer.encode, tokenizer.decode, tokenizer.eos_token_id)
    with ScriptedEngineServer(responder=responder, keep_requests=4) as engine:
        for sessions in (int(s) for s in args.sessions.split(",")):
            rows += _size(sessions, engine.url, args.concurrency, ray_address, args.modes.split(","))
    print(f"\nburst (cpus={os.cpu_count()}, concurrency={args.concurrency}; edge, projector, materializer and "
          "nats-server each a process)")
    for row in rows:
        since = "last finalize" if row["mode"] == "live" else f"materializer ready ({row['startup s']:.1f}s to start)"
        rss = " ".join(f"{k.split()[1]} {v:.0f}" for k, v in row.items() if k.startswith("rss "))
        ratio = f" vs a bare TQ put's {row['bare put records/s']:.0f}: {row['ratio']:.2f}x" if "ratio" in row else ""
        print(f"{row['mode']:>7} {row['sessions']:>6} sessions  {row['sessions/s']:.0f} sessions/s  finalize burst "
              f"{row['finalize s']:.1f}s  {since} -> last record {row['to last record s']:.1f}s  "
              f"records/s {row['records/s']:.0f}{ratio}  peak consumers {row['peak consumers']}  RSS MiB {rss}  "
              f"lost {row['lost']} dup {row['duplicated']} quarantined {row['quarantined']} stray {row['stray']}  "
              f"retried {row['retried'] or 0}")


if __name__ == "__main__":
    main()
