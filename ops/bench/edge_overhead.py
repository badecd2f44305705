"""Edge overhead against the HTTP floor, measured in the same run.

K concurrent sessions x T turns of an agent loop go through (a) the rollbus edge with an
in-process instant engine, every turn's events acknowledged by JetStream before the
reply, and (b) a bare FastAPI app that returns a fixed completion (the HTTP floor), each on
every HTTP server of ``--servers`` (``granian``: the edge's, as ``rollbus edge`` runs it;
``uvicorn``: uvicorn's httptools protocol). The first prompt is ~560 tokens with three
tools; each later turn sends back the assistant message and a ~50-token tool result.
Servers are pinned to CPU 0, the load generator to CPU 1. Every session is a new one (its
first prompt is the same: the edge's first-prompt cache serves all but the first; see docs/performance.md).

All servers run side by side and their runs alternate (the order of the HTTP servers
rotated and floor/edge swapped every round), so each round is a floor run and an edge run
on each HTTP server, made moments apart. This VM's speed drifts by up to 2x over minutes,
so a ratio is the median over rounds of each round's own ratio, not a ratio of medians. A
process's speed also depends on its string-hash seed (dict layouts) by up to ~15% here, so
the rounds are spread over ``--seeds``: each seed is a fresh set of servers, all started
with that ``PYTHONHASHSEED``.

Reports turns/s, p50/p99 latency, and server CPU ms per turn (the server process's own
CPU time, every thread; medians over all rounds), with the edge/floor ratios on the same
HTTP server the targets are stated in, and each app's cost on each HTTP server against the
floor on the first of ``--servers``.

``--memlog`` adds a third app to every round: the same edge on the in-memory log (envelopes
fitted and encoded as for JetStream, then kept in a list), so the same rounds also show what
the JetStream append (its publish, and the wait for its acknowledgement) costs the edge.
``--stream`` adds the edge's agents asking for streamed replies (``edge-stream``: the same edge server, the
reply sent as server-sent events): a streamed turn against a plain one. With both HTTP servers, the edge on
granian is also reported against the floor on uvicorn + httptools (what a user would put a FastAPI app on).

    python ops/bench/edge_overhead.py [--ks 1,16,64] [--turns 8] [--repeat 5] [--seeds 0,1,2]
                                      [--servers granian,uvicorn] [--memlog] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _http import Connection

from stack.nats_server import EmbeddedNats

HERE = Path(__file__).resolve().parent
MEMLOG = "edge-memlog"
STREAM = "edge-stream"  # the edge's server, its agents asking for streamed replies (``--stream``)
SERVED_BY = {STREAM: "edge"}

TOOLS = [
    {"type": "function", "function": {
        "name": "search_code",
        "description": "Search the repository for a regular expression and return matching lines with their "
                       "file paths and line numbers. Use it to find definitions, call sites and configuration.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string", "description": "A Python regular expression."},
            "path": {"type": "string", "description": "Directory or file to search, relative to the root."},
            "max_results": {"type": "integer", "description": "Stop after this many matches.", "default": 50}},
            "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "read_file",
        "description": "Read a range of lines from a file in the repository. Lines are numbered from 1.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "File path relative to the repository root."},
            "start": {"type": "integer", "description": "First line to read."},
            "end": {"type": "integer", "description": "Last line to read (inclusive)."}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests",
        "description": "Run the project's test suite or a subset of it and return the summary and failures.",
        "parameters": {"type": "object", "properties": {
            "selector": {"type": "string", "description": "A pytest node id or -k expression."},
            "timeout_s": {"type": "integer", "description": "Give up after this many seconds."}},
            "required": []}}},
]
SYSTEM = ("You are a software engineering agent working in a Python repository. Investigate before you edit: "
          "search for the relevant code, read it, form a hypothesis, and verify it by running the tests. "
          "Prefer small, reviewable changes. When you call a tool, call exactly one tool per turn and wait for "
          "its result. When the task is done, reply with a short summary of what you changed and why.")
TASK = ("The request handler in src/app/main.py returns HTTP 500 when the client sends an empty JSON body. "
        "Find where the body is parsed, make it return a 400 with a clear error message instead, and add a "
        "regression test. The project uses FastAPI and pytest; tests live under tests/.")
TOOL_RESULT = ("  41  def parse_body(raw: bytes) -> dict:\n  42      data = json.loads(raw)\n  43      if not "
               "isinstance(data, dict):\n  44          raise ValueError('body must be an object')\n  45      return "
               "data\n  46\n  47  async def handle(request):\n  48      body = parse_body(await request.body())")
ARGS = '{"path": "src/app/main.py", "start": 1, "end": 80}'


def bodies(turns: int, *, stream: bool = False) -> list[bytes]:
    """The agent's request bodies, turn by turn (deterministic: the edge derives tool-call ids); ``stream``: each
    asks for a streamed reply (SSE)."""
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    out = []
    for turn in range(turns):
        request = {"model": "m", "messages": messages, "tools": TOOLS, **({"stream": True} if stream else {})}
        out.append(json.dumps(request).encode())
        call_id = f"call_{turn + 1}_0"
        messages = [*messages,
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call_id, "type": "function", "function": {"name": "read_file", "arguments": ARGS}}]},
                    {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT}]
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of a process, in seconds, at nanosecond resolution (schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1e9


def kernel_seconds(pid: int) -> float:
    """Kernel CPU time of a process (all its threads, exited ones too), in seconds, at clock-tick
    resolution (``stime`` of ``/proc/PID/stat``): what its system calls cost, the socket writes
    that deliver to a peer and wake it among them."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[12]) / os.sysconf("SC_CLK_TCK")


