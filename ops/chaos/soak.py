"""Soak: steps of sessions x turns for a while, memory and materializer lag sampled; then abandoned sessions.

Through nats-server, ``rollbus edge`` (scripted SGLang engine), ``rollbus projector`` and ``rollbus
materializer`` (Parquet), each a process (:class:`rollbus.testing.chaos.ProcessStack`):

1. ``soak``: rounds of ``--sessions`` sessions of ``--turns`` model requests each (OpenAI wire; the model
   calls ``add``, the agent answers with the result, the model answers, the agent asks again ...), each
   finalized when its conversation ends (the finalize at the round's end answers the same), until
   ``--minutes`` passed; every session of every round must be materialized once;
2. ``abandoned``: ``--abandoned`` sessions opened (a turn each) and left; the edge's idle keeper
   (``--idle-timeout``) must abort every one (reason ``idle_timeout``), and its open sessions drop back.

Every ``--every`` seconds the resident memory of each process and the materializer's lag (ready signals
not yet acknowledged, and the age of the oldest) are written to ``--out`` (CSV) and drawn beside it (PNG).
Prints a summary: RSS at start, peak and end per process, the lag's peak and end, the rounds, and the
abandoned sessions reclaimed.

    python ops/chaos/soak.py [--sessions 500 --turns 20 --minutes 30 --abandoned 10000 --idle-timeout 60]
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import httpx
import psutil
from PIL import Image, ImageDraw

from edge.tokens.tokenizer import load_tokenizer
from eventlog.lag import Watched, consumer_lag
from materializer.service import MaterializerOptions
from rollbus.testing.burst import (
    TOOLS,
    Driver,
    outcome,
    sessions_open,
    sessions_open_at_most,
    tool_responder,
    wait_marked,
)
from rollbus.testing.chaos import ProcessStack
from rollbus.testing.scripted import ScriptedEngineServer
from schemas.log import LogConfig
from stack.provision import connect

PARTS = ("edge", "projector", "materializer", "nats")
COLUMNS = ["t_s", "phase", *(f"rss_{p}_mib" for p in PARTS), "lag_messages", "lag_s", "edge_sessions_open"]


class Turns(Driver):
    """A step's sessions of ``turns`` model requests each."""

    def __init__(self, url: str, admin_token: str, *, turns: int, concurrency: int) -> None:
        super().__init__(url, admin_token, concurrency=concurrency, delays=(0.5, 1.0, 2.0, 4.0))
        self._turns = turns

    async def _session(self, client: httpx.AsyncClient, i: int, global_steps: int, uid_prefix: str) -> str:
        opened, key, path = await self._open(client, i, global_steps, uid_prefix)
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"What is 19 + 23? (task {i})"}]
        for turn in range(self._turns):
            message = (await self._post(client, path, key, {"model": "m", "messages": messages,
                                                            "tools": TOOLS}))["choices"][0]["message"]
            messages.append({k: v for k, v in message.items() if v is not None})
            if message.get("tool_calls"):
                messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "42"})
            else:
                messages.append({"role": "user", "content": f"And 19 + 23 again? ({turn})"})
        await self._post(client, f"/sessions/{opened['session_id']}/reward_info", key,
                         {"reward_info": {"reward": 1.0}})
        await self._finalize(client, opened["session_id"])  # at once: a round may outlast --idle-timeout
        return str(opened["session_id"])


