"""How a session's log grows with its length, measured in one run.

One agent at a time drives a session of N turns (10, 50, 100 and 300 by default) through
the real edge (JetStream log, tokenizer, chains) with an in-process instant engine, on the
OpenAI and on the Anthropic wire. Every turn resends the whole history, as agents do, and
adds the model's tool call and a ~4 KB tool result. The edge is pinned to CPU 0, the load
generator (and the nats-server) to CPU 1.

For each session it prints:

- ``log B/tok``: bytes the session added to the log (the event stream plus the object store
  of large pieces) per token of its final context;
- ``tokens B/tok``: the same for the packed token arrays alone (prompt ids, sampled and
  context ids, log probs): what any log must store;
- ``nats RSS B/tok``: the nats-server's resident memory growth per stored token (the
  server's RSS after the session minus before it, over the session's tokens);
- ``replay``: the time to read the session back, fold it, derive its records and rebuild every
  request body (per 1,000 tokens: flat when replay is linear);
- for sessions of the longest length (``--cpu-rounds`` of them), the edge's median CPU per
  turn around turn 10 (turns 6-15) and at turn 300 (its last ten turns), each session's ratio
  and their median (one session's ratio varies by up to ~0.4 here: the VM's speed drifts).

Then ``--steady`` more 100-turn sessions show the server's RSS growth per stored token once
its start-up costs are paid (the embedded server runs under a soft memory limit, see
``stack/nats_server.py``).

Targets (issue 13): at most 16 log bytes per token at every length, nats-server RSS growth
at most 8 bytes per stored token, edge CPU per turn at turn 300 within 1.5x of turn 10.

    python ops/bench/log_growth.py [--turns 10,50,100,300] [--wires openai,anthropic] [--steady 24]
        [--cpu-rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import nats
from _http import Connection
from edge_overhead import SYSTEM, TASK, TOOLS, Server, cpu_seconds, finalize_session, pin_load_generator

from eventlog.reader import read_session
from materializer.records import derive_records
from schemas.bodies import rebuild
from schemas.events import ChainStarted, ContextAppended, TokensGenerated
from schemas.log import LogConfig
from session.fold import fold
from stack.nats_server import EmbeddedNats

MAX_TRAJECTORY = 1_000_000
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


_WORDS = ("self", "value", "result", "index", "count", "items", "config", "path", "name", "data", "request",
          "response", "error", "token", "chain", "session", "event", "buffer", "stream", "record", "batch", "limit",
          "offset", "length", "status", "reason", "digest", "prompt", "reply", "engine", "model", "tool", "call",
          "args", "return", "raise", "assert", "import", "from", "class", "def", "async", "await", "yield", "with",
          "for", "while", "if", "else", "elif", "try", "except", "finally", "lambda", "None", "True", "False")


def tool_result(salt: int, turn: int, size: int = 4096) -> str:
    """~``size`` bytes of a plausible tool result (numbered source lines), distinct per (salt, turn):
    no session's results are in the edge's token cache from an earlier one."""
    rng = random.Random(salt * 100_003 + turn)
    lines, length = [], 0
    while length < size:
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9)))
        line = f"{rng.randint(1, 9999):5d}  {words}({rng.randint(0, 999)})\n"
        lines.append(line)
        length += len(line)
    return "".join(lines)[:size]


class Agent:
    """One wire's agent loop: builds each request from the replies so far."""

    def __init__(self, wire: str, salt: int) -> None:
        self.wire = wire
        self.salt = salt
        if wire == "openai":
            self.path = "v1/chat/completions"
            self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": TASK}]
        else:
            self.path = "v1/messages"
            self.messages = [{"role": "user", "content": TASK}]

    def body(self) -> bytes:
        if self.wire == "openai":
            return json.dumps({"model": "m", "messages": self.messages, "tools": TOOLS}).encode()
        return json.dumps({"model": "m", "max_tokens": 512, "system": SYSTEM, "messages": self.messages,
                           "tools": ANTHROPIC_TOOLS}).encode()

    def answered(self, turn: int, reply: dict[str, Any]) -> int:
        """Append the reply and the tool's result; returns the conversation's tokens per the reply."""
        if self.wire == "openai":
            message = reply["choices"][0]["message"]
            self.messages.append({k: v for k, v in message.items() if v is not None})
            for call in message.get("tool_calls") or ():
                self.messages.append({"role": "tool", "tool_call_id": call["id"],
                                      "content": tool_result(self.salt, turn)})
            usage = reply["usage"]
            return int(usage["prompt_tokens"] + usage["completion_tokens"])
        self.messages.append({"role": "assistant", "content": reply["content"]})
        results = [{"type": "tool_result", "tool_use_id": b["id"], "content": tool_result(self.salt, turn)}
                   for b in reply["content"] if b["type"] == "tool_use"]
        self.messages.append({"role": "user", "content": results or "go on"})
        usage = reply["usage"]
        return int(usage["input_tokens"] + usage["output_tokens"])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def stored_bytes(js: Any, cfg: LogConfig) -> int:
    """Bytes in the event stream and in every object store bucket."""
    total = 0
    for info in await js.streams_info():
        if info.config.name == cfg.stream or info.config.name.startswith("OBJ_"):
            total += info.state.bytes
    return total