def pin_load_generator() -> int | None:
    """On two cores or more: this process (the load generator) to CPU 1, and the CPU the server
    under test is to be pinned to (0); on one core, None (nothing pinned)."""
    if len(os.sched_getaffinity(0)) < 2:
        return None
    os.sched_setaffinity(0, {1})
    return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """``kind`` of ``tree``'s ``ops/bench/_servers.py`` (this checkout's by default), as a process; ``wrapper``: a
    command it runs under (``edge_instructions.py``'s valgrind), ``quiet``: its output discarded."""

    def __init__(self, kind: str, port: int, nats_url: str, cpu: int | None, seed: int | None = None,
                 extra: tuple[str, ...] = (), tree: Path = HERE.parents[1], *, wrapper: tuple[str, ...] = (),
                 quiet: bool = False) -> None:
        cmd = [*wrapper, sys.executable, str(tree / "ops" / "bench" / "_servers.py"), kind, "--port", str(port),
               "--nats", nats_url, *extra]
        if cpu is not None:
            cmd += ["--cpu", str(cpu)]
        env = dict(os.environ) if seed is None else {**os.environ, "PYTHONHASHSEED": str(seed)}
        self.kind = kind
        self.extra = extra
        self.port = port
        output = subprocess.DEVNULL if quiet else None
        self.proc = subprocess.Popen(cmd, env=env, stdout=output, stderr=output)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited ({self.proc.returncode}) before it listened")
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", self.port)
                writer.close()
                return
            except OSError:
                await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.kind} server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


async def finalize_session(conn: Connection, session_id: str) -> None:
    """Finalize ``session_id`` on ``conn`` with the benchmarks' admin token; RuntimeError unless it answers 200."""
    status, body = await conn.send(conn.request_bytes(f"/sessions/{session_id}/finalize", b"{}",
                                                      {"Authorization": "Bearer bench"}))
    if status != 200:
        raise RuntimeError(f"finalize {session_id}: {status} {body[:200]!r}")


async def open_sessions(port: int, k: int) -> list[tuple[str, str]]:
    conn = await Connection.open("127.0.0.1", port)
    sessions = []
    for _ in range(k):
        raw = conn.request_bytes("/sessions", b"{}", {"Authorization": "Bearer bench"})
        status, body = await conn.send(raw)
        if status != 201:
            raise RuntimeError(f"open session: {status} {body[:200]!r}")
        created = json.loads(body)
        sessions.append((created["session_id"], created["api_key"]))
    await conn.close()
    return sessions


async def agent(port: int, session: tuple[str, str], turn_bodies: list[bytes], latencies: list[float]) -> None:
    session_id, key = session
    conn = await Connection.open("127.0.0.1", port)
    path = f"/sessions/{session_id}/v1/chat/completions"
    for body in turn_bodies:
        raw = conn.request_bytes(path, body, {"Authorization": f"Bearer {key}"})
        started = time.perf_counter()
        status, reply = await conn.send(raw)
        latencies.append(time.perf_counter() - started)
        if status != 200 or (b'"stream": true' in body and not reply.rstrip().endswith(b"data: [DONE]")):
            raise RuntimeError(f"turn failed: {status} {reply[-300:]!r}")
    await conn.close()


