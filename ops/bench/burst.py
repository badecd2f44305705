"""A verl step at training scale through ``rollbus up``: sessions ending at once, and what it costs.

For each size, a fresh ``rollbus up`` (embedded NATS, scripted SGLang engine, TransferQueue hosted by
this process and joined with ``--ray-address``, as verl's trainer hosts it) runs a step of N sessions
(:mod:`rollbus.testing.burst`: ``N/8`` prompts x 8, each a short tool-using conversation over the OpenAI
wire, all finalized at once at the end). It prints:

- sessions/s of the step (opening and running every conversation), and the finalize burst's wall time;
- the time from the last finalize answered to the last session marked (its records written);
- the peak number of consumers the NATS account held (a reader per session would show here);
- the peak RSS of ``rollbus up`` (edge, projector, materializer) and of its nats-server;
- records/s of the materializer (from the first finalize to the last record) against a bare
  TransferQueue put of the same records (re-derived from the log, fields built untimed, one
  ``kv_batch_put`` per 1,024), measured in the same run: the ratio is what the pipeline costs over
  TransferQueue alone;
- lost, duplicated and quarantined sessions (must be 0, 0, 0).

    python ops/bench/burst.py --sessions 4096,16384 [--concurrency 64] [--no-tq]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil

from edge.codec.tokenizer import load_tokenizer
from eventlog.reader import load_state
from materializer.records import derive_records
from materializer.tq_fields import grouped
from rollbus.testing.burst import ConsumerPeak, Driver, Outcome, nats_url, outcome, tool_responder, wait_marked
from rollbus.testing.scripted import ScriptedEngineServer
from schemas.log import LogConfig
from stack.provision import connect

PUT_BATCH = 1024


class Stack:
    """``rollbus up`` as a subprocess, its printed lines kept."""

    def __init__(self, data: Path, engine_url: str, extra: list[str]) -> None:
        cmd = [sys.executable, "-m", "rollbus.cli", "up", "--port", "0", "--data-dir", str(data), "--admin-token",
               "tok", "--engine", "sglang", "--engine-url", engine_url, "--log-level", "WARNING", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.data = data
        self.printed = ""
        self.url = self._until(r"edge:\s+(http://\S+)")
        self._until(r"(Ctrl-C)")
        threading.Thread(target=self._drain, daemon=True).start()  # keep its pipe from filling

    def _until(self, pattern: str, timeout: float = 120.0) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"rollbus up exited:\n{self.printed}")
            self.printed += line
            if found := re.search(pattern, line):
                return found.group(1)
        raise RuntimeError(f"rollbus up did not print {pattern!r}:\n{self.printed}")

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "Traceback" in line or "ERROR" in line:
                print("  rollbus up:", line.rstrip(), flush=True)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


class RssPeak:
    """The peak resident memory of ``rollbus up`` and of its nats-server child, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self._up = psutil.Process(pid)
        self._nats = next((c for c in self._up.children(recursive=True) if "nats-server" in c.name()), None)
        self.up = self.nats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.up = max(self.up, self._up.memory_info().rss)
                if self._nats is not None:
                    self.nats = max(self.nats, self._nats.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _host_transfer_queue() -> str:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback, as the sink sets it
    import ray
    import transfer_queue as tq

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="rollbus-bench",
             _node_ip_address="127.0.0.1")
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


async def _run(stack: Stack, sessions: int, concurrency: int, transfer_queue: bool) -> dict[str, object]:
    url = nats_url(stack.printed)
    rss = RssPeak(stack.proc.pid)
    driver = Driver(stack.url, "tok", concurrency=concurrency)
    async with ConsumerPeak(url) as consumers:
        step = await driver.step(sessions)
        statuses, last_marked = await wait_marked(url, step.session_ids, timeout=max(300.0, sessions / 10))
    rss.stop()
    first_finalize = step.finalized_at - step.finalize_s
    found: Outcome = outcome(stack.data / "trajectories", step.session_ids, statuses)
    row: dict[str, object] = {
        "sessions": sessions, "sessions/s": sessions / step.ran_s, "finalize s": step.finalize_s,
        "last finalize -> last record s": max(last_marked - step.finalized_at, 0.0),
        "peak consumers": consumers.peak, "rss up MiB": rss.up / 2**20, "rss nats MiB": rss.nats / 2**20,
        "records/s": sessions / (last_marked - first_finalize),
        "lost": found.lost, "duplicated": found.duplicated, "quarantined": found.quarantined,
        "retried": dict(driver.retried),
    }
    if transfer_queue:
        records, seconds = await _bare_put(url, step.session_ids, f"bare{sessions}")
        row["bare put records/s"] = records / seconds
        row["ratio"] = float(row["records/s"]) / float(row["bare put records/s"])  # type: ignore[arg-type]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", default="4096,16384", help="comma-separated step sizes [4096,16384]")
    parser.add_argument("--concurrency", type=int, default=64, help="sessions in flight [64]")
    parser.add_argument("--no-tq", action="store_true", help="Parquet only (no Ray, no TransferQueue)")
    args = parser.parse_args()
    tokenizer = load_tokenizer("builtin:qwen2.5")
    ray_address = None if args.no_tq else _host_transfer_queue()
    rows = []
    responder = tool_responder(tokenizer.encode, tokenizer.decode, tokenizer.eos_token_id)
    with ScriptedEngineServer(responder=responder, keep_requests=4) as engine:
        for sessions in (int(s) for s in args.sessions.split(",")):
            with tempfile.TemporaryDirectory(prefix="rollbus-burst-") as tmp:
                extra = [] if ray_address is None else ["--transfer-queue", "--ray-address", ray_address,
                                                        "--tq-partition", f"burst{sessions}"]
                stack = Stack(Path(tmp) / "data", engine.url, extra)
                try:
                    rows.append(asyncio.run(_run(stack, sessions, args.concurrency, ray_address is not None)))
                finally:
                    stack.stop()
            print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
                  flush=True)
    print(f"\nburst (cpus={os.cpu_count()}, concurrency={args.concurrency})")
    for row in rows:
        ratio = f"  TQ put ratio {row['ratio']:.2f}x (records/s {row['records/s']:.0f} vs bare " \
                f"{row['bare put records/s']:.0f})" if "ratio" in row else ""
        print(f"{row['sessions']:>6} sessions  {row['sessions/s']:.0f} sessions/s  finalize burst "
              f"{row['finalize s']:.1f}s  last finalize->last record {row['last finalize -> last record s']:.1f}s  "
              f"peak consumers {row['peak consumers']}  RSS up {row['rss up MiB']:.0f} MiB nats "
              f"{row['rss nats MiB']:.0f} MiB  lost {row['lost']} dup {row['duplicated']} "
              f"quarantined {row['quarantined']}  requests retried {row['retried'] or 0}{ratio}")


if __name__ == "__main__":
    main()