async def replayed(js: Any, cfg: LogConfig, session_id: str) -> tuple[int, float]:
    """The packed token arrays' bytes, and the seconds a replay took: read the log, fold it, derive
    the records, rebuild every request body (as ropes) and join the last one."""
    started = time.perf_counter()
    session = await read_session(js, cfg, session_id)
    state = fold(session.events)
    assert state is not None
    derive_records(state)
    bodies = rebuild(session.events)
    bodies.body(bodies.request_numbers()[-1])
    seconds = time.perf_counter() - started
    total = 0
    for event in session.events:
        if isinstance(event, ChainStarted):
            total += len(event.prompt_ids)
        elif isinstance(event, ContextAppended):
            total += len(event.token_ids)
        elif isinstance(event, TokensGenerated):
            total += len(event.token_ids) + len(event.logprobs or b"")
    return total, seconds


async def drive(port: int, wire: str, turns: int, edge_pid: int, salt: int) -> tuple[str, int, list[float]]:
    """One session of ``turns`` turns; its id, final context tokens and each turn's edge CPU (s)."""
    conn = await Connection.open("127.0.0.1", port)
    status, raw = await conn.send(conn.request_bytes("/sessions", b"{}", {"Authorization": "Bearer bench"}))
    if status != 201:
        raise RuntimeError(f"open session: {status} {raw[:200]!r}")
    created = json.loads(raw)
    session_id, key = created["session_id"], created["api_key"]
    agent = Agent(wire, salt)
    path = f"/sessions/{session_id}/{agent.path}"
    cpu: list[float] = []
    context = 0
    for turn in range(turns):
        request = conn.request_bytes(path, agent.body(), {"Authorization": f"Bearer {key}"})
        before = cpu_seconds(edge_pid)
        status, raw = await conn.send(request)
        cpu.append(cpu_seconds(edge_pid) - before)
        if status != 200:
            raise RuntimeError(f"{wire} turn {turn + 1} of {turns}: {status} {raw[:300]!r}")
        context = agent.answered(turn, json.loads(raw))
    await finalize_session(conn, session_id)
    await conn.close()
    return session_id, context, cpu


def _cpu_line(wire: str, rounds: list[list[float]]) -> str:
    """The edge's CPU per turn around turn 10 (median of turns 6-15) and over the last 10 turns,
    per session, and the median of the sessions' own ratios."""
    pairs = [(statistics.median(cpu[5:15]) * 1e3, statistics.median(cpu[-10:]) * 1e3) for cpu in rounds]
    ratio = statistics.median(late / early for early, late in pairs)
    shown = ", ".join(f"{early:.2f} -> {late:.2f} ms ({late / early:.2f}x)" for early, late in pairs)
    return (f"{wire:>9} edge CPU per turn, turn 10 -> turn {len(rounds[0])}: {shown}; median {ratio:.2f}x "
            "(target <= 1.5x)")