class Sampler:
    """Every ``every`` seconds, from a thread of its own: each process's RSS, the materializer's lag and the
    edge's open sessions, as rows of :data:`COLUMNS` (also written to ``out``, a CSV, as they come)."""

    def __init__(self, stack: ProcessStack, out: Path, every: float) -> None:
        self._stack, self._out, self._every = stack, out, every
        self.phase = "start"
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._began = time.monotonic()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="soak-sampler", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    async def _run(self) -> None:
        cfg = LogConfig()
        watched = Watched(name="materializer", stream=cfg.ready_stream, durable=MaterializerOptions().durable,
                          subject=cfg.ready_subjects)
        client = await connect(self._stack.nats_url, name="soak-sampler")
        procs = {name: psutil.Process(pid) for name, pid in self._stack.pids().items()}
        with self._out.open("w", newline="") as out:
            writer = csv.DictWriter(out, COLUMNS)
            writer.writeheader()
            async with httpx.AsyncClient(timeout=10) as http:
                while True:
                    row: dict[str, Any] = {"t_s": round(time.monotonic() - self._began, 1), "phase": self.phase}
                    for name, proc in procs.items():
                        row[f"rss_{name}_mib"] = round(proc.memory_info().rss / 2**20, 1)
                    try:
                        lag = await consumer_lag(client.jetstream(), watched)
                        row["lag_messages"], row["lag_s"] = (lag.messages, round(lag.seconds, 2)) if lag else (0, 0.0)
                        row["edge_sessions_open"] = await sessions_open(http, self._stack.url)
                    except Exception as exc:  # a busy moment: the row says so
                        row["lag_messages"] = row.get("lag_messages", "")
                        print(f"  sample at {row['t_s']}s incomplete: {exc!r}", flush=True)
                    self.rows.append(row)
                    writer.writerow(row)
                    out.flush()
                    if self._stop.is_set():
                        break
                    await asyncio.to_thread(self._stop.wait, self._every)
        await client.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """RSS per process (top) and the materializer's lag in ready signals (bottom), over time (Pillow)."""
    width, height, pad = 1000, 640, 60
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    colours = {"edge": (31, 119, 180), "projector": (44, 160, 44), "materializer": (214, 39, 40),
               "nats": (148, 103, 189), "lag_messages": (255, 127, 14), "edge_sessions_open": (127, 127, 127)}
    t_max = max((float(r["t_s"]) for r in rows), default=1.0) or 1.0
    panels = [("RSS MiB", [(f"rss_{p}_mib", p) for p in PARTS], pad, height // 2 - pad // 2),
              ("lag (ready signals) / sessions open", [("lag_messages", "lag_messages"),
                                                       ("edge_sessions_open", "edge_sessions_open")],
               height // 2 + pad // 2, height - pad)]
    for title, series, top, bottom in panels:
        values = [float(r[c]) for r in rows for c, _ in series if r.get(c) not in (None, "")]
        v_max = max(values, default=1.0) or 1.0
        draw.rectangle((pad, top, width - pad, bottom), outline="black")
        draw.text((pad, top - 14), f"{title} (max {v_max:.0f})", fill="black")
        draw.text((width - pad - 60, bottom + 4), f"{t_max:.0f} s", fill="black")
        for row_at, (column, name) in enumerate(series):
            points = [(pad + (width - 2 * pad) * float(r["t_s"]) / t_max,
                       bottom - (bottom - top) * float(r[column]) / v_max) for r in rows if r.get(column) not in
                      (None, "")]
            if len(points) > 1:
                draw.line(points, fill=colours[name], width=2)
            draw.text((pad + 6, top + 4 + 12 * row_at), name, fill=colours[name])
        phase_at = None
        for r in rows:
            if r["phase"] != phase_at:
                phase_at = r["phase"]
                x = pad + (width - 2 * pad) * float(r["t_s"]) / t_max
                draw.line([(x, top), (x, bottom)], fill=(200, 200, 200))
                draw.text((x + 2, bottom - 14), str(phase_at), fill=(120, 120, 120))
    image.save(path)


def summary(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for name in PARTS:
        series = [float(r[f"rss_{name}_mib"]) for r in rows]
        lines.append(f"  rss {name:<12} start {series[0]:7.1f}  peak {max(series):7.1f}  end {series[-1]:7.1f} MiB")
    lag = [int(r["lag_messages"]) for r in rows if r.get("lag_messages") not in (None, "")]
    lag_s = [float(r["lag_s"]) for r in rows if r.get("lag_s") not in (None, "")]
    lines.append(f"  materializer lag: peak {max(lag, default=0)} ready signals ({max(lag_s, default=0.0):.1f}s "
                 f"oldest), end {lag[-1] if lag else 0}")
    return lines


async def _reclaimed(url: str, admin: dict[str, str], session_ids: list[str]) -> Counter[str]:
    """Each abandoned session's status and close reason, as its summary says."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        gate = asyncio.Semaphore(32)

        async def one(sid: str) -> str:
            async with gate:
                body = (await client.get(f"/sessions/{sid}", headers=admin)).json()
                return f"{body['status']} ({body.get('close_reason')})"

        return Counter(await asyncio.gather(*(one(s) for s in session_ids)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=500, help="sessions a round [500]")
    parser.add_argument("--turns", type=int, default=20, help="model requests a session [20]")
    parser.add_argument("--minutes", type=float, default=30.0, help="how long rounds are started [30]")
    parser.add_argument("--abandoned", type=int, default=10_000, help="sessions opened and left [10000]")
    parser.add_argument("--idle-timeout", type=float, default=60.0, help="the edge's --idle-timeout [60]")
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples [5]")
    parser.add_argument("--concurrency", type=int, default=64, help="sessions in flight [64]")
    parser.add_argument("--out", type=Path, default=Path("soak.csv"), help="the samples (CSV); the plot beside it "
                                                                           "(.png) [soak.csv]")
    args = parser.parse_args()
    if min(args.sessions, args.turns, args.concurrency) < 1 or args.minutes <= 0 or args.abandoned < 0 \
            or args.idle_timeout <= 0 or args.every <= 0:
        parser.error("--sessions, --turns, --concurrency, --minutes, --idle-timeout and --every must be positive")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer("builtin:qwen2.5")
    responder = tool_responder(tokenizer.encode, tokenizer.decode, tokenizer.eos_token_id)
    failed = False
    with ScriptedEngineServer(responder=responder, keep_requests=4) as engine, \
            tempfile.TemporaryDirectory(prefix="rollbus-soak-") as tmp:
        stack = ProcessStack(Path(tmp), engine.url, edge_args=("--idle-timeout", str(args.idle_timeout)))
        sampler = Sampler(stack, args.out, args.every).start()
        driver = Turns(stack.url, stack.admin_token, turns=args.turns, concurrency=args.concurrency)
        try:
            sampler.phase = "soak"
            ends, rounds, lost = time.monotonic() + args.minutes * 60, 0, 0
            while time.monotonic() < ends:
                step = asyncio.run(driver.step(args.sessions, global_steps=rounds + 1, uid_prefix=f"r{rounds}-"))
                statuses, _ = asyncio.run(wait_marked(stack.nats_url, step.session_ids, 600))
                found = outcome(stack.data / "trajectories", step.session_ids, statuses)
                rounds += 1
                lost += found.lost + found.duplicated + found.quarantined
                print(f"round {rounds}: {args.sessions} sessions x {args.turns} turns in {step.ran_s:.0f}s, "
                      f"lost {found.lost} dup {found.duplicated} quarantined {found.quarantined}", flush=True)
            failed |= lost > 0
            reclaim = ""
            if args.abandoned:
                sampler.phase = "abandoned"
                before = asyncio.run(sessions_open_at_most(stack.url, 0, 60))
                started = time.monotonic()
                left = asyncio.run(driver.abandon(args.abandoned, "idle-"))
                opened = time.monotonic() - started
                sampler.phase = "idle"
                after = asyncio.run(sessions_open_at_most(stack.url, before, args.idle_timeout * 3 + 120))
                reclaimed = time.monotonic() - started
                statuses = asyncio.run(_reclaimed(stack.url, driver._admin, left))
                failed |= after > before or statuses != Counter({"aborted (idle_timeout)": len(left)})
                reclaim = (f"abandoned: {len(left)} sessions opened in {opened:.0f}s; edge sessions open {before:.0f} "
                           f"before, {after:.0f} after {reclaimed:.0f}s; "
                           + ", ".join(f"{k} x{v}" for k, v in statuses.items()))
        finally:
            sampler.stop()
            stack.close()
    plot(sampler.rows, args.out.with_suffix(".png"))
    print(f"soak: {rounds} rounds of {args.sessions} sessions x {args.turns} turns in {args.minutes:g} min, "
          f"lost/duplicated/quarantined {lost}; retried {dict(driver.retried) or 0}; "
          f"non-2xx {dict(driver.refused) or 0}")
    print("\n".join(summary(sampler.rows)))
    if reclaim:
        print(reclaim)
    print(f"samples: {args.out} ({len(sampler.rows)} rows), plot: {args.out.with_suffix('.png')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