async def run_load(server: Server, k: int, turn_bodies: list[bytes], min_turns: int = 512) -> dict[str, float]:
    """Waves of K concurrent agents until at least ``min_turns`` turns ran (sessions opened beforehand)."""
    waves = max(1, -(-min_turns // (k * len(turn_bodies))))
    sessions = await open_sessions(server.port, k * waves)
    latencies: list[float] = []
    cpu_before, kernel_before = cpu_seconds(server.proc.pid), kernel_seconds(server.proc.pid)
    started = time.perf_counter()
    for wave in range(waves):
        batch = sessions[wave * k:(wave + 1) * k]
        try:
            await asyncio.gather(*(agent(server.port, s, turn_bodies, latencies) for s in batch))
        except (IndexError, OSError, asyncio.IncompleteReadError) as exc:
            raise RuntimeError(f"{server.kind} {server.extra} (K={k}) closed a connection: {exc!r}") from exc
    wall = time.perf_counter() - started
    cpu = cpu_seconds(server.proc.pid) - cpu_before
    kernel = kernel_seconds(server.proc.pid) - kernel_before
    turns = len(latencies)
    latencies.sort()
    return {"turns_s": turns / wall, "p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "cpu_ms": 1e3 * cpu / turns, "kernel_ms": 1e3 * kernel / turns}


Run = dict[str, float]
Rounds = dict[tuple[str, int], list[dict[str, Run]]]  # per HTTP server and K: each round's run of each app


async def measure(nats_url: str, ks: list[int], turn_bodies: list[bytes], repeat: int, cpu: int | None,
                  seeds: list[int], http_servers: list[str], apps: tuple[str, ...]) -> Rounds:
    """For each seed a fresh set of ``apps`` on each HTTP server, side by side (the idle ones cost
    nothing); for each K, ``repeat`` rounds of one run each, the servers' order rotated and the
    apps' order reversed every round. :data:`STREAM` runs on the edge's server, with streamed bodies."""
    rounds: Rounds = {(http, k): [] for http in http_servers for k in ks}
    loads = {kind: bodies(len(turn_bodies), stream=True) if kind == STREAM else turn_bodies for kind in apps}
    for seed in seeds:
        servers = {(http, kind): Server(kind, free_port(), nats_url, cpu, seed, extra=("--server", http))
                   for http in http_servers for kind in apps if kind not in SERVED_BY}
        try:
            for (_, kind), server in servers.items():
                await server.wait_ready()
                for app in apps:  # warm up: lazy imports and caches
                    if SERVED_BY.get(app, app) == kind:
                        await run_load(server, 4, loads[app], min_turns=64)
            for k in ks:
                for rep in range(repeat):
                    shift = rep % len(http_servers)
                    for http in http_servers[shift:] + http_servers[:shift]:
                        runs: dict[str, Run] = {}
                        for kind in apps if rep % 2 == 0 else apps[::-1]:
                            runs[kind] = await run_load(servers[(http, SERVED_BY.get(kind, kind))], k, loads[kind])
                        rounds[(http, k)].append(runs)
        finally:
            for server in servers.values():
                server.stop()
    return rounds


def report(rounds: Rounds, prompt_tokens: int, seeds: list[int], http_servers: list[str], ks: list[int],
           apps: tuple[str, ...]) -> None:
    n = len(next(iter(rounds.values())))
    print(f"first prompt: {prompt_tokens} tokens, 3 tools; server pinned to CPU 0, load generator to CPU 1; "
          f"{n} rounds per K and HTTP server over hash seeds {','.join(map(str, seeds))}")
    print(f"{'K':>3} {'http':>8} {'app':>11} {'turns/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'CPU ms/turn':>12}"
          f" {'of it kernel':>13}   (medians)")
    for k in ks:
        for http in http_servers:
            runs = rounds[(http, k)]
            for name in apps:
                row = {m: statistics.median(run[name][m] for run in runs) for m in runs[0][name]}
                print(f"{k:>3} {http:>8} {name:>11} {row['turns_s']:>9.0f} {row['p50_ms']:>8.2f} "
                      f"{row['p99_ms']:>8.2f} {row['cpu_ms']:>12.3f} {row['kernel_ms']:>13.3f}")
    print("\nedge/floor on the same HTTP server, the median of the rounds' own ratios (in brackets: the middle "
          "half of them)")
    for k in ks:
        for http in http_servers:
            runs = rounds[(http, k)]
            cpu = _spread([run["edge"]["cpu_ms"] / run["floor"]["cpu_ms"] for run in runs])
            tput = _spread([run["edge"]["turns_s"] / run["floor"]["turns_s"] for run in runs])
            added = statistics.median(run["edge"]["p50_ms"] - run["floor"]["p50_ms"] for run in runs)
            print(f"K={k:<3} {http:>8}  CPU/turn = {cpu} (target <= 2.0)   turns/s = {tput} (target >= 0.5 at "
                  f"K=64)   added p50 = {added:.2f} ms" + ("  (target <= 2 ms)" if k == 1 else ""))
    if MEMLOG in apps:
        print(f"\n{MEMLOG}/floor and the JetStream append's share of the edge's CPU a turn (edge - {MEMLOG}), "
              "same rounds")
        for k in ks:
            for http in http_servers:
                runs = rounds[(http, k)]
                cpu = _spread([run[MEMLOG]["cpu_ms"] / run["floor"]["cpu_ms"] for run in runs])
                log_ms = statistics.median(run["edge"]["cpu_ms"] - run[MEMLOG]["cpu_ms"] for run in runs)
                log_kernel = statistics.median(run["edge"]["kernel_ms"] - run[MEMLOG]["kernel_ms"] for run in runs)
                share = statistics.median((run["edge"]["cpu_ms"] - run[MEMLOG]["cpu_ms"]) / run["floor"]["cpu_ms"]
                                          for run in runs)
                print(f"K={k:<3} {http:>8}  CPU/turn = {cpu}   the append: {log_ms:.3f} ms a turn "
                      f"({share:.2f}x the floor's turn), {log_kernel:.3f} ms of it in the kernel")
    if STREAM in apps:
        print(f"\na streamed turn against a plain one on the same edge ({STREAM}/edge), same rounds")
        for k in ks:
            for http in http_servers:
                runs = rounds[(http, k)]
                cpu = _spread([run[STREAM]["cpu_ms"] / run["edge"]["cpu_ms"] for run in runs])
                print(f"K={k:<3} {http:>8}  CPU/turn = {cpu} (target <= 1.5)")
    if "granian" in http_servers and "uvicorn" in http_servers:
        print("\nthe edge as rollbus runs it (granian) against the floor a user would pick (the FastAPI echo on "
              "uvicorn + httptools), each round's own pair")
        for k in ks:
            pairs = zip(rounds[("granian", k)], rounds[("uvicorn", k)], strict=True)
            cpu = _spread([granian["edge"]["cpu_ms"] / uvicorn["floor"]["cpu_ms"] for granian, uvicorn in pairs])
            print(f"K={k:<3} edge@granian / floor@uvicorn  CPU/turn = {cpu} (target <= 1.5)")
    base = http_servers[0]
    print(f"\neach app and HTTP server against the floor on {base} (CPU/turn; turns/s), same rounds")
    for k in ks:
        floors = [run["floor"] for run in rounds[(base, k)]]
        cells = []
        for http in http_servers:
            for name in apps:
                if (http, name) == (base, "floor"):
                    continue
                pairs = list(zip((run[name] for run in rounds[(http, k)]), floors, strict=True))
                cpu_x = statistics.median(run["cpu_ms"] / floor["cpu_ms"] for run, floor in pairs)
                tput_x = statistics.median(run["turns_s"] / floor["turns_s"] for run, floor in pairs)
                cells.append(f"{name}@{http} {cpu_x:.2f}x; {tput_x:.2f}x")
        print(f"K={k:<3} " + "   ".join(cells))


def _spread(values: list[float]) -> str:
    values = sorted(values)
    quarter = len(values) // 4
    return f"{statistics.median(values):.2f}x [{values[quarter]:.2f}-{values[-quarter - 1]:.2f}]"


def prompt_tokens() -> int:
    from edge.chat.conversation import template_message, template_tools
    from edge.tokens.tokenizer import load_tokenizer
    from edge.wires.openai import decode_request

    tokenizer = load_tokenizer("builtin:qwen2.5")
    conversation = decode_request(bodies(1)[0])
    text = tokenizer.chat_template.render([template_message(m) for m in conversation.messages],
                                          tools=template_tools(conversation.tools), add_generation_prompt=True)
    return len(tokenizer.encode(text))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="1,16,64")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5, help="rounds per K and seed")
    parser.add_argument("--seeds", default="0,1,2", help="PYTHONHASHSEED of each set of servers")
    parser.add_argument("--servers", default="granian,uvicorn", help="HTTP servers, each running a floor and an edge")
    parser.add_argument("--memlog", action="store_true",
                        help=f"also run the edge on the in-memory log ({MEMLOG}): what the JetStream append costs")
    parser.add_argument("--stream", action="store_true",
                        help=f"also run the edge's agents asking for streamed replies ({STREAM})")
    args = parser.parse_args()
    apps = ("floor", "edge", *((MEMLOG,) if args.memlog else ()), *((STREAM,) if args.stream else ()))
    ks = [int(k) for k in args.ks.split(",")]
    seeds = [int(seed) for seed in args.seeds.split(",")]
    http_servers = args.servers.split(",")
    server_cpu = pin_load_generator()
    turn_bodies = bodies(args.turns)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(Path(tmp) / "nats", name="bench") as nats:
        rounds = await measure(nats.url, ks, turn_bodies, args.repeat, server_cpu, seeds, http_servers,
                               apps)
    report(rounds, prompt_tokens(), seeds, http_servers, ks, apps)


if __name__ == "__main__":
    asyncio.run(main())