async def steady_state(edge: Server, nats_pid: int, sessions: int, salt: int) -> None:
    """The nats-server's RSS growth per stored token over ``sessions`` more 100-turn sessions: a
    short run's figures above include the server's start-up costs (each stream's write block, up
    to 8 MB, fills first); a long run's growth is what these show."""
    if sessions <= 0:
        return
    before, tokens, peak = rss_bytes(nats_pid), 0, 0
    for index in range(sessions):
        _, context, _ = await drive(edge.port, "openai" if index % 2 == 0 else "anthropic", 100, edge.proc.pid,
                                    salt + 1 + index)
        tokens += context
        peak = max(peak, rss_bytes(nats_pid))
    after = rss_bytes(nats_pid)
    print(f"nats-server steady state: {sessions} more 100-turn sessions, {tokens} tokens: RSS {before / 2**20:.0f} "
          f"-> {after / 2**20:.0f} MiB (peak {peak / 2**20:.0f}), {(after - before) / tokens:.1f} B per stored token "
          "(target <= 8)")


async def run(wires: list[str], lengths: list[int], steady: int, cpu_rounds: int) -> None:
    cfg = LogConfig()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(Path(tmp) / "nats", name="bench") as server:
        edge = Server("edge", 18711, server.url, pin_load_generator(),
                      extra=("--max-trajectory-length", str(MAX_TRAJECTORY)))
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        try:
            await edge.wait_ready()
            await drive(edge.port, "openai", 3, edge.proc.pid, salt=0)  # warm up: lazy imports, caches
            print(f"instant engine; ~4 KB tool result a turn; max trajectory length {MAX_TRAJECTORY}; "
                  "edge on CPU 0, load and nats-server on CPU 1")
            print(f"{'wire':>9} {'turns':>5} {'tokens':>8} {'log MB':>7} {'log B/tok':>9} {'tokens B/tok':>12} "
                  f"{'nats RSS B/tok':>14} {'replay ms':>9} {'replay us/ktok':>14}")
            salt = 0
            cpu_lines: list[str] = []
            for wire in wires:
                longest: list[float] = []
                for turns in lengths:
                    stored, rss = await stored_bytes(js, cfg), rss_bytes(server.pid)
                    salt += 1
                    session_id, context, cpu = await drive(edge.port, wire, turns, edge.proc.pid, salt)
                    grown_rss = rss_bytes(server.pid) - rss
                    grown = await stored_bytes(js, cfg) - stored
                    arrays, seconds = await replayed(js, cfg, session_id)
                    print(f"{wire:>9} {turns:>5} {context:>8} {grown / 1e6:>7.2f} {grown / context:>9.1f} "
                          f"{arrays / context:>12.1f} {grown_rss / context:>14.1f} {seconds * 1e3:>9.0f} "
                          f"{seconds * 1e9 / context:>14.0f}")
                    longest = cpu
                if len(longest) >= 20:
                    rounds = [longest]
                    for _ in range(cpu_rounds - 1):  # more sessions of the longest length: the CPU ratio's spread
                        salt += 1
                        rounds.append((await drive(edge.port, wire, lengths[-1], edge.proc.pid, salt))[2])
                    cpu_lines.append(_cpu_line(wire, rounds))
            for line in cpu_lines:
                print(line)
            await steady_state(edge, server.pid, steady, salt)
        finally:
            await nc.close()
            edge.stop()


def main() -> None:
    logging.disable(logging.WARNING)  # the sessions post no reward: the materializer's warning, every time
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", default="10,50,100,300")
    parser.add_argument("--wires", default="openai,anthropic")
    parser.add_argument("--steady", type=int, default=24, help="100-turn sessions of the steady-state RSS phase")
    parser.add_argument("--cpu-rounds", type=int, default=3, help="sessions of the longest length for the CPU ratio")
    args = parser.parse_args()
    asyncio.run(run(args.wires.split(","), [int(n) for n in args.turns.split(",")], args.steady, args.cpu_rounds))


if __name__ == "__main__":
    main()
